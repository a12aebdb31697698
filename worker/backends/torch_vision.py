"""The torch backend's `Vision` (worker/backends/media.py) for an Idefics3/SmolVLM HF folder: the
prompt libmtmd makes of the same text and images, with the rows of our own vision tower.

`TorchVision.prepare` runs on an HTTP worker thread, never on the engine thread, as
worker/backends/mtmd.py's does, and gives the same `MediaPrompt` the llama.cpp backend gives for
the GGUF twin (the same ids, media keys and chunk order; rows equal to rounding):

- decode: stb_image through libmtmd's helper (`decode_rgb`), so the pixels are the llama.cpp
  backend's, JPEG included; the same 400s (not an image, --image-max-pixels); a video's frames
  (`FrameBytes`) come decoded, as they go to libmtmd on the other backend;
- tiles: libmtmd's idefics3 preprocessing in numpy, byte for byte (worker/torch_model/image.py);
- text: split at the marker, each piece tokenized with special tokens parsed, BOS first when the
  tokenizer adds one (mtmd_tokenize); an image is its slices row by row, each after
  `<fake_token_around_image><row_R_col_C>` with "\\n" between rows, then the overview between
  "\\n\\n" <fake_token_around_image> <global-img> and <fake_token_around_image> (libmtmd's
  layout for the idefics3 projector: mtmd.cpp; the four tokens looked up by their text as
  libmtmd does, the first id whose piece it is);
- rows: each tile through `Idefics3Vision` (one batch for an image's uncached tiles), cached
  in an LRU keyed like the media ids (the image bytes and the chunk's index).

Encodes run under one lock, on the engine's device and dtype, beside the engine's steps (the
cores are not split between them as the llama.cpp backend's EncodeShare does).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from worker.backends.media import (
    AudioBytes,
    ChunkCache,
    FrameBytes,
    MediaError,
    MediaPrompt,
    chunk_ids,
    media_key,
)
from worker.backends.mtmd import decode_rgb, labels
from worker.torch_model.image import Triple, idefics3_tiles, normalize
from worker.torch_model.tokenizer import HFTokenizer
from worker.torch_model.vision import Idefics3Vision

MARKER = "<__media__>"  # libmtmd's default marker (mtmd_default_marker), so both backends take one text
_LAYOUT = ("\n\n", "<fake_token_around_image>", "<global-img>", "\n")


class TorchVision:
    """An Idefics3 model's vision side on the torch backend (module doc)."""

    def __init__(self, model_dir: str | Path, tower: Idefics3Vision, tokenizer: HFTokenizer, *,
                 max_pixels: int = 0) -> None:
        pre = json.loads((Path(model_dir) / "preprocessor_config.json").read_text(encoding="utf-8"))
        self.tile = tower.cfg.image_size
        # what convert_hf_to_gguf writes as clip.vision.preproc_image_size
        self.longest_edge = int(pre.get("size", {}).get("longest_edge", self.tile))
        self.mean = _triple(pre.get("image_mean", [0.5] * 3))
        self.std = _triple(pre.get("image_std", [0.5] * 3))
        self.marker = MARKER
        self.has_vision = True
        self.has_audio = False  # no audio side on the torch backend
        self.max_pixels = max_pixels
        self._tower = tower
        self._tok = tokenizer
        self._ids = _lookup(tokenizer, _LAYOUT)
        self._lock = threading.Lock()
        self._cache = ChunkCache()

    def prepare(self, text: str, images: Sequence[bytes]) -> MediaPrompt:
        if any(isinstance(data, AudioBytes) for data in images):  # the HTTP side refuses it first
            raise MediaError("audio input is not supported on the torch backend")
        n_markers = text.count(self.marker)
        if n_markers != len(images):
            raise MediaError(f"the prompt has {n_markers} image markers for {len(images)} images")
        names = labels(images)  # "image 1", "video 0 frame 2"
        pixels = [data.rgb if isinstance(data, FrameBytes)  # a video's frames come decoded (video.py)
                  else decode_rgb(int(name.split()[1]), data, self.max_pixels)
                  for name, data in zip(names, images, strict=True)]
        out = MediaPrompt(tokens=[self._tok.bos_token_id] if self._tok.add_bos else [])
        pieces = text.split(self.marker)
        out.tokens.extend(self._tok.tokenize(pieces[0], False, True))
        for i, (data, rgb) in enumerate(zip(images, pixels, strict=True)):
            self._image(names[i], data, rgb, out)
            out.tokens.extend(self._tok.tokenize(pieces[i + 1], False, True))
        return out

    def _image(self, name: str, data: bytes, rgb: np.ndarray, out: MediaPrompt) -> None:
        try:
            tiles = idefics3_tiles(rgb, self.tile, self.longest_edge)
        except ValueError as e:
            raise MediaError(f"{name}: {e}") from None
        n = tiles.grid_x * tiles.grid_y
        keys = [media_key(data, j) for j in range(n + 1)]  # the slices, then the overview
        rows = self._rows(keys, np.concatenate([tiles.slices, tiles.overview[None]]), out)
        nl2, fake, glob, nl = self._ids
        for y in range(tiles.grid_y):
            for x in range(tiles.grid_x):
                j = y * tiles.grid_x + x
                out.tokens.extend(self._tok.tokenize(f"<fake_token_around_image><row_{y + 1}_col_{x + 1}>",
                                                     False, True))
                out.tokens.extend(chunk_ids(keys[j], rows[j].shape[0]))
            if y != tiles.grid_y - 1:
                out.tokens.append(nl)
        out.tokens.extend((nl2, fake, glob))
        out.tokens.extend(chunk_ids(keys[n], rows[n].shape[0]))
        out.tokens.append(fake)
        out.media.update(zip(keys, rows, strict=True))

    def _rows(self, keys: list[int], tiles: np.ndarray, out: MediaPrompt) -> list[np.ndarray]:
        """Each tile's rows [tokens_per_tile, n_embd] float32: from the cache, or encoded now (the
        missing tiles in one batch)."""
        with self._lock:
            rows: dict[int, np.ndarray] = {}
            for j, key in enumerate(keys):
                cached = self._cache.get(key)
                if cached is not None:
                    rows[j] = cached
            todo = [j for j in range(len(keys)) if j not in rows]
            out.n_cached += len(keys) - len(todo)
            if todo:
                t0 = time.perf_counter()
                batch = torch.from_numpy(normalize(tiles[todo], self.mean, self.std))
                device = self._tower.proj.weight.device
                encoded = self._tower(batch.to(device)).float().cpu().numpy()
                out.encode_seconds += time.perf_counter() - t0
                out.n_encoded += len(todo)
                for j, emb in zip(todo, encoded, strict=True):
                    rows[j] = emb
                    self._cache.put(keys[j], emb)
            return [rows[j] for j in range(len(keys))]


def _triple(values: Sequence[float]) -> Triple:
    a, b, c = (float(v) for v in values)
    return a, b, c


def _lookup(tokenizer: HFTokenizer, texts: Sequence[str]) -> list[int]:
    """libmtmd's `lookup_token`: the first id whose piece (special tokens as their text) is the text."""
    wanted = {t.encode(): t for t in texts}
    found: dict[str, int] = {}
    for i in range(tokenizer.n_vocab):
        text = wanted.get(tokenizer.token_to_piece(i, True))
        if text is not None and text not in found:
            found[text] = i
            if len(found) == len(wanted):
                break
    missing = [t for t in texts if t not in found]
    if missing:
        raise ValueError(f"the vocabulary has no token {missing[0]!r}, which the idefics3 image layout needs")
    return [found[t] for t in texts]
