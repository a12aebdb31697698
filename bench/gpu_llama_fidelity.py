"""Greedy fidelity of the llama.cpp worker with layers offloaded to a GPU (or on the CPU).

    python -m bench.gpu_llama_fidelity --model SmolLM2-135M-Instruct.Q4_1.gguf --ngl 99

The same check as tests/realmodel/test_fidelity.py, for a machine with a GPU: 8 chat prompts x
64 greedy tokens (`ignore_eos`), through our worker one at a time and all 8 at once over its
4 slots, against llama-cpp-python's own `Llama` one prompt at a time on the same offload. It
prints how many answers differ between each pair and where the first one parts; it asserts
nothing (CUDA kernels are not batch-invariant in general: this says whether ours are).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

from bench.common import free_port
from tests.realmodel.test_fidelity import QUESTIONS  # the same 8 chat prompts as the CPU test


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def compare(name: str, got: list[list[int]], want: list[list[int]]) -> None:
    diffs = [first_diff(g, w) for g, w in zip(got, want, strict=True)]
    parted = [d for d in diffs if d is not None]
    where = f" (first parts at tokens {parted})" if parted else ""
    print(f"{name}: {len(parted)} of {len(got)} differ{where}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--ngl", default="99")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--threads", type=int, default=4)
    args = ap.parse_args()

    port = free_port()
    cmd = [sys.executable, "-m", "worker.server.cli", "--model", str(args.model), "--port", str(port),
           "--host", "127.0.0.1", "--parallel", str(args.parallel), "--ctx-size", "4096",
           "--threads", str(args.threads), "-ngl", args.ngl]
    print("worker:", " ".join(cmd[3:]))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=300) as c:
            for _ in range(600):
                try:
                    if c.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.2)
            else:
                raise SystemExit("worker did not become healthy")
            prompts = []
            for q in QUESTIONS:
                messages = [{"role": "user", "content": q}]
                text = c.post("/apply-template", json={"messages": messages}).json()["prompt"]
                prompts.append(c.post("/tokenize", json={"content": text, "add_special": True,
                                                         "parse_special": True}).json()["tokens"])

        def one(prompt: list[int]) -> list[int]:
            with httpx.Client(base_url=base, timeout=300) as c:
                r = c.post("/completion", json={"prompt": prompt, "n_predict": args.tokens, "temperature": 0,
                                                "ignore_eos": True, "return_tokens": True,
                                                "cache_prompt": False})
                r.raise_for_status()
                return list(r.json()["tokens"])

        t0 = time.perf_counter()
        alone = [one(p) for p in prompts]
        t_alone = time.perf_counter() - t0
        t0 = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            together = list(pool.map(one, prompts))
        t_together = time.perf_counter() - t0
        print(f"ours: one at a time {t_alone:.2f} s, {len(prompts)} at once {t_together:.2f} s")
    finally:
        proc.terminate()
        proc.wait(30)

    from llama_cpp import Llama

    ngl = -1 if args.ngl in ("99", "all", "-1") else int(args.ngl)
    llm = Llama(str(args.model), n_ctx=1024, n_batch=512, n_gpu_layers=ngl, flash_attn=True, verbose=False)
    import llama_cpp

    eog = [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(llm._model.vocab, t)]
    reference = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        out: list[int] = []
        for _ in range(args.tokens):
            logits = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).copy()
            logits[eog] = -np.inf
            out.append(int(np.argmax(logits)))
            llm.eval([out[-1]])
        reference.append(out)
    llm.close()

    compare("ours alone vs ours 8 at once", alone, together)
    compare("ours alone vs Llama unbatched", alone, reference)
    compare("ours 8 at once vs Llama unbatched", together, reference)


if __name__ == "__main__":
    main()
