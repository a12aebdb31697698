"""The engine thread's time outside the forward pass, per step: what a GPU step cannot hide.

    .venv/bin/python -m bench.step_overhead [--model M.gguf] [--backend llama_cpp|torch]
        [--plain 1,8,64] [--spec 1,8] [--k 4,16] [--tokens 64] [--threads 2] [-ngl 99] [--profile]

In process, no HTTP: the engine (worker/engine/engine.py) on the real model, with its step and the
backend's `decode` timed by wrappers. For each N, N greedy requests of `--tokens` tokens
(`ignore_eos`) go in at once; the steps where all N generate are kept (prompt steps are not the
figure). Printed per configuration: the median step, the median decode inside it, and the rest
(scheduling, sampling, detokenizing, events, drafting and verifying), in ms and as a share.

Speculative steps (`--spec` N values, `--k` draft lengths): the same with n-gram speculation on
every request (`speculative.n_max = K`, the request's own n_max drafts regardless of the measured
gate), on a prompt that repeats, so that drafts are found; kept are the steps that verified a
draft. On a GPU a decode of a 135M model is ~1.2 ms: the rest is what decides the speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.common import ROOT

MODEL = ROOT / "models" / "smollm2-135m-instruct-q4_1.gguf"


class _Timed:
    """Wraps the engine's `_step` and the backend's `decode`: one record per step that decoded."""

    def __init__(self, engine: Any, profile: bool = False) -> None:
        import cProfile

        self.profiler = cProfile.Profile() if profile else None
        self.records: list[tuple[float, float, int, int]] = []  # step s, decode s, rows, verify rows
        self._decode_s = 0.0
        self._entries: list[list[Any]] = []
        backend = engine._require_backend()
        step, decode = engine._step, backend.decode

        def timed_decode(entries: list[Any]) -> Any:
            t0 = time.perf_counter()
            try:
                return decode(entries)
            finally:
                self._decode_s += time.perf_counter() - t0
                self._entries.append(entries)  # counted after the step's clock stops

        def timed_step() -> None:
            self._decode_s, self._entries = 0.0, []
            if self.profiler is not None:
                self.profiler.enable()
            t0 = time.perf_counter()
            step()
            step_s = time.perf_counter() - t0
            if self.profiler is not None:
                self.profiler.disable()
            if self._entries:
                rows = sum(len(e.tokens) for entries in self._entries for e in entries)
                verify = sum(e.n_outputs - 1 for entries in self._entries for e in entries if e.n_outputs > 1)
                self.records.append((step_s, self._decode_s, rows, verify))

        backend.decode = timed_decode
        engine._step = timed_step


def _run(engine: Any, prompts: list[list[int]], tokens: int, k: int) -> None:
    from worker.engine.task import ErrorEvent, Event, FinishEvent, Task
    from worker.protocol.sampling import SamplingParams, SpecRequest

    spec = SpecRequest(n_max=k, size_n=3) if k else None
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, speculative=spec)
    done = [threading.Event() for _ in prompts]

    def emitter(i: int) -> Callable[[Event], None]:
        def emit(ev: Event) -> None:
            if isinstance(ev, FinishEvent | ErrorEvent):
                done[i].set()

        return emit

    engine.submit_many([Task(p, params, 1, emitter(i)) for i, p in enumerate(prompts)])
    for d in done:
        d.wait(600)


def _prompts(tokenize: Callable[[str, bool, bool], list[int]], n: int, repeat: bool) -> list[list[int]]:
    text = ("The quick brown fox jumps over the lazy dog. " * 6) if repeat else "Tell me a long story about"
    return [tokenize(f"{i}: {text}", True, False) for i in range(n)]


def _report(name: str, records: list[tuple[float, float, int, int]]) -> None:
    if not records:
        print(f"{name:<28} no steps kept")
        return
    step = statistics.median(r[0] for r in records) * 1e3
    decode = statistics.median(r[1] for r in records) * 1e3
    rest = statistics.median(r[0] - r[1] for r in records) * 1e3
    rows = statistics.median(r[2] for r in records)
    print(f"{name:<28} steps {len(records):5d}  rows {rows:5.0f}  step {step:8.2f} ms  "
          f"decode {decode:8.2f} ms  outside decode {rest:6.2f} ms ({rest / step:5.1%})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(MODEL))
    ap.add_argument("--backend", default="llama_cpp", choices=("llama_cpp", "torch"))
    ap.add_argument("--plain", default="1,8,64")
    ap.add_argument("--spec", default="1,8")
    ap.add_argument("--k", default="4,16")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="torch's device")
    ap.add_argument("--n-gpu-layers", "-ngl", type=int, default=None, help="llama.cpp's layers on the GPU")
    ap.add_argument("--profile", action="store_true", help="cProfile the engine's steps: top functions")
    args = ap.parse_args(argv)
    plain = [int(x) for x in args.plain.split(",") if x]
    spec_n = [int(x) for x in args.spec.split(",") if x]
    ks = [int(x) for x in args.k.split(",") if x]

    from worker.backends import BackendOptions, load_backend
    from worker.engine.engine import Engine
    from worker.engine.metrics import WorkerMetrics
    from worker.engine.speculation import SpecConfig

    n_slots = max(plain + spec_n)
    options = BackendOptions(n_ctx=n_slots * 512, n_slots=n_slots, threads=args.threads,
                             **({"device": args.device} if args.backend == "torch" else
                                {"n_gpu_layers": args.n_gpu_layers}))
    engine = Engine(lambda progress: load_backend(args.backend, args.model, options, progress),  # type: ignore[arg-type]  # one of the Literal values
                    n_slots, WorkerMetrics(), spec=SpecConfig("ngram-simple", size_n=3, size_m=16,
                                                              max_generating=n_slots))
    engine.start()
    try:
        while not engine.status.is_ready:
            if engine.status.error is not None:
                raise SystemExit(f"load failed: {engine.status.error}")
            time.sleep(0.1)
        backend = engine._require_backend()
        timed = _Timed(engine, args.profile)
        print(f"{args.model} on {args.backend} ({args.device}), --threads {args.threads}, "
              f"{args.tokens} tokens")
        _run(engine, _prompts(backend.tokenize, 1, False), 8, 0)  # warm-up
        for n in plain:
            timed.records.clear()
            _run(engine, _prompts(backend.tokenize, n, False), args.tokens, 0)
            _report(f"plain N={n}", [r for r in timed.records if r[2] == n])
        for n in spec_n:
            for k in ks:
                timed.records.clear()
                _run(engine, _prompts(backend.tokenize, n, True), args.tokens, k)
                _report(f"speculative N={n} K={k}", [r for r in timed.records if r[3] > 0])
        if timed.profiler is not None:
            import pstats

            pstats.Stats(timed.profiler).sort_stats("tottime").print_stats(25)
        return 0
    finally:
        engine.stop()


if __name__ == "__main__":
    sys.exit(main())
