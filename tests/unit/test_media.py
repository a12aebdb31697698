"""Media ids (worker/backends/media.py) and the cores an encode takes from the decode (mtmd.py):
pure parts, no model."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from worker.backends.media import (
    chunk_ids,
    is_media,
    media_id,
    media_key,
    rows_of,
    run_length,
    run_piece,
    split_id,
)
from worker.backends.mtmd import EncodeShare

A = media_key(b"image a", 0)
B = media_key(b"image b", 0)


def test_ids_round_trip_fit_an_int64_and_differ_by_bytes_and_chunk() -> None:
    for key in (A, B, (1 << 40) - 1):
        for row in (0, 1, (1 << 20) - 1):
            t = media_id(key, row)
            assert is_media(t) and split_id(t) == (key, row) and t >= -(2**63)
    assert media_key(b"image a", 0) == A != B != media_key(b"image a", 1)


@pytest.mark.parametrize(
    ("feed", "run"),
    [
        ([1, 2, 3], 3),
        ([1, 2, *chunk_ids(A, 4), 5], 2),
        ([*chunk_ids(A, 4), 5], 4),
        ([*chunk_ids(A, 4)[2:], *chunk_ids(B, 3)], 2),  # a run starting mid-chunk stops at the next chunk
        ([*chunk_ids(A, 2), *chunk_ids(A, 2)], 2),  # the same image again is another run
        ([], 0),
    ],
)
def test_run_length(feed: list[int], run: int) -> None:
    assert run_length(feed) == run


def test_run_piece_is_the_whole_run_or_nothing() -> None:
    feed = [*chunk_ids(A, 16), 7, 8]
    assert run_piece(feed, room=100, max_piece=512) == 16
    assert run_piece(feed, room=10, max_piece=512) == 0  # waits for a step with room
    assert run_piece(feed, room=100, max_piece=8) == 8  # cut at n_ubatch only
    rows = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    np.testing.assert_array_equal(rows_of({A: rows}, feed[5:9]), rows[5:9])


def test_an_encode_takes_half_the_cores_from_the_decode_while_it_runs() -> None:
    share = EncodeShare(threads=4)
    assert (share.encode_threads, share.decode_threads()) == (2, 4)
    started, release = threading.Event(), threading.Event()

    def encode() -> str:
        started.set()
        release.wait(10)
        return "rows"

    t = threading.Thread(target=share.encoding, args=(encode,))
    t.start()
    assert started.wait(10)
    assert share.decode_threads() == 2  # the engine's next steps leave the encoder its cores
    release.set()
    t.join(10)
    assert share.decode_threads() == 4 and share.encoding(lambda: 7) == 7
    assert EncodeShare(threads=1).encode_threads == 1 and EncodeShare(threads=1).decode_threads() == 1
