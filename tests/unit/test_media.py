"""Media ids (worker/backends/media.py), the cores an encode takes from the decode (mtmd.py), and
how chat parts become markers and media items (worker/server/media.py): pure parts, no model."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from worker.backends.media import (
    AudioBytes,
    chunk_ids,
    is_media,
    media_id,
    media_key,
    rows_of,
    run_length,
    run_piece,
    split_id,
)
from worker.backends.mtmd import EncodeShare, is_audio_file, labels
from worker.protocol.wire import ChatMessage
from worker.server.media import AudioPart, extract, media_kinds

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


def test_run_piece_takes_text_whole_and_a_chunk_whole_with_media_piece_0() -> None:
    feed = [*chunk_ids(A, 16), 7, 8]
    assert run_piece(feed, max_piece=512) == 16
    assert run_piece(feed, max_piece=8) == 8  # cut at n_ubatch only
    assert run_piece([7, 8, 9, *chunk_ids(A, 4)], max_piece=512, media_piece=2) == 3  # text: whole
    rows = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    np.testing.assert_array_equal(rows_of({A: rows}, feed[5:9]), rows[5:9])


def _pieces(feed: list[int], media_piece: int) -> list[int]:
    out = []
    while feed:
        n = run_piece(feed, max_piece=512, media_piece=media_piece)
        out.append(n)
        feed = feed[n:]
    return out


@pytest.mark.parametrize(
    ("n_rows", "start", "pieces"),
    [
        (64, 0, [16, 16, 16, 16]),
        (81, 0, [16, 16, 16, 16, 17]),  # a SmolVLM tile: the last row goes with the piece before
        (150, 0, [16] * 9 + [6]),  # 30 s of the tiny Ultravox: the 6 left over are a piece of their own
        (17, 0, [17]),
        (10, 0, [10]),
        (64, 5, [11, 16, 16, 16]),  # resumed inside a chunk: the same cuts after the first
        (64, 15, [17, 16, 16]),  # ... never a one-row piece
    ],
)
def test_a_chunk_goes_in_pieces_at_fixed_rows(n_rows: int, start: int, pieces: list[int]) -> None:
    feed = [*chunk_ids(A, n_rows)[start:], 7, 8]
    assert _pieces(feed, 16) == [*pieces, 2]
    assert all(p >= 2 for p in pieces)


def test_an_encode_takes_half_the_cores_from_the_decode_while_it_runs() -> None:
    share = EncodeShare(threads=4)
    assert (share.encode_threads, share.decode_threads()) == (2, 4)
    started, release = threading.Event(), threading.Event()

    def encode() -> None:
        with share.encoding():
            started.set()
            release.wait(10)

    t = threading.Thread(target=encode)
    t.start()
    assert started.wait(10)
    with share.step() as n:
        assert n == 2  # the engine's next steps leave the encoder its cores
    release.set()
    t.join(10)
    with share.step() as n:
        assert n == 4
    assert EncodeShare(threads=1).encode_threads == 1 and EncodeShare(threads=1).decode_threads() == 1


def test_an_encode_waits_for_the_end_of_a_step_that_took_every_core() -> None:
    share = EncodeShare(threads=2)
    events: list[str] = []
    encoded = threading.Event()

    def encode() -> None:
        with share.encoding():
            events.append("encode")
        encoded.set()

    with share.step() as n:
        assert n == 2
        t = threading.Thread(target=encode)
        t.start()
        assert not encoded.wait(0.2)  # held back while the step runs on both cores
        events.append("step ends")
    assert encoded.wait(10)
    t.join(10)
    assert events == ["step ends", "encode"]


@pytest.mark.parametrize(
    ("data", "is_audio"),
    [
        (b"RIFF\x24\x00\x00\x00WAVEfmt ", True),
        (b"ID3\x04\x00\x00\x00\x00\x00\x00\x00\x00", True),
        (b"\xff\xfb\x90\x64" + b"\x00" * 8, True),  # an MPEG frame sync
        (b"fLaC\x00\x00\x00\x22" + b"\x00" * 4, True),
        (b"RIFF\x24\x00\x00\x00AVI LIST", False),  # RIFF, not WAVE
        (b"\xff\xd8\xff\xe0" + b"\x00" * 8, False),  # a JPEG is no MPEG sync (0xD8)
        (b"\x89PNG\r\n\x1a\n" + b"\x00" * 4, False),
        (b"RIFF", False),  # under 12 bytes, as libmtmd's helper
    ],
    ids=["wav", "mp3-id3", "mp3-sync", "flac", "avi", "jpeg", "png", "short"],
)
def test_is_audio_file_is_libmtmds_test(data: bytes, is_audio: bool) -> None:
    assert is_audio_file(data) is is_audio


def test_errors_count_images_and_audio_apart() -> None:
    media = [b"png", AudioBytes(b"wav"), b"jpg", AudioBytes(b"mp3")]
    assert labels(media) == ["image 0", "audio 0", "image 1", "audio 1"]
    assert media_key(AudioBytes(b"x"), 0) == media_key(b"x", 0)  # keyed by the bytes alone


def test_audio_parts_become_markers_in_order_with_the_images() -> None:
    audio = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [ChatMessage(role="user", content=[{"type": "text", "text": "Hear"}, audio,
                                                  {"type": "text", "text": "and see"}, image])]
    assert media_kinds(messages, None) == {"image", "audio"}
    assert media_kinds([ChatMessage(role="user", content="hi")], None) == set()
    got = extract(messages, None, "<M>")
    assert got.messages[0].content == "Hear<M>and see<M>"
    assert got.items == [AudioPart("UklGRg==", "wav"), "data:image/png;base64,AAAA"]
    assert (got.n_images, got.n_audio) == (1, 1)
