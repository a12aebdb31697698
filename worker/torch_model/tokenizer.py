"""HF tokenizer folder -> tokenize / token bytes / BOS-EOS / chat template, via `tokenizers` only.

Reads tokenizer.json (the fast-tokenizer file), tokenizer_config.json, generation_config.json
and config.json. BOS is added by us (not by the tokenizer's post-processor) so `add_special`
means exactly what it means for llama.cpp: prepend BOS when the model wants one.
`parse_special=False` uses a second tokenizer instance with `encode_special_tokens` set, so
both modes are thread-safe without toggling shared state.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from worker.text.fim import FIM_TOKEN_TEXTS, FimTokens

# Turn-end tokens llama.cpp also treats as end-of-generation when the vocabulary has them.
_EOG_TEXTS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|end|>",
    "<end_of_turn>", "<|return|>", "<|call|>",
)
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table (byte-level BPE vocabularies)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def _chat_template(root: Path, tok_cfg: dict[str, Any]) -> str | None:
    tmpl = tok_cfg.get("chat_template")
    if isinstance(tmpl, list):  # named templates: [{"name": "default", "template": "..."}]
        named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
        tmpl = named.get("default") or next(iter(named.values()), None)
    if isinstance(tmpl, str) and tmpl:
        return tmpl
    jinja = root / "chat_template.jinja"
    return jinja.read_text(encoding="utf-8") if jinja.is_file() else None


class HFTokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        root = Path(model_dir)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file} not found (only fast-tokenizer checkpoints are supported)")
        self._tok = Tokenizer.from_file(str(tok_file))
        self._tok_literal = Tokenizer.from_file(str(tok_file))
        self._tok_literal.encode_special_tokens = True
        tok_json = _read_json(tok_file)
        tok_cfg = _read_json(root / "tokenizer_config.json")
        gen_cfg = _read_json(root / "generation_config.json")
        model_cfg = _read_json(root / "config.json")

        self._byte_level = "ByteLevel" in json.dumps(tok_json.get("decoder")) or "ByteLevel" in json.dumps(
            tok_json.get("pre_tokenizer")
        )
        self._special: dict[int, str] = {
            i: t.content for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }
        self.n_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template = _chat_template(root, tok_cfg)

        bos_ids = _ids(gen_cfg.get("bos_token_id")) or _ids(model_cfg.get("bos_token_id"))
        eos_ids = _ids(gen_cfg.get("eos_token_id")) + _ids(model_cfg.get("eos_token_id"))
        self.bos_token = _token_text(tok_cfg.get("bos_token")) or ""
        self.eos_token = _token_text(tok_cfg.get("eos_token")) or ""
        bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = bos_id if bos_id is not None else (bos_ids[0] if bos_ids else -1)
        self.eos_token_id = eos_id if eos_id is not None else (eos_ids[0] if eos_ids else -1)
        if not self.bos_token and self.bos_token_id >= 0:
            self.bos_token = self._tok.id_to_token(self.bos_token_id) or ""
        if not self.eos_token and self.eos_token_id >= 0:
            self.eos_token = self._tok.id_to_token(self.eos_token_id) or ""

        add_bos = tok_cfg.get("add_bos_token")
        if add_bos is None:  # ask the post-processor whether it would add BOS
            with_special = self._tok.encode("a", add_special_tokens=True).ids
            add_bos = bool(with_special) and with_special[0] == self.bos_token_id
        self.add_bos = bool(add_bos) and self.bos_token_id >= 0

        eog = {i for i in [*eos_ids, self.eos_token_id] if i >= 0}
        for text in _EOG_TEXTS:
            tid = self._tok.token_to_id(text)
            if tid is not None and tid in self._special:
                eog.add(tid)
        self.eog_ids = frozenset(eog)
        self._pieces: dict[int, bytes] = {}

    def fim_tokens(self) -> FimTokens:
        """Fill-in-the-middle tokens found by their usual names
        (as llama.cpp does for a GGUF without them)."""

        def find(kind: str) -> int:
            ids = (self._tok.token_to_id(text) for text in FIM_TOKEN_TEXTS[kind])
            return next((i for i in ids if i is not None), -1)

        return FimTokens(*(find(kind) for kind in ("pre", "suf", "mid", "rep", "sep")))

    def token_id(self, token: str) -> int:
        """The id of a vocabulary entry (as transformers' convert_tokens_to_ids); KeyError if none."""
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise KeyError(f"{token!r} is not in the vocabulary")
        return int(tid)

    def tokenize(self, text: str, add_special: bool, parse_special: bool) -> list[int]:
        tok = self._tok if parse_special else self._tok_literal
        ids: list[int] = tok.encode(text, add_special_tokens=False).ids
        if add_special and self.add_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def token_to_piece(self, token: int, special: bool = False) -> bytes:
        """The token's bytes. A special added token (llama.cpp's CONTROL type after conversion)
        is empty unless `special`, as llama.cpp renders it: generated text never shows
        `<|im_end|>` and the like, even with `ignore_eos`."""
        if token in self._special:
            return self._special[token].encode("utf-8") if special else b""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._piece(token)
            self._pieces[token] = piece
        return piece

    def _piece(self, token: int) -> bytes:
        text = self._tok.id_to_token(token)
        if text is None:
            return b""
        if self._byte_level:
            table = _byte_decoder()
            return b"".join(bytes([table[c]]) if c in table else c.encode("utf-8") for c in text)
        m = _BYTE_PIECE.match(text)
        if m:
            return bytes([int(m.group(1), 16)])
        return text.replace("\u2581", " ").encode("utf-8")

    def is_eog(self, token: int) -> bool:
        return token in self.eog_ids
