"""Our forward pass against transformers' own, float32 on CPU (tolerance 1e-4)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.torch_backend.conftest import FAMILIES, HFModel
from worker.backends.base import BatchEntry, DecodeStatus
from worker.backends.torch_backend import TorchBackend
from worker.testing.tiny_models import ModelPaths
from worker.torch_model.model import can_prepack

TOL = 1e-4


def hf_logits(model: HFModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def random_tokens(n: int, seed: int, vocab: int = 1024) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def new_backend(
    path: Path, n_ctx: int = 256, n_slots: int = 4, kernels: bool = True, dtype: str | None = None,
    kv_unified: bool = False,
) -> TorchBackend:
    backend = TorchBackend(
        str(path),
        n_ctx=n_ctx,
        n_slots=n_slots,
        kv_unified=kv_unified,
        n_batch=128,
        device="cpu",
        dtype=dtype,
        cpu_kernels=kernels,
    )
    # The fused CPU kernels must really build here (CI has a C compiler), or half of the
    # parametrized tests below would silently test the fallback twice.
    assert (backend._require_model().kernels is not None) is kernels
    return backend


KERNELS = pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])


@KERNELS
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_prompt_logits_match_transformers(
    kind: str, kernels: bool, hf_family: Callable[[str], tuple[Path, HFModel]]
) -> None:
    path, hf = hf_family(kind)
    prompt = random_tokens(30, seed=1)
    backend = new_backend(path, kernels=kernels)
    assert backend.decode([BatchEntry(0, prompt, 0, True)]) is DecodeStatus.OK
    torch.testing.assert_close(backend._logits[0], hf_logits(hf, prompt)[-1], atol=TOL, rtol=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_prepacked_weights_match_plain_linear(
    dtype: str, hf_family: Callable[[str], tuple[Path, HFModel]]
) -> None:
    """The parity tests above run prepacked (the CPU default); plain F.linear must agree."""
    if not can_prepack(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"oneDNN has no {dtype} matmul on this CPU")
    path, _ = hf_family("qwen2")  # has a q/k/v bias: the packed kernel's bias path too
    prompt = random_tokens(30, seed=3)
    logits = []
    for prepack in (True, False):
        backend = TorchBackend(
            str(path), n_ctx=256, n_slots=4, n_batch=128, device="cpu", dtype=dtype, prepack=prepack
        )
        model = backend._require_model()
        assert model.prepacked is prepack
        assert all(w.is_mkldnn is prepack for layer in model.layers for w in layer.w.values())
        assert (
            backend.decode([BatchEntry(0, prompt[:20], 0, True), BatchEntry(1, prompt, 0, True)])
            is DecodeStatus.OK
        )
        assert (
            backend.decode([BatchEntry(0, prompt[20:21], 20, True), BatchEntry(1, prompt[:1], 30, True)])
            is DecodeStatus.OK
        )
        logits.append(backend._logits.clone())
    tol = TOL if dtype == "float32" else 0.05
    torch.testing.assert_close(logits[0], logits[1], atol=tol, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "mistral-window"])
def test_bfloat16_cpu_kernels_as_close_as_torch_ops(
    kind: str, hf_family: Callable[[str], tuple[Path, HFModel]]
) -> None:
    """bfloat16 on the fused kernels and as torch ops, each against the float32 model over mixed
    steps: the kernels' error must be no larger than the torch ops' (up to 1.25x, bf16 noise)."""
    path, _ = hf_family(kind)
    seqs = [random_tokens(20, seed=40 + s) for s in range(3)]
    steps = [
        [BatchEntry(0, seqs[0][:12], 0, True), BatchEntry(1, seqs[1][:5], 0, True)],
        [
            BatchEntry(0, seqs[0][12:13], 12, True),
            BatchEntry(1, seqs[1][5:14], 5, True),
            BatchEntry(2, seqs[2], 0, True),
        ],
        [
            BatchEntry(0, seqs[0][13:14], 13, True),
            BatchEntry(1, seqs[1][14:15], 14, True),
            BatchEntry(2, [7], 20, True),
        ],
    ]

    def run(dtype: str, kernels: bool) -> torch.Tensor:
        backend = new_backend(path, n_ctx=128, kernels=kernels, dtype=dtype)
        got = []
        for step in steps:
            assert backend.decode(step) is DecodeStatus.OK
            got.append(backend._logits.clone())
        return torch.cat(got)

    ref = run("float32", False)
    err_kernels = (run("bfloat16", True) - ref).abs()
    err_ops = (run("bfloat16", False) - ref).abs()
    assert err_kernels.max() <= 1.25 * err_ops.max()
    assert err_kernels.mean() <= 1.25 * err_ops.mean()


def test_float16_on_a_cpu_without_onednn_fp16_runs_unpacked(tiny_models: ModelPaths) -> None:
    backend = TorchBackend(
        str(tiny_models.hf_dir), n_ctx=64, n_slots=2, n_batch=32, device="cpu", dtype="float16"
    )
    assert backend._require_model().prepacked is can_prepack(torch.device("cpu"), torch.float16)
    assert backend.decode([BatchEntry(0, random_tokens(5, seed=4), 0, True)]) is DecodeStatus.OK
    assert torch.isfinite(backend._logits).all()


@KERNELS
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral-window"])
def test_mixed_batches_of_three_sequences_match(
    kind: str, kernels: bool, hf_family: Callable[[str], tuple[Path, HFModel]]
) -> None:
    """Prompt chunks and decode tokens of 3 sequences interleaved, plus a tail rewrite (seq_rm).
    mistral-window (sliding window 8) has decode rows whose oldest cells fall out of the window."""
    path, hf = hf_family(kind)
    seqs = [random_tokens(24, seed=10 + s) for s in range(3)]
    refs = [hf_logits(hf, s) for s in seqs]
    backend = new_backend(path, kernels=kernels)
    # Each step: (seq_id, start, end) runs; logits of every run's last token are checked.
    steps = [
        [(0, 0, 10), (1, 0, 7)],
        [(0, 10, 11), (1, 7, 12), (2, 0, 12)],
        [(2, 12, 13), (0, 11, 12), (1, 12, 20)],
        [(0, 12, 13), (1, 20, 21), (2, 13, 22)],
        [(1, 21, 22), (0, 13, 14), (2, 22, 23)],
    ]
    for step in steps:
        entries = [BatchEntry(s, seqs[s][a:b], a, True) for s, a, b in step]
        assert backend.decode(entries) is DecodeStatus.OK
        for row, (s, _, b) in enumerate(step):
            torch.testing.assert_close(backend._logits[row], refs[s][b - 1], atol=TOL, rtol=0)

    # Prefix reuse: keep 8 positions of seq 1 and continue it with different tokens.
    backend.seq_rm(1, 8)
    new_tail = random_tokens(6, seed=99)
    assert (
        backend.decode([BatchEntry(1, new_tail, 8, True), BatchEntry(0, seqs[0][14:15], 14, True)])
        is DecodeStatus.OK
    )
    torch.testing.assert_close(
        backend._logits[0], hf_logits(hf, seqs[1][:8] + new_tail)[-1], atol=TOL, rtol=0
    )
    torch.testing.assert_close(backend._logits[1], refs[0][14], atol=TOL, rtol=0)


def test_whole_pool_mask_path_matches_with_shared_cells(
    hf_family: Callable[[str], tuple[Path, HFModel]],
) -> None:
    """The CUDA-graph attention form (whole pool under a sequence-bitmask mask, no gather) on the
    CPU, where sequences 1 and 3 share seq 0's first 6 cells (seq_cp) and then diverge."""
    import numpy as np

    from worker.torch_model.kv_cache import AttnGroup, AttnPlan, pool_mask

    path, hf = hf_family("llama")
    seqs = [random_tokens(12, seed=20 + s) for s in range(4)]
    seqs[1][:6] = seqs[3][:6] = seqs[0][:6]
    backend = new_backend(path, kernels=False)
    backend.decode([BatchEntry(0, seqs[0][:11], 0, False), BatchEntry(2, seqs[2][:11], 0, False)])
    for s in (1, 3):
        backend.seq_cp(0, s, 6)
    backend.decode([BatchEntry(s, seqs[s][6:11], 6, False) for s in (1, 3)])
    kv, model = backend._require_kv(), backend._require_model()
    assert set(kv.cells_of(1)[:6]) == set(kv.cells_of(0)[:6])
    seq_ids = np.array([2, 0, 3, 1])
    cells = kv.allocate(seq_ids, np.full(4, 11), np.ones(4, dtype=np.int64))
    assert cells is not None
    row_seq, row_pos = torch.from_numpy(seq_ids), torch.full((4,), 11)
    mask = pool_mask(torch.from_numpy(kv.cell_seqs), torch.from_numpy(kv.cell_pos), row_seq, row_pos, 2, None)
    assert mask.shape == (1, 1, 8, kv.n_cells + 1)
    plan = AttnPlan(torch.empty(0), row_seq, row_pos, [AttnGroup(slice(0, 4), None, mask)])
    logits = model(
        torch.tensor([seqs[s][11] for s in seq_ids]), row_pos, torch.from_numpy(cells), plan, torch.arange(4),
        kv.k, kv.v,
    )
    for row, s in enumerate(seq_ids):
        torch.testing.assert_close(logits[row], hf_logits(hf, seqs[s])[-1], atol=TOL, rtol=0)


def test_sharded_checkpoint_loads(hf_family: Callable[[str], tuple[Path, HFModel]]) -> None:
    path, hf = hf_family("qwen2")
    for f in path.glob("*.safetensors"):
        f.unlink()
    hf.save_pretrained(path, max_shard_size="100KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2
    prompt = random_tokens(30, seed=3)
    backend = new_backend(path)
    backend.decode([BatchEntry(0, prompt, 0, True)])
    torch.testing.assert_close(backend._logits[0], hf_logits(hf, prompt)[-1], atol=TOL, rtol=0)


def test_only_entries_asking_for_logits_get_rows(tiny_models: ModelPaths) -> None:
    backend = new_backend(tiny_models.hf_dir)
    a, b = random_tokens(5, 1), random_tokens(6, 2)
    backend.decode([BatchEntry(0, a, 0, False), BatchEntry(1, b, 0, True)])
    assert backend._logits.shape == (1, backend.meta.n_vocab)


def test_no_kv_space_writes_nothing(tiny_models: ModelPaths) -> None:
    backend = new_backend(tiny_models.hf_dir, n_ctx=16, kv_unified=True)
    assert backend.decode([BatchEntry(0, random_tokens(10, 1), 0, True)]) is DecodeStatus.OK
    status = backend.decode([BatchEntry(1, random_tokens(7, 2), 0, True)])
    assert status is DecodeStatus.NO_KV_SPACE
    assert backend._require_kv().num_free == 6
    backend.seq_rm(0, 0)
    assert backend.decode([BatchEntry(1, random_tokens(16, 2), 0, True)]) is DecodeStatus.OK


def greedy(backend: TorchBackend, prompts: list[list[int]], n_new: int) -> list[list[int]]:
    """Greedy for all prompts at once (sequences 0..n-1, cleared first): one prefill, then decode steps."""
    from worker.backends.base import SampleItem
    from worker.protocol.sampling import SamplingParams

    params = SamplingParams(temperature=0.0)
    for i in range(len(prompts)):
        backend.seq_rm(i, 0)
    samplers = [backend.new_sampler(params, 0) for _ in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    entries = [BatchEntry(i, p, 0, True) for i, p in enumerate(prompts)]
    pos = [len(p) for p in prompts]
    for _ in range(n_new):
        assert backend.decode(entries) is DecodeStatus.OK
        items = [SampleItem(samplers[i], i) for i in range(len(prompts))]
        toks = [s.token for s in backend.sample(items, [params] * len(prompts))]
        entries = []
        for i, t in enumerate(toks):
            out[i].append(t)
            entries.append(BatchEntry(i, [t], pos[i], True))
            pos[i] += 1
    return out


def test_greedy_generation_equals_transformers_generate(tiny_models: ModelPaths) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_models.hf_dir, dtype=torch.float32).eval()
    backend = new_backend(tiny_models.hf_dir)
    prompt = backend.tokenize("The quick brown fox jumps over", False, True)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=24, min_new_tokens=24, pad_token_id=0
        )[0, len(prompt):].tolist()
    assert greedy(backend, [prompt], 24)[0] == ref


@KERNELS
def test_concurrent_greedy_equals_one_at_a_time(kernels: bool, tiny_models: ModelPaths) -> None:
    backend = new_backend(tiny_models.hf_dir, kernels=kernels)
    prompts = [random_tokens(n, seed=n) for n in (3, 9, 17, 30)]
    together = greedy(backend, prompts, 12)
    assert together == [greedy(backend, [p], 12)[0] for p in prompts]


def test_sleep_frees_and_wake_restores(tiny_models: ModelPaths) -> None:
    backend = new_backend(tiny_models.hf_dir)
    prompt = random_tokens(12, 5)
    backend.decode([BatchEntry(0, prompt, 0, True)])
    before = backend._logits.clone()
    backend.sleep()
    assert backend.is_sleeping
    assert backend._model is None and backend._kv is None
    assert backend.tokenize("hello", False, True)  # the tokenizer stays usable
    backend.wake()
    assert not backend.is_sleeping
    backend.decode([BatchEntry(0, prompt, 0, True)])
    torch.testing.assert_close(backend._logits, before, atol=0, rtol=0)


def replay(backend: TorchBackend, prompts: list[list[int]], steps: list[list[int]]) -> list[torch.Tensor]:
    """Prefill all prompts, then decode the given tokens per step; the logits of every step (CPU)."""
    for i in range(len(prompts)):
        backend.seq_rm(i, 0)
    out = []
    assert backend.decode([BatchEntry(i, p, 0, True) for i, p in enumerate(prompts)]) is DecodeStatus.OK
    out.append(backend._logits.float().cpu())
    pos = [len(p) for p in prompts]
    for toks in steps:
        assert (
            backend.decode([BatchEntry(i, [t], pos[i], True) for i, t in enumerate(toks)]) is DecodeStatus.OK
        )
        out.append(backend._logits.float().cpu())
        pos = [p + 1 for p in pos]
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_eager_and_graphs_match_cpu(tiny_models: ModelPaths) -> None:
    path = str(tiny_models.hf_dir)
    cpu = new_backend(tiny_models.hf_dir)
    prompts = [random_tokens(n, seed=n) for n in (4, 11, 19)]
    tokens = greedy(cpu, prompts, 12)
    steps = [[t[k] for t in tokens] for k in range(11)]
    ref = replay(cpu, prompts, steps)
    for compile in (False, True):
        gpu = TorchBackend(
            path, n_ctx=256, n_slots=4, n_batch=64, device="cuda", dtype="float32", compile=compile
        )
        for got, want in zip(replay(gpu, prompts, steps), ref, strict=True):
            torch.testing.assert_close(got, want, atol=1e-3, rtol=0)
        gpu.sleep()
        assert gpu.is_sleeping
        gpu.wake()
        torch.testing.assert_close(replay(gpu, prompts, steps)[-1], ref[-1], atol=1e-3, rtol=0)
        gpu.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_default_generates(tiny_models: ModelPaths) -> None:
    gpu = TorchBackend(str(tiny_models.hf_dir), n_ctx=256, n_slots=4, n_batch=64, compile=True)
    assert gpu.dtype == torch.bfloat16
    out = greedy(gpu, [random_tokens(n, seed=n) for n in (3, 7)], 8)
    assert all(len(t) == 8 for t in out)
