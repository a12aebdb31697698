"""Media ids (worker/backends/media.py) and the encode/decode turn-taking (worker/backends/mtmd.py):
pure parts, no model."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.util import wait_until
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
from worker.backends.mtmd import ComputeGate

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


def test_an_encode_waiting_goes_before_the_next_step_and_never_beside_one() -> None:
    gate = ComputeGate()
    order: list[str] = []
    in_step, release = threading.Event(), threading.Event()

    def first_step() -> None:
        order.append("step 1")
        in_step.set()
        release.wait(10)

    def engine() -> None:
        gate.run("decode", first_step)
        gate.run("decode", order.append, "step 2")  # asks again at once, as the engine loop does

    t_engine = threading.Thread(target=engine)
    t_engine.start()
    assert in_step.wait(10)
    t_encode = threading.Thread(target=gate.run, args=("encode", order.append, "encode"))
    t_encode.start()
    wait_until(lambda: gate._waiting["encode"] == 1, 10, what="the encode to wait for the step")
    assert order == ["step 1"]  # not beside the step in progress
    release.set()
    t_engine.join(10)
    t_encode.join(10)
    assert order == ["step 1", "encode", "step 2"]
