"""Worker benchmarks: our worker side by side with llama.cpp's C++ llama-server, one workload per run.

    .venv/bin/python -m bench.bench_worker                                  # throughput, 5 rounds
    .venv/bin/python -m bench.bench_worker --workload shared-prefix         # or overload, long-prompt
    .venv/bin/python -m bench.bench_worker --quick                          # 2 rounds
    .venv/bin/python -m bench.bench_worker --targets llama-server,llama-server   # harness self-check
    .venv/bin/python -m bench.bench_worker --rounds 3 --restarts 4          # 12 rounds, 4 process pairs
    .venv/bin/python -m bench.bench_worker --targets "ours,llama-server:-fa off"  # a target's own flags
    .venv/bin/python -m bench.bench_worker --url mine=http://127.0.0.1:8080 --targets mine
    .venv/bin/python -m bench.bench_worker --json-schema builtin --concurrency 1,8   # constrained vs not

Method, common to all workloads. Every target is started once (or is an already running `--url`) with
`--parallel` slots (8), the same total KV size `--ctx-size` (its default depends on the workload), each
side's default KV layout (a KV stream of ctx/parallel cells per slot; `--kv-unified` gives both sides one
cache shared by all slots) and the same `--threads` (default: all CPUs; 0: each server's own default). A
target may carry its own extra flags: `--targets "ours,llama-server:-fa off"` (kind, colon, shell-split
flags). Each target is warmed up (one request, one burst of `--parallel` requests, then one unrecorded
burst or round of the workload) and stays up for the whole run. Then, for each of `--rounds` rounds (5)
and each concurrency N of the workload, every target runs the workload's burst or round in turn; the turn
order flips every round, so slow drifts of this shared machine hit both sides alike. With `--restarts K`
all of this is done K times with fresh processes (started in alternating order), the rounds numbered on:
on this VM a process can run up to ~20% faster or slower than an identical one for its whole life (the
self-check once read 0.81x in all 5 of its rounds, then 1.06x in the next run), which no number of rounds
within one process averages out.

Every request is a streaming `/v1/completions` with a token-id prompt of normal vocabulary tokens,
temperature 0 and `ignore_eos`, and must generate exactly its `max_tokens` (from `usage.completion_tokens`,
else `timings.predicted_n`, else the number of token chunks): a mismatch or an HTTP or stream error is
reported, not averaged in, and makes the exit code 1. Prompts depend on (round, attempt, request) only, so
both sides get the same ones, and none is a prefix-cache hit of an earlier one unless the workload says so.
TTFT = send -> first token chunk; ITL (inter-token latency) = the gap between consecutive token chunks of
one request; p50/p99 are taken per burst. The table shows, per target, the median over rounds of each
round's value (min-max over rounds for the headline figure), then the ratio first/second target marked
against the workload's goal, with the median of the per-round ratios ("paired": both sides of a round ran
back to back, so a noisy minute hits both).

throughput (default). Per round and N in `--concurrency` (1,4,8,16): a burst of N requests sent at once,
distinct prompts of `--prompt-tokens` (32-64) tokens, `--max-tokens` (64) new tokens each; ctx 4096.
Aggregate tokens/s = generated tokens / (last response end - burst start); TTFT and ITL p50/p99 pooled over
the burst; `srv ms/tok` is the server's own `timings` (generation time per token), which separates server
speed from transport. Goal: tokens/s >= 1.0x the second target's at every N (and N=8 vs N=1 >= 2.5x).

shared-prefix. Per round a FRESH common prefix of `--prefix-tokens` (1000) tokens, never seen by either
server before (new every round and attempt, the same for both targets in a round), and N = `--parallel`
distinct suffixes of `--suffix-tokens` (16); `--max-tokens` 16; ctx 16384. The cold burst sends the N
requests at once: TTFT p50, p99, the last TTFT, and the burst's wall time. The warm burst then sends
exactly the same N requests again: TTFT p50/p99. Goals: cold TTFT p50 <= 0.33x the second target's (the
prefix computed once, not N times), warm TTFT p50 <= 1.0x.

overload. One burst of 2 x `--parallel` requests (16 on 8 slots) with throughput's prompts and
`--max-tokens` (64); ctx 4096. Tokens/s, TTFT p50/p99, ITL. Goal: TTFT p99 <= 0.5x the second target's.

long-prompt. `--parallel` - 1 (7) decoders with throughput's short prompts start at once. Once each has
streamed 16 tokens, their gaps are measured over a steady window of `--steady-seconds` (1.5); then ONE
request with a fresh `--long-prompt-tokens` (8000) token prompt and max_tokens 1 is sent, and the decoders'
gaps are recorded from that moment for `--window-seconds` (20) or until its first token, whichever comes
first (a gap counts if it overlaps that window, so a stall across its end is in). The window is bounded
because a server that protects the decoders prefills slowly, and minutes later their contexts (and so
their gaps) have grown for reasons of their own. ctx: parallel x (long prompt + 512) = 68096, so every
slot has room for the long prompt. Reported: steady ITL p50/p99, ITL p50/p99 in the window,
window-p99 / steady-p99, and the long prompt's TTFT (under load for the window, alone afterwards: the
client then hangs up on the decoders, closing their streams; their token counts are not checked, the
long prompt's is). Goal: window-p99 <= 2x steady-p99 on each target (and the first/second ratios are
shown). The decoders' max_tokens is sized from the target's own measured speed (the fastest steady ITL),
with a margin, so that they are still decoding at the window's end, yet a server that ignores a gone
client stops soon; `--max-tokens` fixes it instead. A round
in which a decoder finished before that is cut at its end, says so, and is rerun with more tokens.

--json-schema PATH|builtin (throughput only): every target also runs as TARGET+schema, a second target on
the same server whose requests carry a JSON schema (the file at PATH, or `builtin`: an object with an
integer, a string of at most 24 characters, an enum, an array of at most 6 numbers and a string of at most
600 characters, so that on random weights the value is rarely complete within 64 tokens), sent as the
top-level `json_schema` field (what llama-server's /v1/completions honours: it ignores `response_format`
there; `--schema-field response_format` sends OpenAI's form instead). Both variants take turns like any
two targets, with prompts of their own of the same lengths (the twin's would be prefix-cache hits), so one
run shows TARGET, TARGET+schema and their ratio (goal: >= 0.9x tok/s, TTFT shown). Constrained
requests go without `ignore_eos`: llama-server fails a request whose grammar completes under ignore_eos
(HTTP 500 "Unexpected empty grammar stack"), and the grammar bans EOS until the value is complete anyway.
So they may stop early: tok/s counts the tokens generated (usage.completion_tokens) and the ratio line
shows the mean tokens per request of both variants. A constrained answer must start like the schema's
value ('{' for an object) and, if it stopped before max_tokens, parse as JSON: a server that ignores the
schema fails loudly instead of looking fast.

Noise. This box is shared, and llama.cpp's threads (one per core, spinning at barriers) collapse by 10-40x
when another process takes a core. So: before each burst or round we wait (up to --quiet-wait) for the
machine to be quiet; during it we measure the CPU used by the target, by us, and by everything else
(/proc/stat minus the two); an attempt during which other processes used more than --max-noise CPUs is
discarded and rerun (up to --retries times, with fresh prompt tokens of the same lengths; an attempt taking
3x longer than the fastest clean one is cut short, its requests cancelled; the last attempt is always kept).
The table shows those CPU figures, so a reader can tell a clean run from a noisy one. The CPU time of idle
targets is sampled too: an idle server that burns CPU (a busy-polling engine loop) would slow down the
other side and is reported as a warning. Reading ratios: two identical llama-servers
(`--targets llama-server,llama-server`, the harness self-check, which works with every workload) differ by
up to ~5% in median tokens/s on a quiet box, so ratios within 0.95-1.05x are noise; p99s and TTFTs of small
bursts vary more: run the self-check with the same workload to see its own floor.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import random
import shlex
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
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
# Goals, first target / second target (docs: issue 3, "Done when").
TARGET_RATIO = 1.0  # throughput: tokens/s at every N
TARGET_SCALING = 2.5  # throughput: tokens/s at N=8 vs N=1, each target
TARGET_COLD_TTFT = 0.33  # shared-prefix: cold burst TTFT p50
TARGET_WARM_TTFT = 1.0  # shared-prefix: warm burst TTFT p50
TARGET_OVERLOAD_TTFT = 0.5  # overload: TTFT p99
TARGET_PREFILL_ITL = 2.0  # long-prompt: decoders' ITL p99 during the long prefill / steady, each target
WARM_TOKENS = 16  # long-prompt: tokens every decoder streams before the steady window starts
LONG_PROMPT_MAX_TOKENS = 1
DECODER_MARGIN = 2.0  # long-prompt: decoders are sized for this many times the expected prefill
TARGET_SCHEMA_RATIO = 0.9  # --json-schema: constrained tok/s / unconstrained, same server
SCHEMA_SUFFIX = "+schema"
# --json-schema builtin: every JSON kind a schema constrains, and a long free-text tail, so that
# greedy decoding on random weights rarely completes the value within --max-tokens (64).
BUILTIN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
        "scores": {"type": "array", "items": {"type": "number"}, "maxItems": 6},
        "notes": {"type": "string", "maxLength": 600},
    },
    "required": ["id", "name", "kind", "scores", "notes"],
    "additionalProperties": False,
}


# ---------------------------------------------------------------- prompts


def normal_token_ids(model: Path) -> list[int]:
    """Ids of the model's NORMAL vocabulary tokens (no control/byte/unused ones), from the GGUF
    (or, for an HF folder, its tokenizer.json minus the added special tokens)."""
    if model.is_dir():
        spec = json.loads((model / "tokenizer.json").read_text())
        special = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        return sorted(i for i in spec["model"]["vocab"].values() if i not in special)
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


def random_tokens(vocab: list[int], seed: str, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice(vocab) for _ in range(length)]


def make_prompt(vocab: list[int], round_idx: int, concurrency: int, req_idx: int,
                min_len: int, max_len: int, attempt: int = 0, salt: str = "") -> list[int]:
    """The prompt of one request of a cell. A retried burst gets other tokens (no prefix-cache
    hit on what the server saw on the first attempt) but the same lengths (the same work); so does
    a `salt` (a +schema target, which shares its server with the plain one)."""
    length = random.Random(f"{round_idx}/{concurrency}/{req_idx}").randint(min_len, max_len)
    return random_tokens(vocab, f"{round_idx}/{concurrency}/{req_idx}/{attempt}{salt}", length)


# ---------------------------------------------------------------- one request, one burst


@dataclass
class RequestResult:
    start: float = 0.0  # perf_counter when sent
    ttft: float = math.nan
    token_times: list[float] = field(default_factory=list)  # perf_counter at each token chunk
    num_tokens: int = 0
    server_tpot_ms: float = math.nan  # the server's own timings.predicted_ms / predicted_n
    end: float = 0.0
    error: str | None = None
    text: list[str] = field(default_factory=list)  # the streamed pieces
    finish_reason: str | None = None

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.token_times)]


@dataclass(frozen=True)
class Constraint:
    """--json-schema: what constrained requests add to their body, and how their answers must start."""

    body: dict[str, Any]
    opening: str | None  # '{' for an object schema, '[' for an array one, else None (not checked)

    def check(self, res: RequestResult, max_tokens: int) -> str | None:
        """Why `res` is not a plausible constrained answer, or None."""
        text = "".join(res.text).lstrip()
        if not 0 < res.num_tokens <= max_tokens:
            return f"generated {res.num_tokens} tokens, expected 1 to {max_tokens}"
        if self.opening is not None and not text.startswith(self.opening):
            return f"answer does not start with {self.opening!r} (schema ignored?): {text[:80]!r}"
        if res.num_tokens < max_tokens:  # it stopped by itself: the value must be complete
            try:
                json.loads(text)
            except json.JSONDecodeError:
                return (
                    f"stopped after {res.num_tokens} tokens ({res.finish_reason}) "
                    f"with invalid JSON: {text[:80]!r}"
                )
        return None


def make_constraint(schema: dict[str, Any], field_name: str) -> Constraint:
    if field_name == "json_schema":
        body: dict[str, Any] = {"json_schema": schema}
    else:
        body = {
            "response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
        }
    kind = schema.get("type") or ("object" if "properties" in schema else None)
    return Constraint(body, {"object": "{", "array": "["}.get(kind) if isinstance(kind, str) else None)


def _count_tokens(final: dict[str, Any], num_chunks: int) -> int:
    usage = final.get("usage") or {}
    if isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    timings = final.get("timings") or {}
    if isinstance(timings.get("predicted_n"), int):
        return int(timings["predicted_n"])
    return num_chunks


async def stream_completion(client: httpx.AsyncClient, model_name: str, prompt: list[int],
                            max_tokens: int, res: RequestResult | None = None,
                            constraint: Constraint | None = None) -> RequestResult:
    """One streaming request. `res` is filled in as tokens arrive, so a caller that cancels the
    request keeps what it got."""
    body: dict[str, Any] = {
        "model": model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    if constraint is not None:  # no ignore_eos: llama-server fails a grammar that completes under it
        del body["ignore_eos"]
        body.update(constraint.body)
    res = res if res is not None else RequestResult()
    res.start = time.perf_counter()
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
                if choices:
                    res.text.append(choices[0].get("text") or "")
                    res.finish_reason = choices[0].get("finish_reason") or res.finish_reason
                # A token chunk carries text, or is a not-yet-finished chunk (a token whose text
                # is held back, e.g. half a UTF-8 character: we send it empty, llama-server sends
                # nothing). An empty closing chunk is not one.
                if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
                    if not res.token_times:
                        res.ttft = now - res.start
                    res.token_times.append(now)
        res.end = time.perf_counter()
        if math.isnan(res.ttft) and first_chunk_at is not None:
            # No token chunk at all: llama-server sends none while the text ends in an incomplete
            # UTF-8 character (a greedy loop on a byte token does that). What the user waited
            # for the first byte is then the closing chunk.
            res.ttft = first_chunk_at - res.start
        res.num_tokens = _count_tokens(final, len(res.token_times))
        t = final.get("timings") or {}
        if t.get("predicted_n") and isinstance(t.get("predicted_ms"), int | float):
            res.server_tpot_ms = float(t["predicted_ms"]) / float(t["predicted_n"])
        if constraint is not None:
            res.error = constraint.check(res, max_tokens)
        elif res.num_tokens != max_tokens:
            res.error = f"generated {res.num_tokens} tokens, expected {max_tokens}"
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def errors_of(results: list[RequestResult]) -> list[str]:
    return [r.error for r in results if r.error is not None]


def p50_p99(name: str, values_ms: list[float]) -> dict[str, float]:
    return {f"{name}_p50_ms": percentile(values_ms, 50), f"{name}_p99_ms": percentile(values_ms, 99)}


def ttfts_ms(results: list[RequestResult]) -> list[float]:
    return [r.ttft * 1e3 for r in results if r.error is None]


# ---------------------------------------------------------------- targets


@dataclass
class Target:
    """A started target, and what the run has learnt about its speed (long-prompt sizing). With
    --json-schema a server has two: plain, and TARGET+schema whose requests carry the constraint."""

    server: Server
    client: httpx.AsyncClient
    model_name: str
    itl_s: float = math.nan  # its decoders' steady ITL p50, last measured
    long_ttft_s: float = math.nan  # the long prompt's TTFT next to decoders, last measured or guessed
    constraint: Constraint | None = None

    @property
    def name(self) -> str:
        return self.server.name + (SCHEMA_SUFFIX if self.constraint is not None else "")

    async def burst(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[RequestResult]]:
        """Send all prompts at once; (burst start -> last successful response end, results)."""
        start = time.perf_counter()
        results = await asyncio.gather(
            *(stream_completion(self.client, self.model_name, p, max_tokens, constraint=self.constraint)
              for p in prompts))
        ends = [r.end for r in results if r.error is None]
        return (max(ends) if ends else time.perf_counter()) - start, list(results)


def find_llama_server() -> Path | None:
    hits = sorted(ROOT.glob("third_party/llama-server-build-*/bin/llama-server"))
    return hits[-1] if hits else None


def ours_and_llama_server(
    model: Path, parallel: int, threads: int, binary: str | None, tag: str, ctx_size: int = 8192
) -> list[Server]:
    """Our worker and llama-server on `model`, both at their defaults but for these flags (`ours
    --parallel P --ctx-size C --threads T`, `llama-server -np P -c C -t T`), logs in a temporary
    folder; `binary` None: the one scripts/build_llama_server.sh built."""
    path = Path(binary) if binary else find_llama_server()
    if path is None:
        raise SystemExit("no llama-server: run scripts/build_llama_server.sh (or pass --llama-server)")
    log_dir = Path(tempfile.mkdtemp(prefix=f"{tag}_"))
    p, c, t = str(parallel), str(ctx_size), str(threads)
    servers = []
    for name, cmd in (
        ("ours", [sys.executable, "-m", "worker.server.cli", "--model", str(model), "--parallel", p,
                  "--ctx-size", c, "--threads", t]),
        ("llama-server", [str(path), "-m", str(model), "-np", p, "-c", c, "-t", t]),
    ):
        port = free_port()
        servers.append(Server(name, f"http://127.0.0.1:{port}", cmd=[*cmd, "--port", str(port)],
                              log_path=log_dir / f"{name}.log", env={**os.environ, "PYTHONPATH": str(ROOT)}))
    return servers


def build_targets(args: argparse.Namespace, log_dir: Path) -> tuple[list[Server], list[str]]:
    """Servers to start (or external URLs) and header notes with each one's command line."""
    externals = dict(u.split("=", 1) for u in args.url)
    names = [t.strip() for t in args.targets.split(",") if t.strip()]
    servers: list[Server] = []
    notes: list[str] = []
    seen: dict[str, int] = {}
    for spec in names:
        kind, _, extra = spec.partition(":")  # "llama-server:-fa off": a kind plus its own flags
        extra_args = shlex.split(extra)
        seen[spec] = seen.get(spec, 0) + 1
        name = spec if seen[spec] == 1 else f"{spec}#{seen[spec]}"
        if kind in externals:
            servers.append(Server(name=name, base_url=externals[kind].rstrip("/")))
            notes.append(f"{name}: external server at {externals[kind]} (CPU accounted to the process "
                         "listening on its port, if local)")
            continue
        port = free_port()
        threads = [] if args.threads == 0 else [str(args.threads)]
        unified = ["--kv-unified"] if args.kv_unified else []
        if kind == "ours":
            cmd = [sys.executable, "-m", "worker.server.cli", "--model", str(args.model),
                   "--parallel", str(args.parallel), "--ctx-size", str(args.ctx_size),
                   "--port", str(port), "--host", "127.0.0.1", *unified]
            if threads:
                cmd += ["--threads", *threads]
            cmd += args.worker_arg + extra_args
            notes.append(f"{name}: {' '.join(cmd[3:])}")
        elif kind == "llama-server":
            binary = Path(args.llama_server) if args.llama_server else find_llama_server()
            if binary is None or not binary.exists():
                raise SystemExit("llama-server binary not found: run scripts/build_llama_server.sh "
                                 "or pass --llama-server PATH")
            cmd = [str(binary), "-m", str(args.model), "-np", str(args.parallel),
                   "-c", str(args.ctx_size), "--port", str(port), "--host", "127.0.0.1", *unified]
            if threads:
                cmd += ["-t", *threads]
            cmd += args.server_arg + extra_args
            notes.append(f"{name}: llama-server {' '.join(cmd[1:])}")
        else:
            raise SystemExit(f"unknown target {kind!r}: use one of {TARGET_KINDS} or name it in --url")
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        )
        servers.append(Server(name=name, base_url=f"http://127.0.0.1:{port}", cmd=cmd,
                              log_path=log_dir / f"{name.replace('#', '_')}.log", env=env))
    return servers, notes


async def model_name_of(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    data = r.json().get("data") or []
    return str(data[0]["id"]) if data else "default"


# ---------------------------------------------------------------- workloads: one burst or round each


@dataclass
class Bench:
    """What every burst needs besides its target: the options and the vocabulary to draw prompts from."""

    args: argparse.Namespace
    vocab: list[int]

    def short_prompts(self, n: int, round_idx: int, attempt: int, salt: str = "") -> list[list[int]]:
        lo, hi = self.args.prompt_tokens
        return [make_prompt(self.vocab, round_idx, n, i, lo, hi, attempt, salt) for i in range(n)]


@dataclass
class Outcome:
    """What one attempt of a burst or round measured."""

    metrics: dict[str, float]
    errors: list[str]
    wall_s: float  # how long the attempt took (the too-slow guard compares these)
    notes: list[str] = field(default_factory=list)
    rerun_because: str | None = None  # it ran, but did not measure what it should: retry like noise


RoundFn = Callable[[Bench, Target, int, int, int], Awaitable[Outcome]]


async def throughput_burst(bench: Bench, t: Target, n: int, round_idx: int, attempt: int) -> Outcome:
    """N requests with short distinct prompts at once (throughput, overload)."""
    # A +schema target gets prompts of its own (same lengths): its plain twin, on the same server,
    # ran just before, and the same prompts would be prefix-cache hits.
    salt = SCHEMA_SUFFIX if t.constraint is not None else ""
    wall, results = await t.burst(bench.short_prompts(n, round_idx, attempt, salt), bench.args.max_tokens)
    ok = [r for r in results if r.error is None]
    num_tokens = sum(r.num_tokens for r in ok)
    metrics = {
        "tok_s": num_tokens / wall if ok and wall > 0 else math.nan,
        **p50_p99("ttft", ttfts_ms(ok)),
        **p50_p99("itl", [g * 1e3 for r in ok for g in r.gaps]),
        "srv_ms_per_tok": median([r.server_tpot_ms for r in ok]),
        "num_tokens": num_tokens, "wall_s": wall,
    }
    return Outcome(metrics, errors_of(results), wall)


async def shared_prefix_round(bench: Bench, t: Target, n: int, round_idx: int, attempt: int) -> Outcome:
    """N requests = one fresh prefix + N distinct suffixes: once cold, then the same N again warm."""
    args = bench.args
    prefix = random_tokens(bench.vocab, f"prefix/{round_idx}/{attempt}", args.prefix_tokens)
    prompts = [prefix + random_tokens(bench.vocab, f"suffix/{round_idx}/{attempt}/{i}", args.suffix_tokens)
               for i in range(n)]
    start = time.perf_counter()
    cold_wall, cold = await t.burst(prompts, args.max_tokens)
    _, warm = await t.burst(prompts, args.max_tokens)
    cold_ttfts = ttfts_ms(cold)
    metrics = {
        **p50_p99("cold_ttft", cold_ttfts),
        "cold_ttft_last_ms": max(cold_ttfts, default=math.nan),
        "cold_wall_s": cold_wall,
        **p50_p99("warm_ttft", ttfts_ms(warm)),
    }
    return Outcome(metrics, errors_of(cold + warm), time.perf_counter() - start)


def slot_room(args: argparse.Namespace, num_decoders: int) -> int:
    """The most tokens a long-prompt decoder can generate: its slot's cells minus its prompt (and, in
    a unified cache, minus the long prompt, shared among the decoders)."""
    longest: int = args.prompt_tokens[1]
    if args.kv_unified:
        return (int(args.ctx_size) - int(args.long_prompt_tokens) - 8) // num_decoders - longest
    return int(args.ctx_size) // int(args.parallel) - longest - 1


def decoder_max_tokens(args: argparse.Namespace, t: Target, num_decoders: int) -> int:
    """Enough tokens for the decoders to outlast the long prefill at their steady speed (an upper
    bound: a prefill only slows them down), with a margin; at most what a slot has room for."""
    if args.max_tokens is not None:
        return int(args.max_tokens)
    room = slot_room(args, num_decoders)
    if not (t.itl_s > 0 and t.long_ttft_s > 0):  # not measured yet (NaN)
        return room
    during = min(DECODER_MARGIN * t.long_ttft_s, args.window_seconds + 2.0)
    seconds = args.steady_seconds + during + 1.0
    return min(room, WARM_TOKENS + math.ceil(float(seconds) / t.itl_s))


def split_gaps(decoders: list[RequestResult], steady_from: float, prefill_from: float,
               prefill_to: float) -> tuple[list[float], list[float], float]:
    """The decoders' gaps (ms) inside the steady window [steady_from, prefill_from], and those that
    overlap the prefill window (prefill_from, end); end is prefill_to, or earlier if a decoder
    streamed its last token before (returned: the window was then cut)."""
    end = min([prefill_to, *(r.token_times[-1] for r in decoders if r.token_times)])
    steady: list[float] = []
    during: list[float] = []
    for r in decoders:
        for a, b in itertools.pairwise(r.token_times):
            if a >= steady_from and b <= prefill_from:
                steady.append((b - a) * 1e3)
            elif b > prefill_from and a < end:
                during.append((b - a) * 1e3)
    return steady, during, end


async def poll_until(pred: Callable[[], bool], timeout: float, interval: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() >= deadline:
            return False
        await asyncio.sleep(interval)
    return True


async def long_prompt_round(bench: Bench, t: Target, n: int, round_idx: int, attempt: int) -> Outcome:
    """N decoders stream; after a steady window one long prompt arrives: how long do they stall?
    Once each decoder has streamed a token past the long prompt's first one, we hang up on them."""
    args = bench.args
    max_tokens = decoder_max_tokens(args, t, n)
    decoders = [RequestResult() for _ in range(n)]
    start = time.perf_counter()
    tasks = [asyncio.create_task(stream_completion(t.client, t.model_name, p, max_tokens, res=r))
             for p, r in zip(bench.short_prompts(n, round_idx, attempt), decoders, strict=True)]

    def has_ended() -> bool:
        return any(task.done() for task in tasks)

    try:
        is_ready = await poll_until(
            lambda: has_ended() or all(len(r.token_times) >= WARM_TOKENS for r in decoders),
            args.request_timeout,
        )
        if has_ended() or not is_ready:
            errors = errors_of(decoders) or [f"the decoders did not all stream {WARM_TOKENS} tokens"]
            return Outcome({}, errors, time.perf_counter() - start)
        steady_from = time.perf_counter()
        await asyncio.sleep(args.steady_seconds)
        long_prompt = random_tokens(bench.vocab, f"long/{round_idx}/{attempt}", args.long_prompt_tokens)
        long = RequestResult(start=time.perf_counter())  # stamped again when sent; the window needs it now
        long_task = asyncio.create_task(
            stream_completion(t.client, t.model_name, long_prompt, LONG_PROMPT_MAX_TOKENS, res=long))
        await poll_until(lambda: long_task.done() or bool(long.token_times)
                         or time.perf_counter() - long.start > args.window_seconds, args.request_timeout)
        window_end = min(
            long.start + args.window_seconds, long.start + long.ttft if long.token_times else math.inf
        )
        if (
            not long_task.done() or long.error is None
        ):  # the gap spanning the window's end counts: wait for it
            await poll_until(lambda: all(task.done() or r.token_times[-1] > window_end
                                         for task, r in zip(tasks, decoders, strict=True)),
                             args.request_timeout)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    await long_task  # alone from here on: its TTFT counts the window under load and the rest unloaded
    wall = time.perf_counter() - start
    errors = errors_of([*decoders, long])
    if errors:
        return Outcome({}, errors, wall)
    first_token_at = long.start + long.ttft
    steady, during, end = split_gaps(decoders, steady_from, long.start, min(first_token_at, window_end))
    metrics = {
        **p50_p99("steady_itl", steady), **p50_p99("during_itl", during),
        "long_ttft_ms": long.ttft * 1e3, "decoder_max_tokens": max_tokens,
        "num_steady_gaps": len(steady), "num_during_gaps": len(during),
    }
    metrics["itl_p99_ratio"] = metrics["during_itl_p99_ms"] / metrics["steady_itl_p99_ms"]
    # Sizing errs on the generous side (the fastest ITL, the slowest prefill seen): we hang up anyway.
    steady_itl_s = metrics["steady_itl_p50_ms"] / 1e3
    t.itl_s = min(t.itl_s, steady_itl_s) if t.itl_s > 0 else steady_itl_s
    t.long_ttft_s = max(t.long_ttft_s, long.ttft) if t.long_ttft_s > 0 else long.ttft
    out = Outcome(metrics, [], wall)
    if end < min(first_token_at, window_end):
        t.long_ttft_s *= 2
        out.notes.append(f"a decoder finished its {max_tokens} tokens {first_token_at - end:.2f}s before the "
                         f"long prompt's first token ({long.ttft:.2f}s prefill): during-window cut there")
        if args.max_tokens is None:
            out.rerun_because = out.notes[-1]
    return out


@dataclass(frozen=True)
class Column:
    key: str
    title: str
    spec: str = "8.1f"
    span: bool = False  # also show [min - max] over rounds

    @property
    def width(self) -> int:
        return max(len(self.title), len(fmt(0.0, self.spec)))


@dataclass(frozen=True)
class Goal:
    key: str
    label: str
    op: str  # ">=" or "<="
    bound: float
    per_target: bool = False  # the bound is on each target's own value, not on first/second

    def mark(self, value: float) -> str:
        if math.isnan(value):
            return "n/a"
        is_met = value >= self.bound if self.op == ">=" else value <= self.bound
        return "ok" if is_met else "MISSED"

    def text(self, value: float) -> str:
        return f"{self.mark(value)}, goal {self.op} {self.bound:g}x"


@dataclass(frozen=True)
class Workload:
    run: RoundFn
    cells: Callable[[argparse.Namespace], list[int]]  # the concurrencies N of one round
    columns: tuple[Column, ...]
    goals: tuple[Goal, ...]
    ratios: tuple[str, ...]  # further first/second ratios shown (column keys), no goal
    legend: str


CPU_COLUMNS = (Column("cpu_target", "CPUs", "4.2f"), Column("cpu_foreign", "noise", "5.2f"))
BURST_COLUMNS = (
    Column("tok_s", "tok/s", "7.1f", span=True), Column("ttft_p50_ms", "TTFT p50"),
    Column("ttft_p99_ms", "TTFT p99"), Column("itl_p50_ms", "ITL p50", "7.1f"),
    Column("itl_p99_ms", "ITL p99", "7.1f"), Column("srv_ms_per_tok", "srv ms/tok", "10.2f"),
)
BURST_LEGEND = ("tok/s: generated tokens / burst wall time; TTFT, ITL in ms.\n"
                "srv ms/tok: the server's own timings (predicted_ms / predicted_n), as it reports them.")
WORKLOADS: dict[str, Workload] = {
    "throughput": Workload(
        throughput_burst,
        lambda a: list(a.concurrency),
        BURST_COLUMNS,
        (Goal("tok_s", "tok/s", ">=", TARGET_RATIO),),
        ("ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"),
        BURST_LEGEND,
    ),
    "shared-prefix": Workload(
        shared_prefix_round,
        lambda a: [a.parallel],
        (
            Column("cold_ttft_p50_ms", "cold p50", span=True),
            Column("cold_ttft_p99_ms", "cold p99"),
            Column("cold_ttft_last_ms", "cold last", "9.1f"),
            Column("cold_wall_s", "cold s", "6.2f"),
            Column("warm_ttft_p50_ms", "warm p50"),
            Column("warm_ttft_p99_ms", "warm p99"),
        ),
        (
            Goal("cold_ttft_p50_ms", "cold TTFT p50", "<=", TARGET_COLD_TTFT),
            Goal("warm_ttft_p50_ms", "warm TTFT p50", "<=", TARGET_WARM_TTFT),
        ),
        ("cold_ttft_p99_ms", "cold_ttft_last_ms", "cold_wall_s", "warm_ttft_p99_ms"),
        "cold: TTFT (ms) of N requests sharing a prefix no server has seen, sent at once (p50, p99, the "
        "last one) and the burst's wall time (s);\nwarm: TTFT of the same N requests sent again.",
    ),
    "overload": Workload(
        throughput_burst,
        lambda a: [2 * a.parallel],
        BURST_COLUMNS,
        (Goal("ttft_p99_ms", "TTFT p99", "<=", TARGET_OVERLOAD_TTFT),),
        ("tok_s", "ttft_p50_ms", "itl_p99_ms"),
        BURST_LEGEND,
    ),
    "long-prompt": Workload(
        long_prompt_round,
        lambda a: [a.parallel - 1],
        (
            Column("steady_itl_p50_ms", "steady p50", "10.1f"),
            Column("steady_itl_p99_ms", "steady p99", "10.1f"),
            Column("during_itl_p50_ms", "prefill p50", "11.1f"),
            Column("during_itl_p99_ms", "prefill p99", "11.1f", span=True),
            Column("itl_p99_ratio", "p99 ratio", "9.2f"),
            Column("long_ttft_ms", "long TTFT", "9.1f"),
            Column("decoder_max_tokens", "dec tokens", "10.0f"),
        ),
        (Goal("itl_p99_ratio", "ITL p99 prefill/steady", "<=", TARGET_PREFILL_ITL, per_target=True),),
        ("steady_itl_p50_ms", "during_itl_p99_ms", "long_ttft_ms"),
        "N decoders; steady: their ITL (ms) before the long prompt; prefill: their ITL from its send to its "
        "first token;\np99 ratio: prefill p99 / steady p99 (per round); long TTFT: the long prompt's (ms); "
        "dec tokens: the decoders' max_tokens.",
    ),
}


def describe_workload(args: argparse.Namespace) -> str:
    lo, hi = args.prompt_tokens
    short = f"prompts {lo}-{hi} tokens"
    if args.workload == "throughput":
        constrained = "" if args.schema is None else (
            f"; each target also as TARGET{SCHEMA_SUFFIX}: the same requests constrained by the JSON schema "
            f"{args.json_schema} (field {args.schema_field}, no ignore_eos: may stop early)")
        return (
            f"workload throughput: bursts of N = {','.join(map(str, args.concurrency))} requests, {short}, "
            f"{args.max_tokens} tokens each{constrained}"
        )
    if args.workload == "shared-prefix":
        return (
            f"workload shared-prefix: {args.parallel} requests = one fresh {args.prefix_tokens}-token prefix "
            f"(new every round) + distinct {args.suffix_tokens}-token suffixes, {args.max_tokens} tokens "
            f"each; cold burst, then the same {args.parallel} requests again (warm)"
        )
    if args.workload == "overload":
        return (f"workload overload: {2 * args.parallel} requests at once on {args.parallel} slots, {short}, "
                f"{args.max_tokens} tokens each")
    sizing = (f"{args.max_tokens} tokens" if args.max_tokens is not None else
              f"max_tokens sized to outlast the prefill ({DECODER_MARGIN}x margin)")
    return (f"workload long-prompt: {args.parallel - 1} decoders ({short}, {sizing}); after {WARM_TOKENS} "
            f"tokens each, a {args.steady_seconds}s steady window; then one {args.long_prompt_tokens}-token "
            f"prompt (max_tokens {LONG_PROMPT_MAX_TOKENS}); decoders' ITL until its first token")


# ---------------------------------------------------------------- noise guard


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


async def measured(t: Target, others: list[Target], work: Awaitable[Outcome], give_up_after: float | None
                   ) -> tuple[Outcome, dict[str, float], dict[str, float]] | None:
    """Run `work` and measure the CPUs used meanwhile by the target, by us, by the idle targets and
    by the rest: (outcome, CPU metrics, idle target -> CPUs). None if it took longer than
    `give_up_after` seconds (its requests are then cancelled)."""
    others0 = {o.name: o.server.cpu_seconds() for o in others}
    sys0, tgt0, self0 = system_busy_seconds(), t.server.cpu_seconds(), self_cpu_seconds()
    t0 = time.perf_counter()
    try:
        out = await asyncio.wait_for(work, give_up_after)
    except TimeoutError:
        return None
    elapsed = time.perf_counter() - t0
    d_sys, d_tgt, d_self = (
        system_busy_seconds() - sys0,
        t.server.cpu_seconds() - tgt0,
        self_cpu_seconds() - self0,
    )
    idle = {o.name: (o.server.cpu_seconds() - others0[o.name]) / elapsed for o in others}
    cpu = {
        "cpu_target": d_tgt / elapsed, "cpu_client": d_self / elapsed,
        # An external target whose process cannot be found counts as foreign.
        "cpu_foreign": max(0.0, (d_sys - d_tgt - d_self) / elapsed - sum(idle.values())),
    }
    return out, cpu, idle


@dataclass
class Sample:
    """The kept attempt of one burst (throughput, overload) or round (shared-prefix, long-prompt)."""

    workload: str
    target: str
    concurrency: int
    round: int
    metrics: dict[str, float]  # the workload's, plus cpu_target, cpu_client, cpu_foreign, foreign_before
    errors: list[str]
    notes: list[str]
    idle_cpu_of_others: dict[str, float]  # other target -> CPUs it used while idle
    num_discarded: int = 0  # earlier attempts thrown away (noisy, too slow, or measured the wrong thing)


async def measure_with_retries(bench: Bench, t: Target, targets: list[Target], n: int, round_idx: int,
                               fastest: dict[tuple[str, int], float]) -> Sample:
    """Run a burst or round until one is clean (little foreign CPU, nothing to rerun). An attempt
    running far longer than the fastest clean one so far is cut short; the last one always runs."""
    args = bench.args
    others = [o for o in targets if o.server is not t.server]  # not its own +schema variant
    attempt = 0
    while True:
        foreign_before = await wait_quiet(args.quiet_below, args.quiet_wait)
        is_last = attempt >= args.retries
        best = fastest.get((t.name, n))
        limit = None if is_last or best is None else max(3.0 * best, best + 2.0)
        m = await measured(t, others, WORKLOADS[args.workload].run(bench, t, n, round_idx, attempt), limit)
        if m is not None:
            out, cpu, idle = m
            metrics = {**out.metrics, **cpu, "foreign_before": foreign_before}
            sample = Sample(
                args.workload, t.name, n, round_idx, metrics, out.errors, out.notes, idle, attempt
            )
            is_clean = cpu["cpu_foreign"] <= args.max_noise and out.rerun_because is None
            if is_clean and not out.errors:
                fastest[t.name, n] = min(fastest.get((t.name, n), math.inf), out.wall_s)
            if is_last or is_clean or out.errors:
                return sample
            why = out.rerun_because or f"other processes used {cpu['cpu_foreign']:.2f} CPUs meanwhile"
        else:
            why = f"gave up after {limit:.1f}s (fastest clean attempt: {best:.1f}s)"
        log(f"round {round_idx + 1} N={n} {t.name}: attempt {attempt + 1} discarded, {why}")
        attempt += 1


# ---------------------------------------------------------------- the run


async def warm_up(bench: Bench, t: Target) -> None:
    """One request, one burst of `parallel`, then one unrecorded burst or round of the workload
    (for long-prompt, after a first guess of the speeds that size its decoders)."""
    args = bench.args
    workload = WORKLOADS[args.workload]
    warm_tokens = 64 if args.workload == "long-prompt" else args.max_tokens
    prompts = bench.short_prompts(args.parallel, -1, 0)
    _, first = await t.burst(prompts[:1], warm_tokens)
    _, burst = await t.burst(prompts, warm_tokens)
    errors = errors_of(first + burst)
    if args.workload == "long-prompt" and not errors:
        t.itl_s = percentile([g for r in burst for g in r.gaps], 50)
        long_prompt = random_tokens(bench.vocab, "long/warm-up", args.long_prompt_tokens)
        _, (long,) = await t.burst([long_prompt], LONG_PROMPT_MAX_TOKENS)
        errors = errors_of([long])
        t.long_ttft_s = 2 * long.ttft  # alone; next to decoders it shares the CPUs
    if not errors:
        errors = (await workload.run(bench, t, workload.cells(args)[-1], -1, 0)).errors
    if errors:
        raise SystemExit(f"{t.name}: warm-up failed: {errors[0]}")
    log(f"{t.name}: warmed up (model {t.model_name!r})")


def log_sample(s: Sample, rounds: int) -> None:
    cols = (*WORKLOADS[s.workload].columns, *CPU_COLUMNS)
    figures = "  ".join(f"{c.title} {fmt(s.metrics.get(c.key, math.nan), c.spec).strip()}" for c in cols)
    log(f"round {s.round + 1}/{rounds} N={s.concurrency:<2} {s.target:<14} {figures}"
        + (f"  ERRORS: {len(s.errors)} ({s.errors[0]})" if s.errors else "")
        + "".join(f"  NOTE: {note}" for note in s.notes))


async def run(
    args: argparse.Namespace, servers: list[Server], vocab: list[int], first_round: int = 0
) -> list[Sample]:
    """`--rounds` rounds numbered from `first_round` (a restart's rounds follow the last one's)."""
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    clients = [httpx.AsyncClient(base_url=s.base_url, timeout=timeout, limits=limits) for s in servers]
    bench = Bench(args, vocab)
    try:
        targets = [Target(s, c, await model_name_of(c)) for s, c in zip(servers, clients, strict=True)]
        if args.schema is not None:  # each server twice: plain, then constrained (TARGET+schema)
            constraint = make_constraint(args.schema, args.schema_field)
            targets = [v for t in targets for v in (t, replace(t, constraint=constraint))]
        for t in targets:
            await warm_up(bench, t)
        samples: list[Sample] = []
        fastest: dict[tuple[str, int], float] = {}  # clean attempt wall time per (target, N)
        for round_idx in range(first_round, first_round + args.rounds):
            order = targets if round_idx % 2 == 0 else list(reversed(targets))
            for n in WORKLOADS[args.workload].cells(args):
                for t in order:
                    samples.append(await measure_with_retries(bench, t, targets, n, round_idx, fastest))
                    log_sample(samples[-1], args.rounds * args.restarts)
        return samples
    finally:
        for c in clients:
            await c.aclose()


# ---------------------------------------------------------------- the report


def summarize(samples: list[Sample], names: list[str], cells: list[int], max_noise: float) -> dict[str, Any]:
    """Per target and N: the median, min and max over rounds of every metric, and what went wrong."""
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for name in names:
        table[name] = {}
        for n in cells:
            mine = [s for s in samples if s.target == name and s.concurrency == n]
            keys = sorted({k for s in mine for k in s.metrics})
            values = {k: [s.metrics.get(k, math.nan) for s in mine] for k in keys}
            table[name][n] = {
                "median": {k: median(v) for k, v in values.items()},
                "min": {
                    k: min((x for x in v if not math.isnan(x)), default=math.nan) for k, v in values.items()
                },
                "max": {
                    k: max((x for x in v if not math.isnan(x)), default=math.nan) for k, v in values.items()
                },
                "num_errors": sum(len(s.errors) for s in mine),
                "num_noisy": sum(1 for s in mine if s.metrics.get("cpu_foreign", 0.0) > max_noise),
                "num_discarded": sum(s.num_discarded for s in mine),
                "notes": [note for s in mine for note in s.notes],
                "idle_cpu_of_others_max": max(
                    (max(s.idle_cpu_of_others.values(), default=0.0) for s in mine), default=0.0
                ),
            }
    return table


def fmt(x: float, spec: str = "7.1f") -> str:
    return format(x, spec) if not math.isnan(x) else "n/a".rjust(len(format(0.0, spec)))


def paired_ratio(samples: list[Sample], a: str, b: str, n: int, key: str) -> float:
    """Median over rounds of key(a) / key(b) within the same round: both ran back to back, so a
    noisy minute hits both sides of a pair."""
    by_round = {(s.target, s.round): s.metrics.get(key, math.nan) for s in samples if s.concurrency == n}
    rounds = sorted({s.round for s in samples})
    return median(
        [by_round[a, r] / by_round[b, r] for r in rounds if (a, r) in by_round and (b, r) in by_round]
    )


def ratio_line(
    table: dict[str, Any], samples: list[Sample], workload: Workload, a: str, b: str, n: int
) -> str:
    ma, mb = table[a][n]["median"], table[b][n]["median"]
    titles = {c.key: c.title for c in workload.columns}
    parts = []
    for g in workload.goals:
        if not g.per_target:
            r = ma.get(g.key, math.nan) / mb.get(g.key, math.nan)
            parts.append(f"{g.label} {r:.3f}x ({g.text(r)}; "
                         f"paired per round {paired_ratio(samples, a, b, n, g.key):.3f}x)")
    parts += [f"{titles.get(k, k)} {ma.get(k, math.nan) / mb.get(k, math.nan):.2f}x" for k in workload.ratios]
    return f"{'':>3}  {a}/{b}: " + ", ".join(parts)


def schema_line(table: dict[str, Any], samples: list[Sample], constrained: str, plain: str, n: int) -> str:
    """--json-schema: one server's constrained figures against its plain ones."""
    mc, mp = table[constrained][n]["median"], table[plain][n]["median"]
    r = mc.get("tok_s", math.nan) / mp.get("tok_s", math.nan)
    goal = Goal("tok_s", "tok/s", ">=", TARGET_SCHEMA_RATIO)
    ttft = mc.get("ttft_p50_ms", math.nan) / mp.get("ttft_p50_ms", math.nan)
    return (
        f"{'':>3}  {constrained}/{plain}: tok/s {r:.3f}x ({goal.text(r)}; paired per round "
        f"{paired_ratio(samples, constrained, plain, n, 'tok_s'):.3f}x), TTFT p50 {ttft:.2f}x, tokens per "
        f"request {mc.get('num_tokens', math.nan) / n:.1f} vs {mp.get('num_tokens', math.nan) / n:.1f}"
    )


def target_names(servers: list[Server], args: argparse.Namespace) -> list[str]:
    """Every target's name, in run order: with --json-schema each server's plain one, then its +schema one."""
    names = [s.name for s in servers]
    return [x for name in names for x in (name, name + SCHEMA_SUFFIX)] if args.schema is not None else names


def scaling_line(table: dict[str, Any], names: list[str]) -> str:
    parts = []
    for name in names:
        scale = table[name][8]["median"]["tok_s"] / table[name][1]["median"]["tok_s"]
        parts.append(
            f"{name} {scale:.2f}x" + ("" if scale >= TARGET_SCALING else f" (BELOW {TARGET_SCALING}x)")
        )
    return "scaling tok/s at N=8 vs N=1: " + ", ".join(parts)


def print_report(table: dict[str, Any], samples: list[Sample], names: list[str], args: argparse.Namespace,
                 header: list[str]) -> None:
    workload = WORKLOADS[args.workload]
    cells = workload.cells(args)
    columns = (*workload.columns, *CPU_COLUMNS)
    width = max(14, *(len(n) for n in names))
    print()
    print("\n".join(header))
    print()
    print(f"{'N':>3}  {'target':<{width}} " + "  ".join(
        c.title.rjust(c.width) + ("[min - max]".rjust(2 * c.width + 7) if c.span else "") for c in columns))
    for n in cells:
        for name in names:
            row = table[name][n]
            m, lo, hi = row["median"], row["min"], row["max"]
            figures = "  ".join(
                fmt(m.get(c.key, math.nan), c.spec).rjust(c.width)
                + (f"  [{fmt(lo.get(c.key, math.nan), c.spec)} - {fmt(hi.get(c.key, math.nan), c.spec)}]"
                   if c.span else "")
                for c in columns)
            tail = "".join(
                f"  {g.label}: {g.text(m.get(g.key, math.nan))}" for g in workload.goals if g.per_target
            )
            if row["num_errors"]:
                tail += f"  {row['num_errors']} errors"
            if row["num_noisy"]:
                tail += f"  {row['num_noisy']} noisy rounds kept"
            print(f"{n:>3}  {name:<{width}} {figures}{tail}")
        plain = names[::2] if args.schema is not None else names
        if len(plain) >= 2:
            print(ratio_line(table, samples, workload, plain[0], plain[1], n))
        if args.schema is not None:
            for name in plain:
                print(schema_line(table, samples, name + SCHEMA_SUFFIX, name, n))
            if len(plain) >= 2:
                print(
                    ratio_line(
                        table, samples, workload, plain[0] + SCHEMA_SUFFIX, plain[1] + SCHEMA_SUFFIX, n
                    )
                )
        print()
    if args.workload == "throughput" and 1 in cells and 8 in cells:
        print(scaling_line(table, names))
    print(workload.legend)
    print("Each figure is the median over rounds of the burst's or round's value. CPUs: used by the target; "
          "noise: CPUs used meanwhile by other processes on the machine (medians).")
    print("Reading ratios: two identical llama-servers (--targets llama-server,llama-server, the harness "
          "self-check) read 0.81x to 1.08x in tok/s at N=4\non this 2-core VM (four runs, 2026-11-26, one "
          "of them 12 rounds in 4 fresh process pairs): ratios inside that band are noise. p99s and TTFTs "
          "vary more;\nrun that self-check with this --workload and --restarts to see its floor.")
    discarded = sum(s.num_discarded for s in samples)
    if discarded:
        print(f"{discarded} attempts were rerun (other processes used the CPUs meanwhile, or see the notes).")
    for s in samples:
        for note in s.notes:
            print(f"note: round {s.round + 1} {s.target}: {note}")
    for name in names:
        idle = max(table[name][n]["idle_cpu_of_others_max"] for n in cells)
        if idle > 0.05:
            print(f"WARNING: while {name} ran, another (idle) target used up to {idle:.2f} CPUs")


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_schema(spec: str) -> dict[str, Any]:
    if spec == "builtin":
        return BUILTIN_SCHEMA
    schema = json.loads(Path(spec).read_text())
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema is an object")
    return schema


def default_ctx_size(args: argparse.Namespace) -> int:
    if args.workload == "shared-prefix":
        return 16384
    if args.workload == "long-prompt":
        return int(args.parallel) * (
            int(args.long_prompt_tokens) + 512
        )  # every slot has room for the long prompt
    return 4096


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=list(WORKLOADS), default="throughput")
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument(
        "--targets",
        default="ours,llama-server",
        help="comma list of ours | llama-server | a NAME given in --url, each optionally followed by "
        "':' and its own flags (\"llama-server:-fa off\"); the ratio is first/second",
    )
    p.add_argument("--url", action="append", default=[], metavar="NAME=URL",
                   help="benchmark an already running OpenAI-compatible server under NAME")
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: third_party build)")
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--ctx-size", type=int, default=None,
                   help="total KV cells, same for every target (default: 4096; shared-prefix 16384; "
                        "long-prompt parallel x (long prompt + 512))")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads for both servers (0: each server's own default)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="2 rounds (a smoke run, not a measurement)")
    p.add_argument(
        "--restarts", type=int, default=1,
        help="start fresh server processes this many times, --rounds rounds each (the start order "
        "alternates). On this VM one process can run ~20%% slower or faster than an identical one for "
        "its whole life, which rounds within one process do not average out (the self-check "
        "llama-server,llama-server read 0.81x in one run and 1.06x in the next)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens per request (default: 64; shared-prefix 16; long-prompt: the decoders' "
                        "count, sized from the measured speed)")
    p.add_argument("--prompt-tokens", type=lambda s: tuple(int(x) for x in s.split("-")), default=(32, 64),
                   metavar="MIN-MAX", help="short prompts (throughput, overload, long-prompt's decoders)")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16],
                   help="throughput: burst sizes")
    p.add_argument("--prefix-tokens", type=int, default=1000, help="shared-prefix: the common prefix")
    p.add_argument("--suffix-tokens", type=int, default=16, help="shared-prefix: each request's own suffix")
    p.add_argument(
        "--long-prompt-tokens",
        type=int,
        default=8000,
        help=(
            "long-prompt: the long prompt (8000: it and its answer fit the small model's "
            "8192-token training context, the most llama-server gives a slot)"
        ),
    )
    p.add_argument("--window-seconds", type=float, default=20.0,
                   help="long-prompt: the decoders' gaps are measured for this long after the long prompt is "
                        "sent (or until its first token); then they hang up, so a slow, budgeted prefill is "
                        "not compared with steady gaps of much shorter contexts")
    p.add_argument("--steady-seconds", type=float, default=1.5,
                   help="long-prompt: the decoders' steady window before the long prompt is sent")
    p.add_argument("--kv-unified", action="store_true",
                   help="one KV cache shared by all slots on both sides (default: each side's default, a KV "
                        "stream of ctx/parallel cells per slot)")
    p.add_argument("--worker-arg", action="append", default=[], help="extra argument for our worker")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for llama-server")
    p.add_argument(
        "--quiet-below",
        type=float,
        default=0.3,
        metavar="CPUS",
        help="before each burst or round wait until other processes use at most this many CPUs ...",
    )
    p.add_argument(
        "--quiet-wait", type=float, default=10.0, metavar="SECONDS", help="... but at most this long"
    )
    p.add_argument("--max-noise", type=float, default=0.25, metavar="CPUS",
                   help="an attempt during which other processes used more CPUs is discarded and rerun ...")
    p.add_argument("--retries", type=int, default=4, help="... at most this many times (then kept)")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument(
        "--json", type=Path, default=None, help="write config, every burst/round and the summary here"
    )
    p.add_argument(
        "--json-schema",
        default=None,
        metavar="PATH|builtin",
        help="throughput: also run every target as TARGET+schema, its requests constrained by this JSON "
        "schema (a file, or builtin), and show the constrained/plain ratio",
    )
    p.add_argument(
        "--schema-field",
        choices=("json_schema", "response_format"),
        default="json_schema",
        help="how --json-schema is sent: top-level json_schema (llama-server's /v1/completions honours "
        "only that) or OpenAI's response_format {type: json_schema}",
    )
    args = p.parse_args(argv)
    args.schema = None
    if args.json_schema is not None:
        if args.workload != "throughput":
            p.error("--json-schema: the throughput workload only")
        try:
            args.schema = load_schema(args.json_schema)
        except (OSError, ValueError) as e:
            p.error(f"--json-schema {args.json_schema}: {e}")
    if args.quick:
        args.rounds = 2
    if args.ctx_size is None:
        args.ctx_size = default_ctx_size(args)
    if args.max_tokens is None and args.workload != "long-prompt":
        args.max_tokens = 16 if args.workload == "shared-prefix" else 64
    if args.workload == "long-prompt":
        if args.parallel < 2:
            p.error("long-prompt needs --parallel >= 2 (parallel - 1 decoders and the long prompt)")
        if args.max_tokens is not None and args.max_tokens <= WARM_TOKENS:
            p.error(f"long-prompt: --max-tokens must exceed {WARM_TOKENS} (tokens before the steady window)")
        if slot_room(args, args.parallel - 1) <= WARM_TOKENS:
            p.error(f"long-prompt: --ctx-size {args.ctx_size} leaves the decoders no room")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.model.exists():
        raise SystemExit(
            f"model {args.model} not found (make it: .venv/bin/python -m worker.testing.tiny_models "
            "--out models --size small)"
        )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = ROOT / "bench" / "results" / f"worker-{stamp}"
    servers, notes = build_targets(args, log_dir)
    vocab = normal_token_ids(args.model)
    # SIGTERM (`timeout`, a CI cancel) unwinds like Ctrl-C, through the `finally` that stops the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    kv = "one unified KV cache" if args.kv_unified else f"{args.ctx_size // args.parallel} cells per slot"
    header = [
        f"model {args.model} | {args.parallel} slots | ctx {args.ctx_size} ({kv}) | threads "
        f"{args.threads or 'server default'} | {args.rounds} rounds"
        + (f" x {args.restarts} restarts" if args.restarts > 1 else "") + " | ignore_eos, temperature 0",
        describe_workload(args),
        *notes,
        f"logs: {log_dir}",
        "load average at start: "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
        + f" ({os.cpu_count()} CPUs)",
    ]
    samples: list[Sample] = []
    try:
        for k in range(args.restarts):  # fresh processes, started in alternating order
            if k:
                for s in servers:
                    s.stop()
            for s in servers if k % 2 == 0 else list(reversed(servers)):
                log(f"starting {s.name}: {' '.join(s.cmd) if s.cmd else s.base_url}")
                t0 = time.monotonic()
                s.start(args.start_timeout)
                log(f"{s.name} healthy after {time.monotonic() - t0:.1f}s")
            samples += asyncio.run(run(args, servers, vocab, first_round=k * args.rounds))
    except ServerStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        for s in servers:
            s.stop()
    names = target_names(servers, args)
    table = summarize(samples, names, WORKLOADS[args.workload].cells(args), args.max_noise)
    print_report(table, samples, names, args, header)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "header": header, "samples": [asdict(s) for s in samples],
            "summary": {name: {str(n): row for n, row in rows.items()} for name, rows in table.items()},
        }, indent=2))
        log(f"wrote {args.json}")
    return 1 if any(s.errors for s in samples) else 0


if __name__ == "__main__":
    sys.exit(main())
