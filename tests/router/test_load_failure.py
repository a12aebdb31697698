"""router.lifecycle.load_failure: the one-line cause and whether a failed load is worth retrying (issue 25:
a file that is not a GGUF was respawned on every retry of the openai SDK, and its cause sat in
the middle of log lines joined with ' | ')."""

from __future__ import annotations

import pytest

from router.lifecycle.load_failure import diagnose, permanent_failure

TRUNCATED = [
    "06:50:50.200 WARNING worker.llama_cpp: llama.cpp: llama_model_load: error loading model: tensor "
    "'token_embd.weight' data is not within the file bounds, model is corrupted or incomplete",
    "06:50:50.200 WARNING worker.llama_cpp: llama.cpp: llama_model_load_from_file_impl: failed to load model",
    "06:50:50.200 ERROR worker.engine.engine: model load failed: llama.cpp failed to load '/tmp/t.gguf' "
    "(not a valid GGUF model?)",
    "06:50:51.367 INFO worker: exit 1",
]
NOT_GGUF = [
    "06:50:53.199 WARNING worker.llama_cpp: llama.cpp: gguf_init_from_reader: "
    "invalid magic characters: 'not ', expected 'GGUF'",
    "06:50:53.199 WARNING worker.llama_cpp: llama.cpp: llama_model_load: error loading model: "
    "llama_model_loader: failed to load model from /tmp/junk.gguf",
    "06:50:53.199 ERROR worker.engine.engine: model load failed: llama.cpp failed to load '/tmp/junk.gguf' "
    "(not a valid GGUF model?)",
]


@pytest.mark.parametrize(
    ("tail", "code", "reason", "was_ready", "cause", "is_permanent"),
    [
        (
            TRUNCATED,
            1,
            "exited with code 1",
            False,
            "tensor 'token_embd.weight' data is not within the file bounds, model is corrupted or incomplete",
            True,
        ),
        # the same cause whichever the router saw first (the race of issue 25)
        (
            TRUNCATED,
            None,
            "the worker reported a failed load (500): ...",
            False,
            "tensor 'token_embd.weight' data is not within the file bounds, model is corrupted or incomplete",
            True,
        ),
        (NOT_GGUF, 1, "exited with code 1", False, "invalid magic characters: 'not ', expected 'GGUF'", True),
        (
            ["ERROR worker.engine.engine: model load failed: unsupported architecture 'mamba'"],
            1,
            "exited with code 1",
            False,
            "unsupported architecture 'mamba'",
            True,
        ),
        (
            ["omni-worker: error: unknown option --control-vector: omni-worker does not implement it"],
            2,
            "exited with code 2",
            False,
            "unknown option --control-vector: omni-worker does not implement it",
            True,
        ),
        # killed while loading (the OOM killer, say): may do better next time
        (["loading..."], -9, "exited with code -9", False, "exited with code -9", False),
        (["loading..."], None, "not ready after 300s", False, "not ready after 300s", False),
        # a crash after it served is a crash, not a bad file
        (
            ["Traceback (most recent call last):", "RuntimeError: boom"],
            1,
            "exited with code 1",
            True,
            "exited with code 1",
            False,
        ),
        (["fake worker a"], 1, "exited with code 1", False, "exited with code 1", False),
    ],
)
def test_cause_and_permanence(tail: list[str], code: int | None, reason: str, was_ready: bool, cause: str,
                              is_permanent: bool) -> None:
    f = diagnose(tail, code, reason, was_ready=was_ready)
    assert (f.cause, f.is_permanent) == (cause, is_permanent)


def test_a_port_taken_before_the_worker_listened_is_the_box_not_the_model() -> None:
    """bench/storm.py: under 20,000 connections the router's pick of a free port was taken as a
    connection's local port before the worker bound it; uvicorn exits 3 and the model's whole
    queue failed with a 503, as for a broken model."""
    tail = ["14:24:46 INFO worker: omni-worker: model m.gguf (backend llama_cpp), 8 slots, listening on "
            "127.0.0.1:40123",
            "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 40123): address "
            "already in use"]
    failure = diagnose(tail, 3, "exited with code 3", was_ready=False)
    assert not failure.is_permanent and failure.is_the_box and "EADDRINUSE" in failure.cause


def test_a_worker_port_is_picked_below_the_ephemeral_range() -> None:
    from router.lifecycle.process import _ephemeral_low, free_port

    low = _ephemeral_low()
    if low <= 2048:
        pytest.skip(f"no room below this kernel's ephemeral range (it starts at {low})")
    assert all(1024 <= free_port() < low for _ in range(20))


@pytest.mark.parametrize(("is_misconfigured", "status", "type_", "code"), [
    (False, 500, "server_error", "model_load_failed"),  # llama.cpp cannot read it, a bad flag
    (True, 503, "unavailable_error", "model_misconfigured"),  # the preset names a file or hub tag not there
])
def test_a_permanent_failure_is_a_503_when_the_configuration_is_at_fault(
        is_misconfigured: bool, status: int, type_: str, code: str) -> None:
    e = permanent_failure("m", "org/x has no 'Q2_K' model (tags: F16, Q8_0)", [],
                          is_misconfigured=is_misconfigured)
    assert (e.status_code, e.type, e.code) == (status, type_, code)
    assert e.headers is not None and e.headers["x-should-retry"] == "false"  # neither is retried
    assert "tags: F16, Q8_0" in e.message
