"""Why a worker failed, in one line, and whether trying again can help. Pure: no I/O, no state.

A load the worker itself reported as failed (llama.cpp could not read the file, an unsupported
architecture, a bad flag: exit code 2) fails the same way every time, until the file or the
preset changes: it is *permanent*, answered at once with a status clients do not retry. A
process that died on its own (killed, out of memory, a crash after it served) or never became
ready in time may do better next time: it is retried, with backoff.

A permanent failure whose cause is the configuration, not the model or the box (the preset's model
file is not there; its `hf-repo` names a repo, tag or file the hub does not have) is no server
crash: it is a 503 (the model is unavailable until the operator fixes the preset), with
`x-should-retry: false` (the SDKs obey it before Retry-After, which every 503 carries), its
message naming what is missing (the hub's tags).
Every other permanent failure (llama.cpp cannot read the file, a bad flag) stays a 500.

The cause is picked from the log tail by priority (llama.cpp's own words first, they name the
real problem, e.g. "tensor 'token_embd.weight' data is not within the file bounds"), so the
message is the same whichever the router noticed first: `/health` answering 500 or the exit.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from worker.protocol.errors import APIError

# The crash backoff: a model that keeps failing waits longer before each respawn.
STABLE_AFTER_S = 60.0  # a model READY this long before crashing starts its backoff afresh
MAX_BACKOFF_S = 30.0
KILLED_LOADS_KEPT = 3  # loads killed by a signal in a row that keep their queued requests waiting
# A transient failure nobody waits on is shown `failed` this long (or its backoff, if longer), then
# the model is unloaded again, the failure kept on its card; a pinned or load-on-startup model is
# loaded again instead (KILLED_LOADS_KEPT times in a row at most).
FAILED_SHOWN_S = 10.0

# (pattern, does a match mean the worker reported a failed load?) in priority order
_CAUSES: tuple[tuple[re.Pattern[str], bool], ...] = (
    (re.compile(r"error loading model: (?!llama_model_loader: failed to load model from)(.+)"), True),
    (re.compile(r"gguf_init_from_\w+: (.+)"), True),
    (re.compile(r"(unknown model architecture: .+)"), True),
    (re.compile(r"model load failed: (.+)"), True),
    (re.compile(r"omni-worker: error: (.+)"), True),  # a bad flag (exit code 2)
)
_TRACEBACK_LAST = re.compile(r"^(\w+(?:Error|Exception)\b.*)$")
_CLI_USAGE_EXIT = 2
_WORKER_LOADED = re.compile(r"model loaded in ([\d.]+) s")


@dataclass(frozen=True)
class LoadFailure:
    cause: str  # one line, for the API error and the Models tab
    is_permanent: bool  # the same load will fail again: no retry until the file or preset changes
    is_the_box: bool = False  # the box, not the model (its port was taken): requests keep waiting
    is_misconfigured: bool = False  # the preset names what is not there (a file, a hub tag): a 503


# A device that ran out of memory while the model loaded (llama.cpp's CUDA build, ggml, torch; the
# router's own message once it has the device's figures): the box, not the model. The GPU
# placement evicts on that device and tries once more (router.lifecycle.gpu_admission).
OUT_OF_MEMORY = re.compile(r"out of memory at load on GPU|cudaMalloc failed|unable to allocate CUDA\d* "
                           r"buffer|CUDA out of memory|CUDA error: out of memory|CUDA_ERROR_OUT_OF_MEMORY|"
                           r"OutOfMemoryError", re.IGNORECASE)

# A worker that could not listen: the port the router picked was taken meanwhile (by another
# program, or a connection's local port). The next spawn picks another.
_PORT_TAKEN = re.compile(r"address already in use", re.IGNORECASE)


def _strip_log_prefix(line: str) -> str:
    """`06:50:50.200 WARNING worker.llama_cpp: llama.cpp: llama_model_load: ...` -> the message."""
    return re.sub(r"^\d\d:\d\d:\d\d(?:\.\d+)? \w+ [\w.]+: (?:llama\.cpp: )?", "", line.strip())


def diagnose(log_tail: Sequence[str], exit_code: int | None, reason: str, *, was_ready: bool) -> LoadFailure:
    """`reason`: what the router saw (`exited with code 1`, `not ready after 300s`, a spawn error)."""
    lines = [_strip_log_prefix(line) for line in log_tail]
    if not was_ready and any(_PORT_TAKEN.search(line) for line in lines):
        return LoadFailure("its port was taken before it could listen (EADDRINUSE, transient: retried on "
                           "another port)", is_permanent=False, is_the_box=True)
    if not was_ready and (OUT_OF_MEMORY.search(reason) or any(OUT_OF_MEMORY.search(line) for line in lines)):
        line = next((line for line in lines if OUT_OF_MEMORY.search(line)), "")
        cause = reason if OUT_OF_MEMORY.search(reason) else f"out of memory while loading: {line}"
        return LoadFailure(cause, is_permanent=False, is_the_box=True)
    for pattern, reported in _CAUSES:
        for line in lines:
            if (m := pattern.search(line)) is not None:
                return LoadFailure(m.group(1).strip(), reported and not was_ready)
    last_exception = next(
        (m.group(1) for line in reversed(lines) if (m := _TRACEBACK_LAST.match(line))), None
    )
    if last_exception is not None and not was_ready:
        return LoadFailure(f"{reason}: {last_exception}", exit_code not in (None, 0) and exit_code > 0)
    return LoadFailure(reason, exit_code == _CLI_USAGE_EXIT and not was_ready)


def backoff_delay(failures: int) -> float:
    """Seconds to wait before respawning after `failures` consecutive crashes (first: none)."""
    return 0.0 if failures <= 1 else min(2.0 ** (failures - 2), MAX_BACKOFF_S)


def worker_load_line(log_tail: Sequence[str]) -> str:
    """The worker's own "model loaded in X s" from its log tail, for the router's one-line summary."""
    for line in reversed(log_tail):
        if (m := _WORKER_LOADED.search(line)) is not None:
            return f"the worker's own load: {m.group(1)} s"
    return "the worker did not log its load time"


# ---- the answers a request gets from a model that failed, or went

def unavailable(message: str, retry_after: float | None = None) -> APIError:
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after is not None else None
    return APIError(message, status_code=503, type="unavailable_error", code=503, headers=headers)


def permanent_failure(name: str, cause: str, log_tail: list[str], *,
                      is_misconfigured: bool = False) -> APIError:
    """A load that fails the same way every time: 500 with `x-should-retry: false` (the openai and
    anthropic SDKs obey it; they retry any other 5xx) and no Retry-After. `is_misconfigured` (the
    preset names a file or a hub tag that is not there): 503 `model_misconfigured`, likewise."""
    return APIError(
        f"model {name!r} {'is misconfigured' if is_misconfigured else 'failed to load'}: {cause} "
        "(not retried until its file or preset changes, or POST /models/load asks for it)",
        status_code=503 if is_misconfigured else 500,
        type="unavailable_error" if is_misconfigured else "server_error",
        code="model_misconfigured" if is_misconfigured else "model_load_failed",
        headers={"x-should-retry": "false"},
        extra={"log_tail": log_tail[-20:]},
    )


def removed(message: str) -> APIError:
    return APIError(message, status_code=404, type="not_found_error", code="model_not_found")
