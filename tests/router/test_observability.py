"""Issue 16, end to end on real workers: the router's /metrics, request-level profiling and
the worker log endpoints (tiny GGUF models; each test starts its own router)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router.conftest import RouterProc, chat, fake_model
from tests.util import HTTP, ROOT, preset_defaults, wait_until

Factory = Callable[..., RouterProc]
GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
GGUF16 = ROOT / "models" / "tiny-llama-f16.gguf"
HF = ROOT / "models" / "tiny-llama"
KEY = "obs-key"

pytestmark = pytest.mark.skipif(
    not (GGUF.exists() and GGUF16.exists()), reason="tiny models not generated (make models)"
)

PRESET = f"""
{preset_defaults(512)}
[models.a]
model = "{GGUF}"
backend = "llama_cpp"

[models.b]
model = "{GGUF16}"
backend = "llama_cpp"
"""

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(r: RouterProc, **params: str) -> Samples:
    resp = httpx.get(f"{r.base}/metrics", params=params, headers=r.headers, timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(resp.text) for s in fam.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def complete(r: RouterProc, model: str, n: int = 16, stream: bool = False, **extra: Any) -> httpx.Response:
    headers = extra.pop("headers", {})  # (it used to go into the body too: now an unknown field is a 400)
    body = {"model": model, "prompt": "the quick brown fox", "max_tokens": n, "ignore_eos": True,
            "temperature": 0, "stream": stream, **extra}
    resp = httpx.post(f"{r.base}/v1/completions", json=body, headers={**r.headers, **headers},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    return resp


def test_metrics_count_requests_tokens_a_load_and_an_eviction(router_factory: Factory) -> None:
    r = router_factory(PRESET, "--models-max", "1", "--api-key", KEY)
    assert httpx.get(f"{r.base}/metrics", timeout=10).status_code == 401
    before = scrape(r)
    assert value(before, "omni_router:model_state", model="a", state="unloaded") == 1.0
    assert value(before, "omni_router:model_state", model="a", state="loaded") == 0.0

    for _ in range(3):  # the first one loads `a`
        complete(r, "a", 16)
    after = scrape(r)
    assert value(after, "llamacpp:tokens_predicted_total", model="a") == 48.0
    assert value(after, "llamacpp:prompt_tokens_total", model="a") > 0
    assert value(after, "llamacpp:tokens_predicted_seconds_total", model="a") > 0
    assert ("omni:kv_cache_tokens", frozenset({("model", "a")})) in after
    assert value(after, "omni:requests_total", model="a", reason="length") == 3.0
    assert value(after, "omni:prefix_cache_hit_tokens_total", model="a") > 0  # the same prompt 3 times
    decode_s = value(after, "omni:decode_seconds_total", model="a")  # within the 3 requests' time
    assert 0 < decode_s < value(after, "omni_router:e2e_request_latency_seconds_sum", model="a")
    assert 0 < value(after, "omni:kv_cache_usage_ratio", model="a") <= 1
    assert value(after, "omni_router:requests_total", model="a", route="/v1/completions", status="200") == 3.0
    assert value(after, "omni_router:model_loads_total", model="a") == 1.0
    assert value(after, "omni_router:model_load_seconds_count", model="a") == 1.0
    assert value(after, "omni_router:model_load_failures_total", model="a") == 0.0
    assert value(after, "omni_router:e2e_request_latency_seconds_count", model="a") == 3.0
    assert value(after, "omni_router:time_to_first_token_seconds_count", model="a") == 3.0
    assert value(after, "omni_router:request_queue_seconds_count", model="a") == 3.0
    load_s = value(after, "omni_router:model_load_seconds_sum", model="a")
    assert 0 < load_s < 60
    # only the first request waited (for the load): the queue time is at least its share of it
    assert value(after, "omni_router:request_queue_seconds_sum", model="a") >= load_s * 0.5
    assert value(after, "omni_router:model_state", model="a", state="loaded") == 1.0
    assert value(after, "omni_router:requests_in_flight", model="a") == 0.0
    assert value(after, "omni_router:requests_queued", model="a") == 0.0

    complete(r, "b", 4)  # --models-max 1: `a` (idle) is evicted to make room
    r.wait_status("a", "unloaded")
    final = scrape(r)
    assert value(final, "omni_router:model_evictions_total", model="a", reason="lru") == 1.0
    assert value(final, "omni_router:model_loads_total", model="b") == 1.0
    assert value(final, "llamacpp:tokens_predicted_total", model="b") == 4.0
    assert ("llamacpp:tokens_predicted_total", frozenset({("model", "a")})) not in final  # not scraped: gone
    assert value(final, "omni_router:model_state", model="a", state="unloaded") == 1.0
    assert value(final, "omni_router:model_state", model="b", state="loaded") == 1.0
    raw = httpx.get(f"{r.base}/metrics", params={"model": "b"}, headers=r.headers, timeout=10).text
    assert (
        "\nllamacpp:tokens_predicted_total 4\n" in raw
    )  # ?model= is still the worker's own page (llama-server's text)
    print(
        f"\nload a: {load_s:.3f}s; "
        f"queue sum a: {value(after, 'omni_router:request_queue_seconds_sum', model='a'):.3f}s; "
        f"e2e sum a (3 req): {value(after, 'omni_router:e2e_request_latency_seconds_sum', model='a'):.3f}s"
    )


def _events(directory: Path) -> list[dict[str, Any]]:
    out = []
    for path in directory.glob("events_*.jsonl"):
        out += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return out


def _ts(events: list[dict[str, Any]], rid: str, component: str, event: str) -> float:
    found = [e["ts"] for e in events if e["request_id"] == rid and e["event"] == event
             and (e["component"] == "router") == (component == "router")]
    assert found, f"no {component} {event} for {rid}"
    return float(found[0])


def test_profiling_writes_ordered_events_and_the_report_prints_the_table(router_factory: Factory,
                                                                         tmp_path: Path) -> None:
    r = router_factory(PRESET, "--api-key", KEY)
    event_dir = tmp_path / "prof"
    start = httpx.post(f"{r.base}/start_profile", headers=r.headers, timeout=10,
                       json={"run_id": "t1", "event_dir": str(event_dir), "token_interval": 8})
    assert start.status_code == 200, start.text
    assert start.json()["workers"] == {}  # nothing loaded yet: the first request loads `a`, whose
    # worker joins the run as it becomes ready, before that request reaches it
    ids = []
    for i, stream in enumerate((False, True, False)):
        resp = complete(r, "a", 20, stream=stream, headers={"X-Request-Id": f"req-{i}"})
        assert resp.headers["x-request-id"] == f"req-{i}"
        ids.append(f"req-{i}")
    stop = httpx.post(f"{r.base}/stop_profile", headers=r.headers, timeout=10, json={})
    assert stop.status_code == 200 and stop.json()["stopped"] == ["t1"]
    assert stop.json()["workers"]["a"]["stopped"] == ["t1"]

    events = _events(event_dir)
    r0 = [
        _ts(events, "req-0", "router", e)
        for e in ("received", "queued", "model_ready", "first_token", "finished")
    ]
    assert r0 == sorted(r0)
    assert [e["state"] for e in events if e["event"] == "queued" and e["component"] == "router"] == [
        "unloaded"
    ]
    for rid in ids:
        rr = [_ts(events, rid, "router", e) for e in ("received", "model_ready", "first_token", "finished")]
        assert rr == sorted(rr), (rid, rr)
        ww = [_ts(events, rid, "worker", e)
              for e in ("received", "queued", "slot_assigned", "prefill_done", "first_token", "finished")]
        assert ww == sorted(ww), (rid, ww)
        assert rr[0] <= ww[0] and ww[-1] <= rr[-1]  # the worker's part lies within the router's
        assert [e["n"] for e in events if e["request_id"] == rid and e["event"] == "tokens"] == [8, 16]
        fin = [
            e
            for e in events
            if e["request_id"] == rid and e["event"] == "finished" and e["component"] == "router"
        ]
        assert fin[0]["status"] == 200 and fin[0]["completion_tokens"] == 20
    n_before = len(events)
    complete(r, "a", 4)  # after the stop: nothing more is written
    assert len(_events(event_dir)) == n_before

    out = subprocess.run([sys.executable, "-m", "router.cli", "profile-report", str(event_dir)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    print("\n" + out.stdout[-1200:])
    lines = out.stdout.splitlines()
    assert "request req-1 model=a" in lines
    table = {line.split()[0]: line.split()[1:] for line in lines[lines.index("3 requests") + 2:]}
    assert set(table) == {"queue", "load", "prefill", "decode", "ttft", "total"}
    for stage in ("queue", "prefill", "decode", "ttft", "total"):
        assert table[stage][0] == "3", (stage, table[stage])
    assert table["load"][0] == "1"  # the first request waited for the load
    assert float(table["load"][1]) > 100  # ms: a worker's spawn and load


def test_log_stream_delivers_worker_lines_as_written(router_factory: Factory) -> None:
    r = router_factory(PRESET, "--api-key", KEY)
    assert httpx.get(f"{r.base}/logs", params={"model": "a"}, timeout=10).status_code == 401
    assert (
        httpx.get(f"{r.base}/logs", params={"model": "nope"}, headers=r.headers, timeout=10).status_code
        == 404
    )
    complete(r, "a", 4)

    def history() -> str:
        return HTTP.get(f"{r.base}/logs", params={"model": "a"}, headers=r.headers, timeout=10).text

    # the router reads the worker's output as it comes: on a busy box a line may trail the answer
    wait_until(lambda: "model loaded in" in (h := history()) and "task 1 done" in h, timeout=15,
               what="the worker's load and task lines in the router's log")

    got: list[str] = []
    connected = threading.Event()

    def follow() -> None:
        with httpx.stream("GET", f"{r.base}/logs/stream", params={"model": "a", "no-history": "1"},
                          headers=r.headers, timeout=30) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith(": connected"):
                    connected.set()
                elif line.startswith("data: "):
                    got.append(line[6:])
                    if "task 2 done" in line:
                        return

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    assert connected.wait(10)
    complete(r, "a", 4)  # the worker logs "task 2 done ..." while we listen
    t.join(15)
    assert not t.is_alive() and any("task 2 done" in line for line in got)
    assert not any("task 1 done" in line for line in got)  # no-history: nothing from before
    router_log = httpx.get(f"{r.base}/logs", headers=r.headers, timeout=10).text  # no model: the router's own
    assert "request id=" in router_log and "model=a route=/v1/completions status=200" in router_log
    assert "completion_tokens=4" in router_log
    # the Responses API reaches the model through the same admission: traced and counted too
    resp = httpx.post(f"{r.base}/v1/responses", headers=r.headers, timeout=60,
                      json={"model": "a", "input": "hi", "max_output_tokens": 3})
    assert resp.status_code == 200, resp.text
    samples = scrape(r)
    assert value(samples, "omni_router:requests_total", model="a", route="/v1/responses", status="200") == 1.0
    router_log = httpx.get(f"{r.base}/logs", headers=r.headers, timeout=10).text
    assert "route=/v1/responses status=200" in router_log and "completion_tokens=3" in router_log


def test_metrics_count_sleeps_wakes_and_a_failed_load(router_factory: Factory, tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model" * 100)
    r = router_factory(
        PRESET
        + f'\n[models.bad]\nmodel = "{junk}"\nbackend = "llama_cpp"\n'
        + f'\n[models.s]\nmodel = "{GGUF}"\nbackend = "llama_cpp"\nctx-size = 8192\nparallel = 1\n'
    )
    complete(r, "b", 2)
    assert httpx.post(f"{r.base}/models/sleep", json={"model": "b"}, timeout=10).status_code == 200
    r.wait_status("b", "sleeping")
    asleep = scrape(r)
    assert value(asleep, "omni_router:model_sleeps_total", model="b") == 1.0
    assert value(asleep, "omni_router:model_state", model="b", state="sleeping") == 1.0
    assert (
        "llamacpp:tokens_predicted_total",
        frozenset({("model", "b")}),
    ) not in asleep  # never woken by a scrape
    assert r.status("b") == "sleeping"
    first_chunk, finish = threading.Event(), threading.Event()

    def stream_s() -> None:  # a long stream to look at the gauges while it runs
        with httpx.stream(
            "POST",
            f"{r.base}/v1/completions",
            timeout=60,
            json={"model": "s", "prompt": "x", "max_tokens": 8000, "ignore_eos": True, "stream": True},
        ) as s:
            for line in s.iter_lines():
                if line.startswith("data: "):
                    first_chunk.set()
                    if finish.is_set():
                        return  # leaving closes the stream: the worker cancels the rest

    t = threading.Thread(target=stream_s, daemon=True)
    t.start()
    assert first_chunk.wait(60)
    busy = scrape(r)
    finish.set()
    t.join(30)
    assert value(busy, "omni_router:requests_in_flight", model="s") == 1.0
    assert value(busy, "llamacpp:requests_processing", model="s") == 1.0
    assert value(busy, "llamacpp:n_busy_slots_per_decode", model="s") == 1.0
    assert (
        value(busy, "omni_router:time_to_first_token_seconds_count", model="s") == 0.0
    )  # counted at the end
    wait_until(lambda: value(scrape(r), "omni_router:requests_in_flight", model="s") == 0.0, 10,
               what="the cancelled stream to end")
    assert (
        value(scrape(r), "omni_router:requests_total", model="s", route="/v1/completions", status="499")
        == 1.0
    )
    complete(r, "b", 2)  # wakes b
    awake = scrape(r)
    assert value(awake, "omni_router:model_wakes_total", model="b") == 1.0
    assert value(awake, "omni_router:model_wake_seconds_count", model="b") == 1.0
    assert value(awake, "omni_router:model_loads_total", model="b") == 1.0  # a wake is not a load
    assert value(awake, "omni_router:requests_total", model="b", route="/v1/completions", status="200") == 2.0

    resp = httpx.post(
        f"{r.base}/v1/completions", json={"model": "bad", "prompt": "x", "max_tokens": 1}, timeout=60
    )
    assert resp.status_code == 500  # a load that will fail again: not retryable (issue 25)
    failed = scrape(r)
    assert value(failed, "omni_router:model_loads_total", model="bad") == 1.0
    assert value(failed, "omni_router:model_load_failures_total", model="bad") == 1.0
    assert value(failed, "omni_router:model_load_seconds_count", model="bad") == 0.0
    assert (
        value(failed, "omni_router:requests_total", model="bad", route="/v1/completions", status="500") == 1.0
    )
    assert value(failed, "omni_router:model_state", model="bad", state="failed") == 1.0


def test_enable_torch_records_a_torch_profiler_trace(router_factory: Factory, tmp_path: Path) -> None:
    if not (HF / "config.json").exists():
        pytest.skip("tiny HF model not generated")
    r = router_factory(
        f'[models.hf]\nmodel = "{HF}"\nbackend = "torch"\nctx-size = 256\nparallel = 1\nthreads = 1\n'
    )
    complete(r, "hf", 2)  # loaded: /start_profile reaches it at once
    body = {"run_id": "torch1", "event_dir": str(tmp_path), "enable_torch": True,
            "trace_path_template": "{event_dir}/{run_id}-{component}.trace.json"}
    start = httpx.post(f"{r.base}/start_profile", json=body, timeout=30)
    assert start.status_code == 200 and start.json()["workers"]["hf"]["torch"] is True, start.text
    complete(r, "hf", 4)
    stop = httpx.post(f"{r.base}/stop_profile", json={"run_id": "torch1"}, timeout=60).json()
    trace = Path(stop["workers"]["hf"]["torch_trace"])
    assert trace == tmp_path / "torch1-worker-hf.trace.json"
    assert json.loads(trace.read_text())["traceEvents"]  # a Chrome trace with events
    # events-only: /start_request_profile never starts torch
    start = httpx.post(f"{r.base}/start_request_profile", json={**body, "run_id": "ev"}, timeout=30).json()
    assert start["workers"]["hf"]["torch"] is False
    assert httpx.post(f"{r.base}/stop_request_profile", timeout=30).json()["stopped"] == ["ev"]


def test_queue_depth_while_loading_and_an_idle_stop(router_factory: Factory) -> None:
    """Fake workers (real subprocesses): a 2 s load to watch requests queue, and a server
    without the sleep contract that is stopped when idle (evicted, reason `idle`)."""
    r = router_factory(
        fake_model("slow", "--load-time", "2") + fake_model("nosleep", "--no-sleep", extra="ttl = 1")
    )
    with ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(httpx.post, f"{r.base}/v1/chat/completions", json=chat("slow"), timeout=30)
                   for _ in range(2)]

        def queued() -> Samples:
            s = scrape(r)
            return s if value(s, "omni_router:requests_queued", model="slow") == 2.0 else {}

        s = wait_until(queued, 10, what="2 requests queued for the load")
        assert value(s, "omni_router:model_state", model="slow", state="loading") == 1.0
        assert [f.result().status_code for f in futures] == [200, 200]
    s = scrape(r)
    assert value(s, "omni_router:requests_queued", model="slow") == 0.0
    assert value(s, "omni_router:request_queue_seconds_count", model="slow") == 2.0
    assert (
        value(s, "omni_router:request_queue_seconds_sum", model="slow") > 2 * 1.5
    )  # both waited for the load

    assert httpx.post(f"{r.base}/v1/chat/completions", json=chat("nosleep"), timeout=30).status_code == 200
    r.wait_status("nosleep", "unloaded", timeout=15)
    s = scrape(r)
    assert value(s, "omni_router:model_evictions_total", model="nosleep", reason="idle") == 1.0
    assert value(s, "omni_router:model_sleeps_total", model="nosleep") == 0.0
