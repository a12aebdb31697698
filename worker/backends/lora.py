"""LoRA adapters: what a loaded one is, the checks that refuse an adapter made for another base
model, and llama-server's flags that name them.

An adapter changes a weight W of the base model into W + s * (alpha / r) * B A, with A [r x n_in]
and B [n_out x r] (rank r, and rsLoRA's alpha / sqrt(r)); s is the scale a request or the
global setting gives it. It is never merged into W: each step adds s * (alpha / r) * B (A x) to
the product W x (llama.cpp does so in its graph, the torch backend in
worker/torch_model/lora.py), so one base model in memory serves its adapters and itself.

Files.
- GGUF (llama.cpp's backend; what llama.cpp's convert_lora_to_gguf.py writes): `general.type`
  "adapter", `adapter.type` "lora", `adapter.lora.alpha`, and for each adapted tensor of the
  base model `<name>.lora_a` [r x n_in] and `<name>.lora_b` [n_out x r] (numpy order).
- PEFT folder (the torch backend): `adapter_config.json` (peft_type LORA, r, lora_alpha,
  target_modules, use_rslora) and `adapter_model.safetensors` with
  `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`.

Matching the base model. llama.cpp refuses a GGUF adapter whose tensors do not fit (with a log
line and a NULL); `check_gguf` reads both files' headers first and says why in words: not an
adapter, another architecture, a tensor the base model lacks, or a shape that does not fit.
The torch backend checks a PEFT folder against its model the same way (lora.py there).

Ids are the order of loading, as llama-server's: `--lora` and `--lora-scaled` in command-line
order, then adapters loaded at run time (POST /v1/load_lora_adapter). An unloaded adapter's id
is not reused (a request naming it gets a 400).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


class LoraError(ValueError):
    """An adapter that cannot be used with this model; the message says why."""


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One loaded adapter, as GET /lora-adapters reports it (`scale`: the global one)."""

    id: int
    path: str
    name: str  # what `model` may name it by: "<model>:<name>" (the file's or folder's stem, or --lora-alias)
    scale: float
    task_name: str = ""
    prompt_prefix: str = ""


def parse_scaled(spec: str) -> tuple[str, float]:
    """llama-server's `--lora-scaled FNAME:SCALE` (one item of the comma-separated list)."""
    path, sep, raw = spec.rpartition(":")
    if not sep or not path:
        raise ValueError(f"--lora-scaled {spec!r}: expected FNAME:SCALE")
    try:
        scale = float(raw)
    except ValueError:
        raise ValueError(f"--lora-scaled {spec!r}: the scale {raw!r} is not a number") from None
    check_scale(scale, f"--lora-scaled {spec!r}")
    return path, scale


def check_scale(scale: float, what: str) -> None:
    if not math.isfinite(scale):
        raise ValueError(f"{what}: a scale must be a finite number, not {scale}")


def _field(reader: object, key: str) -> object:
    """A GGUF metadata value (string or number), None when absent."""
    f = reader.fields.get(key)  # type: ignore[attr-defined]  # gguf has no type hints
    if f is None:
        return None
    value = f.contents()
    return value


def check_gguf(adapter_path: str, model_path: str) -> tuple[str, str]:
    """Refuse (LoraError, with the reason) a GGUF adapter that does not fit the GGUF model;
    returns its (task_name, prompt_prefix) metadata."""
    import gguf

    if not os.path.isfile(adapter_path):
        raise LoraError(f"{adapter_path}: no such file")
    try:
        ad = gguf.GGUFReader(adapter_path)
    except Exception as e:  # any parse failure: not a GGUF file we can read
        raise LoraError(f"{adapter_path}: not a readable GGUF file ({e})") from None
    if _field(ad, "general.type") != "adapter" or _field(ad, "adapter.type") != "lora":
        raise LoraError(f"{adapter_path}: not a LoRA adapter (general.type {_field(ad, 'general.type')!r}, "
                        f"adapter.type {_field(ad, 'adapter.type')!r})")
    base = gguf.GGUFReader(model_path)
    arch_a, arch_b = _field(ad, "general.architecture"), _field(base, "general.architecture")
    if arch_a != arch_b:
        raise LoraError(f"{adapter_path}: an adapter for architecture {arch_a!r}, the model is {arch_b!r}")
    shapes = {t.name: tuple(int(x) for x in t.shape) for t in base.tensors}  # ggml order: n_in first
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for t in ad.tensors:
        name, _, part = t.name.rpartition(".")
        if part not in ("lora_a", "lora_b"):
            raise LoraError(f"{adapter_path}: tensor {t.name!r} is not a lora_a/lora_b tensor")
        pairs.setdefault(name, {})[part] = tuple(int(x) for x in t.shape)
    if not pairs:
        raise LoraError(f"{adapter_path}: the adapter has no tensors")
    for name, ab in pairs.items():
        if set(ab) != {"lora_a", "lora_b"}:
            raise LoraError(f"{adapter_path}: {name} has lora_a or lora_b but not both")
        if name not in shapes:
            raise LoraError(f"{adapter_path}: adapts {name}, which the base model does not have")
        n_in, n_out = shapes[name][0], shapes[name][1]
        a, b = ab["lora_a"], ab["lora_b"]  # ggml order: a = [n_in, r], b = [r, n_out]
        if a[0] != n_in or b[1] != n_out or a[1] != b[0]:
            raise LoraError(
                f"{adapter_path}: {name} is {n_out} x {n_in} in the base model, the adapter's "
                f"B A is {b[1]} x {b[0]} times {a[1]} x {a[0]}: made for another base model"
            )
    task_name, prefix = _field(ad, "adapter.lora.task_name"), _field(ad, "adapter.lora.prompt_prefix")
    return str(task_name or ""), str(prefix or "")
