"""llama-server's slot files (`--slot-save-path`, POST /slots/{id}?action=save|restore): one
slot's KV cache on disk, to be loaded into any slot later so that a prompt with the same prefix
reuses it.

The file is ours, not llama.cpp's (`llama_state_seq_save_file`): the engine needs more than the
tokens to reuse rows reproducibly (which rows are prompt rows, of which class: `RowRecipe`), and
the torch backend has its own KV layout. Layout: MAGIC, a little-endian u32 header length, the
JSON header (tokens, rows, the model and backend the state belongs to), then the backend's
`seq_state_get` bytes. A file from another model or backend is refused, never loaded.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"OMNISLOT1\n"
_MAX_NAME = 255
_BAD_NAME = re.compile(r"[\x00-\x1f/\\:*?\"<>|]")


class SlotFileError(ValueError):
    """The file is missing, damaged, or was written for another model."""


@dataclass(frozen=True, slots=True)
class SlotFile:
    tokens: list[int]
    n_prompt_rows: int
    prompt_class: int
    model: str  # what the state belongs to: model path and backend kind
    state: bytes


def is_valid_filename(name: str) -> bool:
    """llama.cpp's fs_validate_filename, in short: one plain file name in the save directory."""
    return 0 < len(name.encode()) <= _MAX_NAME and name not in (".", "..") and not _BAD_NAME.search(name) \
        and not name.startswith(" ") and not name.endswith((" ", "."))


def write(path: Path, f: SlotFile) -> int:
    """Write atomically (a temp file, then rename); the number of bytes written."""
    header = json.dumps({"tokens": f.tokens, "n_prompt_rows": f.n_prompt_rows, "prompt_class": f.prompt_class,
                         "model": f.model}).encode()
    data = MAGIC + struct.pack("<I", len(header)) + header + f.state
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return len(data)


def read(path: Path, model: str) -> tuple[SlotFile, int]:
    """(the file, its size); SlotFileError unless it is one of ours, for `model`."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise SlotFileError(f"cannot read slot file {path.name!r}: {e.strerror}") from None
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise SlotFileError(f"{path.name!r} is not a slot file saved by omni-worker")
    (n,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        h = json.loads(data[start : start + n])
        f = SlotFile(
            [int(t) for t in h["tokens"]],
            int(h["n_prompt_rows"]),
            int(h["prompt_class"]),
            str(h["model"]),
            data[start + n :],
        )
    except (ValueError, KeyError, TypeError):
        raise SlotFileError(f"{path.name!r} is damaged (bad header)") from None
    if f.model != model:
        raise SlotFileError(f"{path.name!r} holds a KV cache of another model ({f.model}), not of {model}")
    return f, len(data)
