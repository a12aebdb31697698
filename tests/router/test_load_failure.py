"""router.lifecycle.load_failure: the one-line cause and whether a failed load is worth retrying (issue 25:
a file that is not a GGUF was respawned on every retry of the openai SDK, and its cause sat in
the middle of log lines joined with ' | ')."""

from __future__ import annotations

import pytest

from router.lifecycle.load_failure import diagnose

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
