"""Aggregate decode throughput: our worker (torch backend, HTTP) vs transformers' `generate()`.

For each concurrency C, C distinct prompts (~`--prompt-words` words) are sent at once as
/v1/completions requests (greedy, ignore_eos, max_tokens N) to one `omni-worker --backend torch`
with `--parallel max(C)`; tokens/s = completion tokens / wall time of the whole wave. The
transformers side runs the same prompts (same token ids, left-padded) as one batched
`generate(do_sample=False, min_new_tokens=N, max_new_tokens=N)`. Both include prefill; both
get one short untimed warm-up wave at each concurrency, then the two sides alternate for
`--repeats` timed waves each and the best is kept (the CPU is shared with other work). Also
printed: tokens per CPU-second of each side, which other load on the machine barely moves.

    .venv/bin/python bench/bench_torch.py [--model models/small-llama] [--concurrency 1,4,8,16]
        [--max-tokens 64] [--threads N] [--dtype float32] [--skip-hf]

`--threads` sets OMP_NUM_THREADS for the worker and torch.set_num_threads here (same for both).

    .venv/bin/python bench/bench_torch.py --step [--step-contexts 64,1000,4000] [--step-rows 8]

Step mode (in-process, no HTTP): the median time of one decode step over `--step-rows`
sequences that each hold C cells, on the fused CPU kernels and as plain torch ops, side by
side. The cells are claimed directly in the KV cache (no prefill; their contents do not change
the timing).

    .venv/bin/python bench/bench_torch.py --prefill [--prefill-tokens 1000]

Prefill mode (in-process): the median time of one decode of an N-token prompt as one piece,
fused kernels (every row through the attention kernel) vs torch ops (SDPA).

    .venv/bin/python bench/bench_torch.py --gpu

GPU mode (CUDA only): a random ~1.2B Llama (Llama-3.2-1B shapes) in bfloat16 straight through
the backend with CUDA graphs: decode tokens/s at batch 1 and 32, and the fraction of HBM
bandwidth reached at batch 1 (weight bytes x tokens/s / `--hbm-tbps`, 4.8 TB/s for an H200).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.util import free_port, stop_process, wait_until  # noqa: E402  # after the sys.path insert above

WORDS = [
    "the",
    "model",
    "router",
    "worker",
    "slot",
    "batch",
    "stream",
    "server",
    "request",
    "cache",
    "prompt",
    "context",
    "memory",
    "thread",
    "engine",
    "sample",
    "logits",
    "kernel",
    "tensor",
    "layer",
    "weight",
    "python",
    "llama",
    "vector",
    "queue",
    "event",
    "health",
    "sleep",
    "wake",
    "load",
]


def prompts(n: int, n_words: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(n_words)) for i in range(n)]


def run_worker_wave(url: str, texts: list[str], max_tokens: int) -> tuple[int, float]:
    def one(text: str) -> int:
        body = {
            "prompt": text,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        total = sum(pool.map(one, texts))
    return total, time.perf_counter() - t0


@contextlib.contextmanager
def worker_url(args: argparse.Namespace, n_slots: int) -> Iterator[tuple[str, int]]:
    """A torch-backend worker; yields (url, pid)."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [
        sys.executable,
        "-m",
        "worker.server.cli",
        "--model",
        args.model,
        "--backend",
        "torch",
        "--port",
        str(port),
        "--parallel",
        str(n_slots),
        "--ctx-size",
        str(args.ctx_size),
        "--dtype",
        args.dtype,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: httpx.get(url + "/health", timeout=2).status_code == 200, timeout=300, what="worker"
        )
        yield url, proc.pid
    finally:
        stop_process(proc)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads)."""
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


def transformers_wave_fn(args: argparse.Namespace) -> Callable[[list[str], int], float]:
    """Load the model in this process; return wave(texts, n_new) -> seconds of one batched generate()."""
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()  # type: ignore[no-untyped-call]
    tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0

    def wave(texts: list[str], n_new: int) -> float:
        ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
        width = max(len(x) for x in ids)
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(
                input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=n_new,
                min_new_tokens=n_new, pad_token_id=pad,
            )
        return time.perf_counter() - t0

    return wave


@dataclass
class Side:
    """Best wall-clock rate and best rate per CPU-second over the timed waves of one side."""

    wall: float = 0.0
    per_cpu: float = 0.0

    def add(self, tokens: int, wall_s: float, cpu_s: float) -> None:
        self.wall = max(self.wall, tokens / wall_s)
        self.per_cpu = max(self.per_cpu, tokens / max(cpu_s, 1e-9))


def bench_cpu(args: argparse.Namespace, levels: list[int]) -> None:
    """Ours and theirs alternate wave by wave (best of --repeats each), so load spikes from
    other processes on a shared machine hit both sides alike. Tokens per CPU-second (the worker
    process's CPU time; this process's for transformers) is the contention-proof figure."""
    hf_wave = None if args.skip_hf else transformers_wave_fn(args)
    ours = {c: Side() for c in levels}
    theirs = {c: Side() for c in levels}
    with worker_url(args, max(levels)) as (url, pid):
        for c in levels:
            texts = prompts(c, args.prompt_words)
            run_worker_wave(url, texts, 4)  # warm-up at this batch shape, both sides
            if hf_wave is not None:
                hf_wave(texts, 4)
            for _ in range(args.repeats):
                cpu0 = cpu_seconds(pid)
                n, dt = run_worker_wave(url, texts, args.max_tokens)
                ours[c].add(n, dt, cpu_seconds(pid) - cpu0)
                if hf_wave is not None:
                    cpu0 = time.process_time()
                    dt = hf_wave(texts, args.max_tokens)
                    theirs[c].add(c * args.max_tokens, dt, time.process_time() - cpu0)
            print(f"  C={c}: ours {ours[c]}, transformers {theirs[c]}", file=sys.stderr)
    print(
        f"\nmodel {args.model}, {args.max_tokens} new tokens/request, "
        f"dtype {args.dtype}, threads {args.threads}"
    )
    print(f"{'':>10} | {'tokens/s (wall)':^34} | {'tokens per CPU-second':^34}")
    print(f"{'concurrent':>10} | {'omni-worker':>11} {'transformers':>12} {'ratio':>8} | "
          f"{'omni-worker':>11} {'transformers':>12} {'ratio':>8}")
    for c in levels:
        o, t = ours[c], theirs[c]
        print(f"{c:>10} | {o.wall:>11.1f} {t.wall:>12.1f} {_ratio(o.wall, t.wall):>8} | "
              f"{o.per_cpu:>11.1f} {t.per_cpu:>12.1f} {_ratio(o.per_cpu, t.per_cpu):>8}")


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


GPU_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "tie_word_embeddings": True,
    "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "bfloat16",
}


def write_random_llama(out: Path) -> None:
    """A random bf16 checkpoint of GPU_CONFIG's shapes (tokenizer borrowed from the tiny model)."""
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    c = GPU_CONFIG
    h, i, kv = (
        int(c["hidden_size"]),
        int(c["intermediate_size"]),
        int(c["num_key_value_heads"]) * int(c["head_dim"]),
    )
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": rnd(int(c["vocab_size"]), h),
        "model.norm.weight": torch.ones(h).bfloat16(),
    }
    for n in range(int(c["num_hidden_layers"])):
        pre = f"model.layers.{n}."
        tensors |= {
            pre + "self_attn.q_proj.weight": rnd(h, h), pre + "self_attn.k_proj.weight": rnd(kv, h),
            pre + "self_attn.v_proj.weight": rnd(kv, h), pre + "self_attn.o_proj.weight": rnd(h, h),
            pre + "mlp.gate_proj.weight": rnd(i, h), pre + "mlp.up_proj.weight": rnd(i, h),
            pre + "mlp.down_proj.weight": rnd(h, i),
            pre + "input_layernorm.weight": torch.ones(h).bfloat16(),
            pre + "post_attention_layernorm.weight": torch.ones(h).bfloat16(),
        }
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(c))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "models" / "tiny-llama" / name, out / name)


def bench_gpu(args: argparse.Namespace) -> None:
    import tempfile

    import torch

    from worker.backends.base import BatchEntry, SampleItem
    from worker.backends.torch_backend import TorchBackend
    from worker.protocol.sampling import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        write_random_llama(Path(tmp))
        backend = TorchBackend(
            tmp,
            n_ctx=8192,
            n_slots=32,
            kv_unified=True,
            n_batch=2048,
            device="cuda",
            dtype="bf16",
            compile=True,
        )
    weight_bytes = backend.meta.size_bytes
    greedy = SamplingParams(temperature=0.0)
    print(f"1.2B random Llama, bf16, {weight_bytes / 1e9:.2f} GB of weights, CUDA graphs on")
    for bs in (1, 32):
        for s in range(32):
            backend.seq_rm(s, 0)
        samplers = [backend.new_sampler(greedy, s) for s in range(bs)]
        backend.decode([BatchEntry(s, list(range(3, 35)), 0, True) for s in range(bs)])
        toks = [
            x.token for x in backend.sample([SampleItem(samplers[s], s) for s in range(bs)], [greedy] * bs)
        ]
        steps, pos = 128, 32
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            backend.decode([BatchEntry(s, [toks[s]], pos, True) for s in range(bs)])
            toks = [
                x.token
                for x in backend.sample([SampleItem(samplers[s], s) for s in range(bs)], [greedy] * bs)
            ]
            pos += 1
        torch.cuda.synchronize()
        tps = bs * steps / (time.perf_counter() - t0)
        line = f"  batch {bs:>2}: {tps:8.1f} tokens/s"
        if bs == 1:
            line += f", HBM {weight_bytes * tps / (args.hbm_tbps * 1e12):.0%} of {args.hbm_tbps} TB/s"
        print(line)


def bench_steps(args: argparse.Namespace) -> None:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # as the worker sets it (worker/backends)
    import numpy as np
    import torch

    from worker.backends.base import BatchEntry
    from worker.backends.torch_backend import TorchBackend

    rows, n_steps = args.step_rows, 24
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"decode step over {rows} sequences, {Path(args.model).name}, {args.dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    print("cells/seq | fused kernels ms | torch ops ms | ratio")
    for ctx in (int(x) for x in args.step_contexts.split(",")):
        medians = []
        for kernels in (True, False):
            backend = TorchBackend(
                args.model, n_ctx=rows * (ctx + n_steps), n_slots=rows, kv_unified=True, n_batch=512,
                dtype=args.dtype, cpu_kernels=kernels,
            )
            kv = backend._require_kv()
            for s in range(rows):
                kv.claim(s, ctx)
            times = []
            for i in range(n_steps):
                t0 = time.perf_counter()
                backend.decode([BatchEntry(s, [7], ctx + i, True) for s in range(rows)])
                times.append(time.perf_counter() - t0)
            medians.append(float(np.median(times[4:])) * 1e3)
            backend.close()
        print(f"{ctx:>9} | {medians[0]:16.1f} | {medians[1]:12.1f} | {medians[1] / medians[0]:5.2f}x")


def bench_prefill(args: argparse.Namespace) -> None:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    import numpy as np
    import torch

    from worker.backends.base import BatchEntry
    from worker.backends.torch_backend import TorchBackend

    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.prefill_tokens
    prompt = np.random.default_rng(0).integers(3, 1000, n).tolist()
    print(
        f"prefill of {n} tokens in one piece, {Path(args.model).name}, {args.dtype}, "
        f"{torch.get_num_threads()} threads"
    )
    medians = []
    for kernels in (True, False):
        backend = TorchBackend(
            args.model, n_ctx=n, n_slots=1, n_batch=n, dtype=args.dtype, cpu_kernels=kernels
        )
        times = []
        for _ in range(5):
            backend.seq_rm(0, 0)
            t0 = time.perf_counter()
            backend.decode([BatchEntry(0, prompt, 0, True)])
            times.append(time.perf_counter() - t0)
        medians.append(float(np.median(times[1:])) * 1e3)
        backend.close()
    print(
        f"fused kernels {medians[0]:.0f} ms | torch ops (SDPA) {medians[1]:.0f} ms | "
        f"ratio {medians[1] / medians[0]:.2f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "small-llama"))
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=24)
    ap.add_argument("--ctx-size", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=2, help="timed waves per side and level (best kept)")
    ap.add_argument("--gpu", action="store_true", help="CUDA decode benchmark of a random 1.2B Llama")
    ap.add_argument(
        "--step", action="store_true", help="in-process decode step: fused CPU kernels vs torch ops"
    )
    ap.add_argument("--step-contexts", default="64,1000,4000")
    ap.add_argument("--step-rows", type=int, default=8)
    ap.add_argument("--prefill", action="store_true", help="in-process prompt prefill: fused kernels vs SDPA")
    ap.add_argument("--prefill-tokens", type=int, default=1000)
    ap.add_argument("--hbm-tbps", type=float, default=4.8)
    args = ap.parse_args()
    if args.gpu:
        bench_gpu(args)
        return
    if args.step:
        bench_steps(args)
        return
    if args.prefill:
        bench_prefill(args)
        return
    levels = [int(x) for x in args.concurrency.split(",")]

    bench_cpu(args, levels)


if __name__ == "__main__":
    main()
