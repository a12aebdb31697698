"""Pure parts of issue 16: token counts picked from responses, the request log line, the
profile report's stages, the profiler's files."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any

import pytest

from router.log_ring import LogRing
from router.observability.logs import request_line
from router.observability.profile_report import load_events, summary, timelines, write_report
from router.observability.request_trace import RequestTrace, request_id
from worker.protocol.profile_log import Profiler, ProfileRun


def _run(trace: RequestTrace, chunks: list[bytes]) -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: Any) -> None:
        sent.append(message)

    async def go() -> None:
        wrapped = trace.wrap(send)
        await wrapped({"type": "http.response.start", "status": 200, "headers": []})
        for c in chunks:
            await wrapped({"type": "http.response.body", "body": c, "more_body": True})

    asyncio.run(go())
    assert (b"x-request-id", trace.request_id.encode()) in sent[0]["headers"]
    trace.status = 200
    trace.end()


@pytest.mark.parametrize(
    ("chunks", "prompt", "completion"),
    [
        ([b'{"usage":{"prompt_tokens":7,"completion_tokens":16,"total_tokens":23}}'], 7, 16),
        (
            [
                # a stream without usage: llama-server timings per choice
                b'data: {"choices":[{"text":"a"}]}\n\n',
                b'data: {"timings":{"cache_n":2,"prompt_n":5,"predicted_n":9}}\n\n',
                b'data: {"timings":{"cache_n":2,"prompt_n":0,"predicted_n":4}}\n\n',
            ],
            9,
            13,
        ),
        (
            [
                b'data: {"choices":[]}\n\n',
                b'data: {"usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n',
            ],
            3,
            2,
        ),
        ([b'{"content":"no counts here"}'], None, None),
    ],
)
def test_trace_counts_tokens_from_the_response(
    chunks: list[bytes], prompt: int | None, completion: int | None
) -> None:
    t = RequestTrace("r1", "m", "/v1/completions")
    _run(t, chunks)
    assert (t.prompt_tokens, t.completion_tokens) == (prompt, completion)
    assert t.t_first_byte >= t.t_received


@pytest.mark.parametrize(("headers", "expected"), [
    ([(b"x-request-id", b"abc-1")], "abc-1"),
    ([(b"x-request-id", b"bad\x01id")], None),
    ([(b"x-request-id", b"x" * 200)], None),
    ([], None),
])
def test_request_id_takes_a_sane_client_id_or_makes_one(
    headers: list[tuple[bytes, bytes]], expected: str | None
) -> None:
    rid = request_id(headers)
    assert rid == expected if expected else (len(rid) > 8 and rid != request_id(headers))


def test_request_line_is_logfmt() -> None:
    t = RequestTrace("r9", "tiny", "/v1/chat/completions", t_received=100.0)
    t.queued("loading")
    t.t_queued, t.t_ready, t.t_first_byte, t.status = 100.0, 100.5, 100.6, 200
    t.end()
    t.t_end = 101.0
    line = request_line(t.event())
    assert line == ("request id=r9 model=tiny route=/v1/chat/completions status=200 queued_ms=500.0 "
                    "ttft_ms=600.0 total_ms=1000.0 prompt_tokens=- completion_tokens=- cancelled=false")


def _ev(ts: float, event: str, component: str = "router", rid: str = "r", **kw: Any) -> dict[str, Any]:
    return {
        "ts": ts,
        "event": event,
        "component": component,
        "request_id": rid,
        "pid": 1,
        "run_id": "x",
        **kw,
    }


def test_report_splits_a_request_into_stages() -> None:
    w = "worker-m"
    events = [
        _ev(0.0, "received", model="m"),
        _ev(0.1, "queued", state="unloaded"),
        _ev(2.1, "model_ready"),
        _ev(2.2, "received", w),
        _ev(2.2, "queued", w),
        _ev(2.3, "slot_assigned", w),
        _ev(2.5, "prefill_done", w),
        _ev(2.5, "first_token", w),
        _ev(3.5, "finished", w),
        _ev(2.6, "first_token"),
        _ev(3.6, "finished", status=200),
        # a second request: waited for a slot of a loaded model (queue, not load)
        _ev(5.0, "received", rid="q", model="m"),
        _ev(5.0, "queued", rid="q", state="loaded"),
        _ev(5.4, "model_ready", rid="q"),
        _ev(5.5, "finished", rid="q", status=200),
    ]
    tls = timelines(reversed(events))
    assert [t.request_id for t in tls] == ["r", "q"]
    s = tls[0].stages()
    assert s == pytest.approx(
        {"load": 2.0, "queue": 0.1, "prefill": 0.2, "decode": 1.0, "ttft": 2.6, "total": 3.6}
    )
    assert tls[1].stages() == pytest.approx({"queue": 0.4, "total": 0.5})
    assert summary(tls)["queue"] == pytest.approx([0.1, 0.4])
    out = io.StringIO()
    write_report(tls, out)
    text = out.getvalue()
    assert "request r model=m" in text and "2 requests" in text
    assert text.splitlines()[-6].split()[:3] == ["queue", "2", "250.000"]


def test_profiler_files_runs_and_stop_all(tmp_path: Path) -> None:
    p = Profiler("router")
    p.record("received", "nobody")  # no run: nothing written, no file
    run1 = ProfileRun("a", tmp_path / "one", "{event_dir}/t.json", False, 16)
    run2 = ProfileRun("b", tmp_path / "one", "{event_dir}/t.json", False, 16)  # same dir: same file
    path = p.start(run1)
    assert p.start(run2) == path and p.start(run1) == path
    p.record("received", "r1", 1.0, model="m")
    assert [r.run_id for r in p.stop("a")] == ["a"]
    p.record("finished", "r1", 2.0)
    assert [r.run_id for r in p.stop(None)] == ["b"] and not p.is_active
    p.record("ignored", "r1")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["event"], e["ts"]) for e in lines] == [("received", 1.0), ("finished", 2.0)]
    assert path.name.startswith("events_router_") and load_events(path.parent, "b")[0]["event"] == "finished"


def test_log_ring_history_then_live_lines() -> None:
    async def go() -> list[str]:
        ring = LogRing(maxlen=3)
        for i in range(5):
            ring.append(f"old {i}")
        async with ring.subscribe(with_history=True) as q:
            ring.append("new")
            return [q.get_nowait() for _ in range(q.qsize())]

    assert asyncio.run(go()) == ["old 2", "old 3", "old 4", "new"]


def test_generation_trace_events_per_task(tmp_path: Path) -> None:
    from worker.engine.task import FinishEvent, Task, TokenEvent
    from worker.protocol.sampling import SamplingParams
    from worker.server.profiling import GenerationTrace

    p = Profiler("worker-m")
    path = p.start(ProfileRun("r", tmp_path, "{event_dir}/t.json", False, 2))
    tasks = [Task([1, 2, 3], SamplingParams(), 0, lambda e: None) for _ in range(3)]
    for t in tasks:
        t.stats.t_start = t.stats.t_arrival + 0.001
    trace = GenerationTrace(p, "rid", tasks)
    trace.on_start()
    for i in range(5):  # task 0: 5 tokens then finished
        if i == 0:
            tasks[0].stats.t_first_token = tasks[0].stats.t_start + 0.002
        trace.on_event(0, TokenEvent("x", 7))
    tasks[0].stats.t_end = tasks[0].stats.t_first_token + 0.01
    trace.on_event(0, FinishEvent("length", "", None, tasks[0].stats))
    tasks[1].stats.t_first_token = tasks[1].stats.t_start + 0.002  # task 1: EOS at once, no token event
    tasks[1].stats.t_end = tasks[1].stats.t_first_token
    trace.on_event(1, FinishEvent("stop", "", None, tasks[1].stats))
    trace.on_event(2, TokenEvent("x", 7))  # task 2: the client leaves after one token
    trace.on_cancel()
    trace.on_cancel()  # a second cancel (the response's `finally`) adds nothing
    p.stop(None)
    by_task: dict[int, list[str]] = {}
    for e in (json.loads(line) for line in path.read_text().splitlines()):
        assert e["request_id"] == "rid" and e["component"] == "worker-m"
        by_task.setdefault(e["index"], []).append(e["event"])
    assert by_task[0] == [
        "queued",
        "slot_assigned",
        "prefill_done",
        "first_token",
        "tokens",
        "tokens",
        "finished",
    ]
    assert by_task[1] == ["queued", "slot_assigned", "prefill_done", "first_token", "finished"]
    assert by_task[2] == ["queued", "slot_assigned", "first_token", "cancelled"]
