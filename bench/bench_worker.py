"""Worker throughput benchmark: our worker side by side with llama.cpp's C++ llama-server.

    .venv/bin/python -m bench.bench_worker                      # ours vs llama-server, 5 rounds
    .venv/bin/python -m bench.bench_worker --quick               # 2 rounds
    .venv/bin/python -m bench.bench_worker --targets llama-server,llama-server   # harness check
    .venv/bin/python -m bench.bench_worker --url mine=http://127.0.0.1:8080 --targets mine

Method. Every target is started once (or is an already running `--url`), warmed up (one request,
then one burst of `--parallel` requests), and stays up for the whole run. Then, for each round
and each concurrency N (1, 4, 8, 16), every target gets one *burst*: N streaming
`/v1/completions` requests sent at once, each with a distinct token-id prompt of 32-64 normal
vocabulary tokens and generating exactly `--max-tokens` new tokens (`ignore_eos`, temperature 0).
Targets take turns inside each (round, N) cell, and the turn order flips every round, so slow
drifts of this shared machine hit both sides alike. Prompts depend on (round, N, request index)
only, so both sides see the same prompts, and no prompt is a prefix-cache hit of an earlier one.

Per burst: aggregate tokens/s = generated tokens / (last response end - burst start); TTFT = send
-> first token chunk; inter-token latency (ITL) = gaps between consecutive token chunks of one
request, pooled over the burst. p50/p99 are taken per burst; the table shows the median over
rounds. `srv ms/tok` is the server's own `timings` (generation time per token), which separates
server speed from transport. The generated-token count of every request is checked against `--max-tokens` (from
`usage.completion_tokens`, else `timings.predicted_n`, else the number of token chunks); a
mismatch is an error, reported, not silently averaged in.

Context: both sides get the same *total* KV size (`--ctx-size`, default 4096) and 8 slots. Our
worker's KV cache is unified (any slot may use the whole context); llama-server gets
`-c CTX --kv-unified` when its `--help` lists that flag (it does in the vendored revision), so the
per-slot capacity is the same; otherwise each of its slots gets CTX/8 (printed in the header).
Both get the same `--threads` (default: all CPUs) unless `--threads 0` (each server's default).

Noise. This box is shared, and llama.cpp's threads (one per core, spinning at barriers) collapse
by 10-40x when another process takes a core. So: before each burst we wait (up to --quiet-wait)
for the machine to be quiet; during it, we measure the CPU used by the target, by us, and by
everything else (/proc/stat minus the two); a burst during which other processes used more than
--max-noise CPUs is discarded and rerun (up to --retries times, with fresh prompt tokens of the
same lengths; an attempt taking 3x longer than the fastest clean one is cut short, its requests
cancelled; the last attempt is always kept). The table shows those CPU figures, so a reader can
tell a clean run from a noisy one. The CPU time of idle targets is sampled too: an idle server that burns CPU (a busy-polling
engine loop) would slow down the other side and is reported as a warning.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):  # run as a script: make `bench.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (
    ROOT,
    Server,
    ServerStartError,
    free_port,
    median,
    percentile,
    self_cpu_seconds,
    system_busy_seconds,
)

DEFAULT_MODEL = ROOT / "models" / "small-llama-f16.gguf"
TARGET_KINDS = ("ours", "llama-server")
# Targets of the issue (docs: issue 3, "Done when").
TARGET_RATIO = 0.95
TARGET_SCALING = 2.5


# ---------------------------------------------------------------- prompts


def normal_token_ids(model: Path) -> list[int]:
    """Ids of the model's NORMAL vocabulary tokens (no control/byte/unused ones), from the GGUF."""
    from gguf import GGUFReader

    reader = GGUFReader(str(model))
    tokens = reader.get_field("tokenizer.ggml.tokens")
    if tokens is None:
        raise SystemExit(f"{model}: no tokenizer.ggml.tokens in the GGUF")
    n_vocab = len(tokens.data)
    types = reader.get_field("tokenizer.ggml.token_type")
    if types is None:
        return list(range(n_vocab))
    ids = [i for i, idx in enumerate(types.data) if int(types.parts[idx][0]) == 1]
    return ids or list(range(n_vocab))


def make_prompt(vocab: list[int], round_idx: int, concurrency: int, req_idx: int,
                min_len: int, max_len: int, attempt: int = 0) -> list[int]:
    """The prompt of one request of a cell. A retried burst gets other tokens (no prefix-cache
    hit on what the server saw on the first attempt) but the same lengths (the same work)."""
    length = random.Random(f"{round_idx}/{concurrency}/{req_idx}").randint(min_len, max_len)
    rng = random.Random(f"{round_idx}/{concurrency}/{req_idx}/{attempt}")
    return [rng.choice(vocab) for _ in range(length)]


# ---------------------------------------------------------------- one request, one burst


@dataclass
class RequestResult:
    ttft: float = math.nan
    gaps: list[float] = field(default_factory=list)
    num_tokens: int = 0
    num_chunks: int = 0
    server_tpot_ms: float = math.nan  # the server's own timings.predicted_ms / predicted_n
    end: float = 0.0
    error: str | None = None


def _count_tokens(final: dict[str, Any], num_chunks: int) -> int:
    usage = final.get("usage") or {}
    if isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    timings = final.get("timings") or {}
    if isinstance(timings.get("predicted_n"), int):
        return int(timings["predicted_n"])
    return num_chunks


async def stream_completion(client: httpx.AsyncClient, model_name: str, prompt: list[int],
                            max_tokens: int) -> RequestResult:
    body = {
        "model": model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    res = RequestResult()
    start = time.perf_counter()
    last_token_at: float | None = None
    first_chunk_at: float | None = None
    final: dict[str, Any] = {}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                res.error = f"HTTP {r.status_code}: {text[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                first_chunk_at = first_chunk_at or now
                obj = json.loads(data)
                if "error" in obj:
                    res.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    return res
                for key in ("usage", "timings"):  # in one closing chunk or in two
                    if obj.get(key):
                        final[key] = obj[key]
                choices = obj.get("choices") or []
                # A token chunk carries text, or is a not-yet-finished chunk (a token whose text
                # is held back, e.g. half a UTF-8 character: we send it empty, llama-server sends
                # nothing). An empty closing chunk is not one.
                if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
                    res.num_chunks += 1
                    if last_token_at is None:
                        res.ttft = now - start
                    else:
                        res.gaps.append(now - last_token_at)
                    last_token_at = now
        res.end = time.perf_counter()
        if math.isnan(res.ttft) and first_chunk_at is not None:
            # No token chunk at all: llama-server sends none while the text ends in an incomplete
            # UTF-8 character (a greedy loop on a byte token does that). What the user waited
            # for the first byte is then the closing chunk.
            res.ttft = first_chunk_at - start
        res.num_tokens = _count_tokens(final, res.num_chunks)
        t = final.get("timings") or {}
        if t.get("predicted_n") and isinstance(t.get("predicted_ms"), int | float):
            res.server_tpot_ms = float(t["predicted_ms"]) / float(t["predicted_n"])
        if res.num_tokens != max_tokens:
            res.error = f"generated {res.num_tokens} tokens, expected {max_tokens}"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


@dataclass
class Burst:
    target: str
    concurrency: int
    round: int
    wall_s: float
    tok_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    num_tokens: int
    num_chunks: int
    errors: list[str]
    idle_cpu_of_others: dict[str, float]  # other target -> CPUs it used while idle
    cpu_target: float = math.nan  # CPUs used during the burst by the target's processes
    cpu_client: float = math.nan  # ... by this benchmark process
    cpu_foreign: float = math.nan  # ... by everything else on the machine (noise)
    foreign_before: float = math.nan  # foreign load measured just before the burst
    server_tpot_ms: float = math.nan  # median over requests of the server-reported ms per token
    num_discarded: int = 0  # earlier attempts of this burst thrown away as too noisy


async def run_burst(client: httpx.AsyncClient, model_name: str, prompts: list[list[int]],
                    max_tokens: int) -> tuple[float, list[RequestResult]]:
    start = time.perf_counter()
    results = await asyncio.gather(*(stream_completion(client, model_name, p, max_tokens) for p in prompts))
    ends = [r.end for r in results if r.error is None]
    wall = (max(ends) if ends else time.perf_counter()) - start
    return wall, list(results)


def summarize_burst(target: str, concurrency: int, round_idx: int, wall: float,
                    results: list[RequestResult], idle_cpu: dict[str, float]) -> Burst:
    ok = [r for r in results if r.error is None]
    num_tokens = sum(r.num_tokens for r in ok)
    ttfts = [r.ttft * 1e3 for r in ok]
    gaps = [g * 1e3 for r in ok for g in r.gaps]
    return Burst(
        target=target, concurrency=concurrency, round=round_idx, wall_s=wall,
        tok_s=num_tokens / wall if ok and wall > 0 else math.nan,
        ttft_p50_ms=percentile(ttfts, 50), ttft_p99_ms=percentile(ttfts, 99),
        itl_p50_ms=percentile(gaps, 50), itl_p99_ms=percentile(gaps, 99),
        num_tokens=num_tokens, num_chunks=sum(r.num_chunks for r in ok),
        errors=[r.error for r in results if r.error is not None], idle_cpu_of_others=idle_cpu,
    )


# ---------------------------------------------------------------- targets


def find_llama_server() -> Path | None:
    hits = sorted(ROOT.glob("third_party/llama-server-build-*/bin/llama-server"))
    return hits[-1] if hits else None


def llama_server_has_flag(binary: Path, flag: str) -> bool:
    try:
        out = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return re.search(re.escape(flag) + r"(?![\w-])", out.stdout + out.stderr) is not None


def build_targets(args: argparse.Namespace, log_dir: Path) -> tuple[list[Server], list[str]]:
    """Servers to start (or external URLs) and header notes describing how each is run."""
    externals = dict(u.split("=", 1) for u in args.url)
    names = [t.strip() for t in args.targets.split(",") if t.strip()]
    servers: list[Server] = []
    notes: list[str] = []
    seen: dict[str, int] = {}
    for kind in names:
        seen[kind] = seen.get(kind, 0) + 1
        name = kind if seen[kind] == 1 else f"{kind}#{seen[kind]}"
        if kind in externals:
            servers.append(Server(name=name, base_url=externals[kind].rstrip("/")))
            notes.append(f"{name}: external server at {externals[kind]} (CPU accounted to the process "
                         "listening on its port, if local)")
            continue
        port = free_port()
        threads = [] if args.threads == 0 else [str(args.threads)]
        if kind == "ours":
            cmd = [sys.executable, "-m", "worker.server.cli", "--model", str(args.model),
                   "--parallel", str(args.parallel), "--ctx-size", str(args.ctx_size),
                   "--port", str(port), "--host", "127.0.0.1"]
            if threads:
                cmd += ["--threads", *threads]
            cmd += args.worker_arg
            notes.append(f"{name}: unified KV, {args.ctx_size} cells shared by {args.parallel} slots")
        elif kind == "llama-server":
            binary = Path(args.llama_server) if args.llama_server else find_llama_server()
            if binary is None or not binary.exists():
                raise SystemExit("llama-server binary not found: run scripts/build_llama_server.sh "
                                 "or pass --llama-server PATH")
            cmd = [str(binary), "-m", str(args.model), "-np", str(args.parallel),
                   "-c", str(args.ctx_size), "--port", str(port), "--host", "127.0.0.1"]
            if threads:
                cmd += ["-t", *threads]
            if llama_server_has_flag(binary, "--kv-unified"):
                cmd.append("--kv-unified")
                notes.append(f"{name}: -c {args.ctx_size} --kv-unified (each of {args.parallel} "
                             f"slots may use the whole context, like ours)")
            else:
                notes.append(f"{name}: -c {args.ctx_size} without --kv-unified (not supported): "
                             f"{args.ctx_size // args.parallel} cells per slot")
            cmd += args.server_arg
        else:
            raise SystemExit(f"unknown target {kind!r}: use one of {TARGET_KINDS} or name it in --url")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        servers.append(Server(name=name, base_url=f"http://127.0.0.1:{port}", cmd=cmd,
                              log_path=log_dir / f"{name.replace('#', '_')}.log", env=env))
    return servers, notes


async def wait_quiet(below: float, max_wait: float, window: float = 0.5) -> float:
    """Wait until the machine's busy CPUs (our servers idle, so: other people's work) drop to
    `below`, at most `max_wait` seconds; return the last measured load (CPUs)."""
    deadline = time.monotonic() + max_wait
    while True:
        a = system_busy_seconds()
        await asyncio.sleep(window)
        load = (system_busy_seconds() - a) / window
        if load <= below or time.monotonic() >= deadline:
            return load


async def measured_burst(target: Server, servers: list[Server], client: httpx.AsyncClient, model_name: str,
                         prompts: list[list[int]], max_tokens: int, conc: int, round_idx: int,
                         give_up_after: float | None = None) -> Burst | None:
    """One burst, with the CPU time spent meanwhile by the target, us, idle targets and the rest.
    None if it took longer than `give_up_after` seconds (its requests are then cancelled)."""
    others = [o for o in servers if o is not target]
    others0 = {o.name: o.cpu_seconds() for o in others}
    sys0, tgt0, self0, t0 = system_busy_seconds(), target.cpu_seconds(), self_cpu_seconds(), time.perf_counter()
    try:
        wall, results = await asyncio.wait_for(run_burst(client, model_name, prompts, max_tokens), give_up_after)
    except TimeoutError:
        return None
    elapsed = time.perf_counter() - t0
    d_sys, d_tgt = system_busy_seconds() - sys0, target.cpu_seconds() - tgt0
    d_self = self_cpu_seconds() - self0
    idle = {o.name: (o.cpu_seconds() - others0[o.name]) / elapsed for o in others}
    b = summarize_burst(target.name, conc, round_idx, wall, results, idle)
    b.cpu_target, b.cpu_client = d_tgt / elapsed, d_self / elapsed
    b.server_tpot_ms = median([r.server_tpot_ms for r in results if r.error is None])
    # An external target whose process cannot be found counts as foreign.
    b.cpu_foreign = max(0.0, (d_sys - d_tgt - d_self) / elapsed - sum(idle.values()))
    return b


async def burst_with_retries(args: argparse.Namespace, target: Server, servers: list[Server],
                             client: httpx.AsyncClient, model_name: str, vocab: list[int], conc: int,
                             round_idx: int, fastest: dict[tuple[str, int], float]) -> Burst:
    """Run a burst until one is clean (little foreign CPU). An attempt running far longer than
    the fastest clean one so far is cut short; the last attempt always runs to the end."""
    lo, hi = args.prompt_tokens
    attempt = 0
    while True:
        prompts = [make_prompt(vocab, round_idx, conc, i, lo, hi, attempt) for i in range(conc)]
        foreign_before = await wait_quiet(args.quiet_below, args.quiet_wait)
        is_last = attempt >= args.retries
        best = fastest.get((target.name, conc))
        limit = None if is_last or best is None else max(3.0 * best, best + 2.0)
        b = await measured_burst(target, servers, client, model_name, prompts, args.max_tokens, conc,
                                 round_idx, limit)
        if b is not None:
            b.foreign_before, b.num_discarded = foreign_before, attempt
            if is_last or b.errors or b.cpu_foreign <= args.max_noise:
                return b
            why = f"other processes used {b.cpu_foreign:.2f} CPUs meanwhile ({b.tok_s:.1f} tok/s)"
        else:
            why = f"gave up after {limit:.1f}s (fastest clean burst: {best:.1f}s)"
        log(f"round {round_idx + 1} N={conc} {target.name}: attempt {attempt + 1} discarded, {why}")
        attempt += 1


async def model_name_of(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    return str(data[0]["id"]) if data else "default"


# ---------------------------------------------------------------- the run


async def run(args: argparse.Namespace, servers: list[Server], vocab: list[int]) -> list[Burst]:
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    clients = {s.name: httpx.AsyncClient(base_url=s.base_url, timeout=timeout, limits=limits) for s in servers}
    lo, hi = args.prompt_tokens
    try:
        model_names = {s.name: await model_name_of(clients[s.name]) for s in servers}
        for s in servers:  # warm-up: one request, then one full burst of `parallel`
            warm = [make_prompt(vocab, -1, 0, i, lo, hi) for i in range(args.parallel)]
            _, res = await run_burst(clients[s.name], model_names[s.name], warm[:1], args.max_tokens)
            _, res2 = await run_burst(clients[s.name], model_names[s.name], warm, args.max_tokens)
            errors = [r.error for r in res + res2 if r.error]
            if errors:
                raise SystemExit(f"{s.name}: warm-up failed: {errors[0]}")
            log(f"{s.name}: warmed up (model {model_names[s.name]!r})")
        bursts: list[Burst] = []
        fastest: dict[tuple[str, int], float] = {}  # clean burst wall time per (target, N)
        for round_idx in range(args.rounds):
            order = servers if round_idx % 2 == 0 else list(reversed(servers))
            for conc in args.concurrency:
                for s in order:
                    b = await burst_with_retries(args, s, servers, clients[s.name], model_names[s.name],
                                                 vocab, conc, round_idx, fastest)
                    if not b.errors and b.cpu_foreign <= args.max_noise:
                        key = (s.name, conc)
                        fastest[key] = min(fastest.get(key, math.inf), b.wall_s)
                    bursts.append(b)
                    log(f"round {round_idx + 1}/{args.rounds} N={conc:<2} {s.name:<14} {b.tok_s:7.1f} tok/s  "
                        f"TTFT p50 {b.ttft_p50_ms:7.1f} p99 {b.ttft_p99_ms:7.1f} ms  "
                        f"ITL p50 {b.itl_p50_ms:6.1f} p99 {b.itl_p99_ms:6.1f} ms  "
                        f"CPUs: target {b.cpu_target:.2f} client {b.cpu_client:.2f} foreign {b.cpu_foreign:.2f}"
                        + (f"  ERRORS: {len(b.errors)} ({b.errors[0]})" if b.errors else ""))
        return bursts
    finally:
        for c in clients.values():
            await c.aclose()


def summarize(bursts: list[Burst], servers: list[Server], concurrency: list[int],
              max_noise: float) -> dict[str, Any]:
    table: dict[str, dict[int, dict[str, float]]] = {}
    for s in servers:
        table[s.name] = {}
        for conc in concurrency:
            mine = [b for b in bursts if b.target == s.name and b.concurrency == conc]
            table[s.name][conc] = {
                "tok_s": median([b.tok_s for b in mine]),
                "tok_s_min": min((b.tok_s for b in mine), default=math.nan),
                "tok_s_max": max((b.tok_s for b in mine), default=math.nan),
                "ttft_p50_ms": median([b.ttft_p50_ms for b in mine]),
                "ttft_p99_ms": median([b.ttft_p99_ms for b in mine]),
                "itl_p50_ms": median([b.itl_p50_ms for b in mine]),
                "itl_p99_ms": median([b.itl_p99_ms for b in mine]),
                "num_errors": sum(len(b.errors) for b in mine),
                "cpu_target": median([b.cpu_target for b in mine]),
                "server_tpot_ms": median([b.server_tpot_ms for b in mine]),
                "cpu_foreign": median([b.cpu_foreign for b in mine]),
                "num_noisy": sum(1 for b in mine if b.cpu_foreign > max_noise),
                "num_discarded": sum(b.num_discarded for b in mine),
                "idle_cpu_of_others_max": max((max(b.idle_cpu_of_others.values(), default=0.0) for b in mine),
                                              default=0.0),
            }
    return table


def fmt(x: float, spec: str = "7.1f") -> str:
    return format(x, spec) if not math.isnan(x) else "   n/a"


def paired_ratio(bursts: list[Burst], a: str, b: str, conc: int) -> float:
    """Median over rounds of tok/s(a) / tok/s(b) within the same round: both ran back to back,
    so a noisy minute hits both sides of a pair."""
    by_round = {(x.target, x.round): x.tok_s for x in bursts if x.concurrency == conc}
    rounds = sorted({x.round for x in bursts})
    return median([by_round[a, r] / by_round[b, r] for r in rounds if (a, r) in by_round and (b, r) in by_round])


def print_report(table: dict[str, Any], bursts: list[Burst], servers: list[Server], concurrency: list[int],
                 header: list[str]) -> None:
    print()
    for line in header:
        print(line)
    print()
    print(f"{'N':>3}  {'target':<14} {'tok/s':>7} {'[min - max]':>17}  {'TTFT p50':>8} {'TTFT p99':>8}  "
          f"{'ITL p50':>7} {'ITL p99':>7}  {'srv ms/tok':>10}  {'CPUs':>4} {'noise':>5}")
    a, b = (servers[0].name, servers[1].name) if len(servers) >= 2 else (servers[0].name, None)
    for conc in concurrency:
        for s in servers:
            r = table[s.name][conc]
            err = f"  {r['num_errors']} errors" if r["num_errors"] else ""
            if r["num_noisy"]:
                err += f"  {r['num_noisy']} noisy rounds kept"
            print(f"{conc:>3}  {s.name:<14} {fmt(r['tok_s'])} [{fmt(r['tok_s_min'])} - {fmt(r['tok_s_max'])}]  "
                  f"{fmt(r['ttft_p50_ms'], '8.1f')} {fmt(r['ttft_p99_ms'], '8.1f')}  "
                  f"{fmt(r['itl_p50_ms'])} {fmt(r['itl_p99_ms'])}  {fmt(r['server_tpot_ms'], '10.2f')}  "
                  f"{fmt(r['cpu_target'], '4.2f')} "
                  f"{fmt(r['cpu_foreign'], '5.2f')}{err}")
        if b is not None:
            ra, rb = table[a][conc], table[b][conc]
            ratio = ra["tok_s"] / rb["tok_s"]
            paired = paired_ratio(bursts, a, b, conc)
            mark = "ok" if ratio >= TARGET_RATIO else f"BELOW {TARGET_RATIO}x"
            print(f"{'':>3}  {a}/{b}: tok/s {ratio:.3f}x ({mark}; paired per round {paired:.3f}x), "
                  f"TTFT p50 {ra['ttft_p50_ms'] / rb['ttft_p50_ms']:.2f}x p99 {ra['ttft_p99_ms'] / rb['ttft_p99_ms']:.2f}x, "
                  f"ITL p50 {ra['itl_p50_ms'] / rb['itl_p50_ms']:.2f}x p99 {ra['itl_p99_ms'] / rb['itl_p99_ms']:.2f}x")
        print()
    if 1 in concurrency and 8 in concurrency:
        parts = []
        for s in servers:
            scale = table[s.name][8]["tok_s"] / table[s.name][1]["tok_s"]
            parts.append(f"{s.name} {scale:.2f}x" + ("" if scale >= TARGET_SCALING else f" (BELOW {TARGET_SCALING}x)"))
        print("scaling tok/s at N=8 vs N=1: " + ", ".join(parts))
    print("tok/s: generated tokens / burst wall time; TTFT, ITL in ms; each a median over rounds of the "
          "burst's value.\nsrv ms/tok: the server's own timings (predicted_ms / predicted_n), as it reports them.\nCPUs: used by the target during its bursts; noise: CPUs used meanwhile by other "
          "processes on the machine (medians).")
    discarded = sum(b.num_discarded for b in bursts)
    if discarded:
        print(f"{discarded} bursts were rerun because other processes used the CPUs meanwhile.")
    for s in servers:
        idle = max(table[s.name][c]["idle_cpu_of_others_max"] for c in concurrency)
        if idle > 0.05:
            print(f"WARNING: while {s.name} ran, another (idle) target used up to {idle:.2f} CPUs")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--targets", default="ours,llama-server",
                   help="comma list of ours | llama-server | a NAME given in --url; the ratio is first/second")
    p.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                   help="benchmark an already running OpenAI-compatible server under NAME")
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: third_party build)")
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--ctx-size", type=int, default=4096, help="total KV cells, same for every target")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads for both servers (0: each server's own default)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="2 rounds (a smoke run, not a measurement)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=lambda s: tuple(int(x) for x in s.split("-")), default=(32, 64),
                   metavar="MIN-MAX")
    p.add_argument("--worker-arg", action="append", default=[], help="extra argument for our worker")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for llama-server")
    p.add_argument("--quiet-below", type=float, default=0.3, metavar="CPUS",
                   help="before each burst wait until other processes use at most this many CPUs ...")
    p.add_argument("--quiet-wait", type=float, default=10.0, metavar="SECONDS", help="... but at most this long")
    p.add_argument("--max-noise", type=float, default=0.25, metavar="CPUS",
                   help="a burst during which other processes used more CPUs is discarded and rerun ...")
    p.add_argument("--retries", type=int, default=4, help="... at most this many times (then kept)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--json", type=Path, default=None, help="write config, every burst and the summary here")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds = 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.model.exists():
        raise SystemExit(f"model {args.model} not found (make it: .venv/bin/python -m worker.testing.tiny_models "
                         "--out models --size small)")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = ROOT / "bench" / "results" / f"worker-{stamp}"
    servers, notes = build_targets(args, log_dir)
    vocab = normal_token_ids(args.model)
    header = [
        f"model {args.model} | {args.parallel} slots | ctx {args.ctx_size} | threads "
        f"{args.threads or 'server default'} | {args.rounds} rounds | {args.max_tokens} tokens/request "
        f"(ignore_eos, temperature 0) | prompts {args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens",
        *notes,
        f"logs: {log_dir}",
        "load average at start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()) + f" ({os.cpu_count()} CPUs)",
    ]
    try:
        for s in servers:
            log(f"starting {s.name}: {' '.join(s.cmd) if s.cmd else s.base_url}")
            t0 = time.monotonic()
            s.start(args.start_timeout)
            log(f"{s.name} healthy after {time.monotonic() - t0:.1f}s")
        bursts = asyncio.run(run(args, servers, vocab))
    except ServerStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        for s in servers:
            s.stop()
    table = summarize(bursts, servers, args.concurrency, args.max_noise)
    print_report(table, bursts, servers, args.concurrency, header)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "header": header, "bursts": [asdict(b) for b in bursts],
            "summary": {name: {str(c): row for c, row in rows.items()} for name, rows in table.items()},
        }, indent=2))
        log(f"wrote {args.json}")
    return 1 if any(b.errors for b in bursts) else 0


if __name__ == "__main__":
    sys.exit(main())
