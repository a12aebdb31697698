"""Idefics3's image preprocessing as libmtmd does it (llama.cpp tools/mtmd/mtmd-image.cpp,
`mtmd_image_preprocessor_idefics3`), in numpy: the same tiles, pixel for pixel.

    RGB uint8 [H, W, 3]
      -> resize, aspect kept, so that the longer side is `longest_edge` (the shorter rounded
         down, then up to even)
      -> resize to whole tiles: each side up to a multiple of `tile` (the "refined" image)
      -> slices: the refined image cut into grid_y x grid_x tiles, row by row
      -> overview: the refined image resized to one tile
      -> each tile to float32 x / 255, then (x - mean) / std, channels first

Every resize is Lanczos (a = 3) in the arithmetic of Pillow's Resample.c, which libmtmd ports
(`img_tool::resize_pillow`): weights rounded to 22-bit fixed point, a horizontal pass then a
vertical one (a pass only where that side changes; Pillow itself may run the vertical pass
first, libmtmd never does), each rounded and clipped to uint8. The arithmetic is integer, so
these numpy passes give libmtmd's bytes exactly (the weights are computed in double with
`math.sin`, as the C code does, before rounding to 22 bits). Checked while writing this: each
pass bitwise equal to Pillow 13's on random sizes; tests/vision/test_torch_worker_vision.py
compares the rows of the tiles with libmtmd's (a wrong pass order is off by 0.2, not 3e-3).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_PRECISION_BITS = 32 - 8 - 2
_SUPPORT = 3.0  # Lanczos-3


def _lanczos(x: float) -> float:
    if not -3.0 <= x < 3.0:
        return 0.0

    def sinc(v: float) -> float:
        if v == 0.0:
            return 1.0
        pi_v = v * math.pi
        return math.sin(pi_v) / pi_v

    return sinc(x) * sinc(x / 3.0)


def _weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per output pixel: the input indices it reads [out, k] and their fixed-point weights [out, k]
    (zero past each pixel's window), as Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc`."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = _SUPPORT * filterscale
    ksize = math.ceil(support) * 2 + 1
    index = np.zeros((out_size, ksize), dtype=np.int64)
    fixed = np.zeros((out_size, ksize), dtype=np.int32)
    one = math.ldexp(1.0, _PRECISION_BITS)
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        ss = 1.0 / filterscale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        w = [_lanczos((x + xmin - center + 0.5) * ss) for x in range(xmax)]
        total = 0.0
        for v in w:
            total += v
        for x, v in enumerate(w):
            v = v / total if total != 0.0 else v
            fixed[xx, x] = int(v * one + (-0.5 if v < 0 else 0.5))  # truncated toward zero, as C
            index[xx, x] = xmin + x
    return index, fixed


def _resample(img: np.ndarray, out_size: int, axis: int) -> np.ndarray:
    """One pass of `img` [H, W, 3] uint8 along `axis` (1: width, 0: height) to `out_size`.
    int32 as the C code (whose sums cannot overflow: |weights| sum to under 2^23.5)."""
    index, fixed = _weights(img.shape[axis], out_size)
    src = img.astype(np.int32)
    shape = list(img.shape)
    shape[axis] = out_size
    acc = np.full(shape, 1 << (_PRECISION_BITS - 1), dtype=np.int32)
    for k in range(index.shape[1]):
        taps = np.take(src, index[:, k], axis=axis)
        w = fixed[:, k].reshape((-1, 1) if axis == 0 else (1, -1))[..., None]
        acc += taps * w
    out: np.ndarray = np.clip(acc >> _PRECISION_BITS, 0, 255).astype(np.uint8)
    return out


def resize(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """libmtmd's `img_tool::resize` without padding: Lanczos, Pillow's arithmetic (module doc)."""
    if width <= 0 or height <= 0 or width > 65536 or height > 65536:
        raise ValueError(f"resize target {width}x{height} is out of range")
    out = img
    if width != img.shape[1]:
        out = _resample(out, width, axis=1)
    if height != img.shape[0]:
        out = _resample(out, height, axis=0)
    return out


@dataclass(frozen=True, slots=True)
class Tiles:
    """An image's tiles in libmtmd's order: the slices row by row, then the overview."""

    slices: np.ndarray  # [grid_y * grid_x, tile, tile, 3] uint8
    overview: np.ndarray  # [tile, tile, 3] uint8
    grid_x: int
    grid_y: int


def idefics3_tiles(img: np.ndarray, tile: int, longest_edge: int) -> Tiles:
    """libmtmd's idefics3 preprocessing (the `image_longest_edge` path), before normalization."""
    height, width = img.shape[:2]
    aspect = width / height
    if width >= height:
        w, h = longest_edge, int(longest_edge / aspect)
        h += h % 2
    else:
        w, h = int(longest_edge * aspect), longest_edge
        w += w % 2
    grid_x, grid_y = (w + tile - 1) // tile, (h + tile - 1) // tile
    refined = resize(resize(img, w, h), grid_x * tile, grid_y * tile)
    slices = refined.reshape(grid_y, tile, grid_x, tile, 3).transpose(0, 2, 1, 3, 4)
    slices = slices.reshape(-1, tile, tile, 3)
    return Tiles(slices, resize(refined, tile, tile), grid_x, grid_y)


Triple = tuple[float, float, float]


def normalize(tiles: np.ndarray, mean: Triple, std: Triple) -> np.ndarray:
    """[N, S, S, 3] uint8 -> [N, 3, S, S] float32: x / 255, then (x - mean) / std, in float32 as
    clip_image_f32's from_u8 and normalize."""
    scaled = tiles.astype(np.float32) / np.float32(255.0)
    x = (scaled - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
    out: np.ndarray = np.ascontiguousarray(x.transpose(0, 3, 1, 2), dtype=np.float32)
    return out
