"""Which files of a hub repo make a model: llama.cpp's `-hf REPO[:TAG]` rules, pure.

A reference is `org/repo`, `org/repo:TAG` or `org/repo` with an explicit file (`hf-file`).
TAG names a quantisation (`Q4_K_M`, `q8_0`, `F16`), case-insensitive. Without a TAG the choice
is `Q4_K_M`, then `Q8_0`, then the repo's first `.gguf` (by name). A split GGUF
(`NAME-00001-of-00003.gguf`) comes whole: every part. A `mmproj*.gguf` (the multimodal projector)
comes along, the one of the same quantisation if there is one, else F16, else the first. A repo
without GGUF models but with `config.json` and `*.safetensors` is a transformers model: its config,
tokenizer, generation config and weights, served by the torch backend. Any repo's
`generation_config.json` comes too (its sampling is the model's recommended one).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

DEFAULT_TAGS = ("Q4_K_M", "Q8_0")
_REPO_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
# A quantisation name inside a file name: I?Q<n>_..., F16, BF16, F32, MXFP4 (llama.cpp's names)
_QUANT_RE = re.compile(r"(?i)(?:^|[-._/])((?:I?Q\d(?:_[A-Z0-9]+)*)|BF16|F16|F32|MXFP4(?:_MOE)?)(?=[-._/]|$)")
_TORCH_FILES = frozenset({
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "tokenizer.model", "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "model.safetensors.index.json",
})
GENERATION_CONFIG = "generation_config.json"


class ChoiceError(ValueError):
    """No model in the repo matches: the message lists what there is (`tags`)."""

    def __init__(self, message: str, tags: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.tags = tuple(tags)


@dataclass(frozen=True)
class Ref:
    repo: str
    tag: str | None = None
    file: str | None = None  # an explicit file in the repo (hf-file): wins over the tag
    revision: str = "main"

    def __str__(self) -> str:
        return f"{self.repo}:{self.tag}" if self.tag else self.repo


def parse_ref(raw: str, file: str | None = None) -> Ref:
    """`org/repo[:TAG]` (llama.cpp's -hf form); `file` is hf-file. ValueError names what is wrong."""
    text = raw.strip()
    repo, _, tag = text.partition(":")
    if not _REPO_RE.match(repo):
        raise ValueError(f"{raw!r}: expected a hub repo as org/repo[:TAG]")
    if tag and not re.fullmatch(r"[A-Za-z0-9._-]+", tag):
        raise ValueError(f"{raw!r}: the tag after ':' is a quantisation name like Q4_K_M")
    return Ref(repo, tag or None, (file or "").strip() or None)


@dataclass(frozen=True)
class Choice:
    backend: Literal["llama_cpp", "torch"]
    model: str  # the file (GGUF: its first part) or, for torch, "" (the snapshot folder)
    files: tuple[str, ...]  # every file to fetch, the model's parts first
    mmproj: str | None = None
    tag: str | None = None  # the quantisation chosen (GGUF)


def quant_of(path: str) -> str | None:
    """The quantisation a GGUF file's name states (`Q4_K_M`), upper case; None if it states none."""
    stem = _SPLIT_RE.sub("", path)
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    found = _QUANT_RE.findall(stem)
    return found[-1].upper() if found else None


def _is_mmproj(path: str) -> bool:
    return "mmproj" in path.rsplit("/", 1)[-1].lower()


def _split_parts(first: str, files: Sequence[str]) -> tuple[str, ...]:
    m = _SPLIT_RE.search(first)
    if m is None:
        return (first,)
    base, count = first[: m.start()], int(m.group(2))
    parts = tuple(f"{base}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1))
    missing = [p for p in parts if p not in files]
    if missing:
        raise ChoiceError(f"split model {first} is missing parts: {', '.join(missing)}")
    return parts


def tags_of(files: Sequence[str]) -> list[str]:
    """The quantisations a repo offers (its GGUF models, not projectors), sorted."""
    return sorted({q for f in files if f.lower().endswith(".gguf") and not _is_mmproj(f)
                   and (q := quant_of(f)) is not None})


def choose(ref: Ref, files: Sequence[str]) -> Choice:
    """The files that make `ref`'s model, from the repo's file list."""
    names = sorted(files)
    ggufs = [f for f in names if f.lower().endswith(".gguf") and not _is_mmproj(f)]
    extra = (GENERATION_CONFIG,) if GENERATION_CONFIG in names else ()
    if ref.file is not None:
        if ref.file not in names:
            raise ChoiceError(f"{ref.repo} has no file {ref.file!r} (GGUF files: "
                              f"{', '.join(ggufs) or 'none'})", tags_of(names))
        if not ref.file.lower().endswith(".gguf"):
            raise ChoiceError(f"{ref.repo}: hf-file {ref.file!r} is not a .gguf file", tags_of(names))
        return _gguf_choice(ref.file, names, extra)
    if not ggufs:
        weights = [f for f in names if f.endswith(".safetensors")]
        if "config.json" in names and weights:
            if ref.tag is not None:
                raise ChoiceError(f"{ref.repo} is a safetensors repo: it has no quantisation tags "
                                  f"(asked for {ref.tag!r}); pull it without ':TAG'")
            wanted = tuple(f for f in names if f in _TORCH_FILES or f in weights)
            return Choice("torch", "", wanted)
        raise ChoiceError(f"{ref.repo} has no .gguf model and is no safetensors model "
                          "(config.json and *.safetensors)")
    tags = tags_of(names)
    wanted_tags = (ref.tag,) if ref.tag is not None else DEFAULT_TAGS
    for tag in wanted_tags:
        match = [f for f in ggufs if (quant_of(f) or "").upper() == tag.upper()]
        first = next((f for f in match if _SPLIT_RE.search(f) is None or "-00001-of-" in f), None)
        if first is not None:
            return _gguf_choice(first, names, extra)
    if ref.tag is not None:
        raise ChoiceError(f"{ref.repo} has no {ref.tag!r} model (tags: {', '.join(tags) or 'none'})", tags)
    first = next(f for f in ggufs if _SPLIT_RE.search(f) is None or "-00001-of-" in f)
    return _gguf_choice(first, names, extra)


def _gguf_choice(first: str, names: Sequence[str], extra: tuple[str, ...]) -> Choice:
    parts = _split_parts(first, names)
    tag = quant_of(first)
    mmprojs = [f for f in names if f.lower().endswith(".gguf") and _is_mmproj(f)]
    mmproj = (next((f for f in mmprojs if tag is not None and quant_of(f) == tag), None)
              or next((f for f in mmprojs if quant_of(f) == "F16"), None)
              or (mmprojs[0] if mmprojs else None))
    files = (*parts, *((mmproj,) if mmproj else ()), *extra)
    return Choice("llama_cpp", first, files, mmproj, tag)
