"""Reading HF safetensors checkpoints: single file or sharded (`model.safetensors.index.json`).

Tensors are streamed one at a time, converted to the target dtype on the target device and
handed to `Model.load_weights`, so peak extra memory is one tensor, not a second model.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return [root / name for name in sorted(set(weight_map.values()))]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {root}")
    return files


def tensor_names(files: list[Path]) -> set[str]:
    names: set[str] = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


def iter_tensors(
    files: list[Path],
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    progress: Callable[[float], None] | None = None,
    keep: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) in `dtype` on `device`; `progress` gets the fraction of bytes read.
    `keep`: only the tensors whose names it accepts are read (e.g. a VLM's vision side)."""
    total = sum(p.stat().st_size for p in files) or 1
    done = 0
    dev = torch.device(device)
    for path in files:
        # safetensors can place tensors on a CUDA device directly; conversion happens there.
        open_device = (
            f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
            if dev.type == "cuda"
            else "cpu"
        )
        with safe_open(str(path), framework="pt", device=open_device) as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if keep is not None and not keep(name):
                    continue
                tensor = f.get_tensor(name)
                done += tensor.numel() * tensor.element_size()
                yield name, tensor.to(device=dev, dtype=dtype)
                if progress is not None:
                    progress(min(done / total, 1.0))
