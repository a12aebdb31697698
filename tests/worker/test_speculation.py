"""Speculative decoding (issue 29) on both backends with the tiny models: at temperature 0 the
output with prompt-lookup speculation equals the output without, token for token, alone and
with 8 requests at once (in-process engines with llama.cpp's DEFAULT flags on the F16 model,
and torch on the CPU); over HTTP: the request fields, `timings.draft_n`, the metrics, and the
refusals (a draft model's settings)."""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.util import ROOT, wait_until
from tests.worker.conftest import Worker, require_backend
from worker.testing.tiny_models import ModelPaths

N_SLOTS = 8
MAX_TOKENS = 40


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves (so that drafts are found and often accepted), and one
    that does not."""
    rng = random.Random(29)
    out = []
    for i in range(N_SLOTS - 1):
        base = [rng.randrange(10, 1000) for _ in range(12 + 5 * i)]
        out.append(base * 3)
    out.append([rng.randrange(10, 1000) for _ in range(70)])
    return out


@pytest.fixture(scope="module", params=["llama_cpp", "torch"])
def engine(request: pytest.FixtureRequest, tiny_models: ModelPaths) -> Iterator[object]:
    backend = str(request.param)
    require_backend(backend)
    from worker.backends import BackendOptions, load_backend
    from worker.engine.engine import Engine
    from worker.engine.metrics import WorkerMetrics
    from worker.engine.speculation import SpecConfig

    model = tiny_models.gguf_f16 if backend == "llama_cpp" else tiny_models.hf_dir
    options = BackendOptions(n_ctx=4096, n_slots=N_SLOTS, threads=1, device="cpu")  # llama.cpp: defaults
    metrics = WorkerMetrics()
    # requests opt in; every generating slot may draft (by default not beside more than 2 others)
    spec = SpecConfig(max_generating=N_SLOTS)
    eng = Engine(lambda progress: load_backend(backend, str(model), options, progress), N_SLOTS, metrics,  # type: ignore[arg-type]  # backend is one of the Literal values
                 spec=spec)
    eng.start()
    try:
        wait_until(lambda: eng.status.is_ready, 60, what="model loaded")
        yield eng, metrics
    finally:
        eng.stop()


def _generate(engine: object, prompts: list[list[int]], n_max: int) -> list[list[int]]:
    """Greedy tokens of every prompt, all submitted at once; n_max 0: no speculation."""
    from worker.engine.engine import Engine
    from worker.engine.task import ErrorEvent, Event, FinishEvent, Task, TokenEvent
    from worker.protocol.sampling import SamplingParams, SpecRequest

    assert isinstance(engine, Engine)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            speculative=SpecRequest(n_max=n_max, size_n=2))
    outs: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]

    def emitter(i: int):  # type: ignore[no-untyped-def]  # a closure per task
        def emit(ev: Event) -> None:
            if isinstance(ev, TokenEvent):
                outs[i].append(ev.token)
            elif isinstance(ev, FinishEvent | ErrorEvent):
                assert not isinstance(ev, ErrorEvent), ev.message
                done[i].set()

        return emit

    engine.submit_many([Task(p, params, 1, emitter(i)) for i, p in enumerate(prompts)])
    for d in done:
        assert d.wait(120)
    return outs


def test_greedy_output_with_speculation_equals_without(engine: tuple[object, object]) -> None:
    eng, metrics = engine
    prompts = _prompts()
    plain = [_generate(eng, [p], 0)[0] for p in prompts]
    drafted_before = metrics.spec_accepted_tokens._value.get()  # type: ignore[attr-defined]  # the counter's value
    alone = [_generate(eng, [p], 16)[0] for p in prompts]
    drafted_alone = metrics.spec_draft_tokens._value.get()  # type: ignore[attr-defined]  # the counter's value
    together = _generate(eng, prompts, 16)
    assert alone == plain
    assert together == plain
    assert metrics.spec_draft_tokens._value.get() > drafted_alone  # type: ignore[attr-defined]  # drafts beside others
    assert all(len(o) == MAX_TOKENS for o in plain)
    assert metrics.spec_accepted_tokens._value.get() > drafted_before  # type: ignore[attr-defined]  # drafts were accepted


def test_request_fields_timings_and_metrics(worker: Worker) -> None:
    """OVMS's num_assistant_tokens / max_ngram_size opt a request in on a worker started without
    --spec-type; timings carry llama-server's draft_n / draft_n_accepted; /metrics counts."""
    prompt = [11, 12, 13, 14, 15, 16, 17, 18] * 6
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(worker.url + "/completion", json=body, timeout=60).json()
    assert "draft_n" not in plain["timings"]
    opt_in = {**body, "num_assistant_tokens": 8, "max_ngram_size": 3}
    spec = httpx.post(worker.url + "/completion", json=opt_in, timeout=60).json()
    assert spec["content"] == plain["content"]
    assert spec["timings"]["draft_n"] >= spec["timings"]["draft_n_accepted"] > 0
    llama_fields = {"speculative.n_max": 4, "speculative.n_min": 1}
    llama = httpx.post(worker.url + "/v1/completions", json={**body, **llama_fields}, timeout=60).json()
    assert llama["choices"][0]["text"] == plain["content"]
    text = httpx.get(worker.url + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line[:1] not in "#"}
    assert values["omni:spec_draft_tokens_total"] >= values["omni:spec_accepted_tokens_total"] > 0
    accepted = values["omni:spec_accepted_tokens_total"]
    assert values["llamacpp:spec_decode_num_accepted_tokens_total"] == accepted
    for field in ("assistant_confidence_threshold", "speculative.p_min"):
        r = httpx.post(worker.url + "/v1/completions", json={**body, field: 0.5}, timeout=60)
        assert r.status_code == 400 and "draft model" in r.text, r.text


def test_each_decode_call_of_output_rows_is_timed_for_the_cost_fit(tiny_models: ModelPaths) -> None:
    """llama.cpp runs a verify entry in a decode call of its own beside the one-row entries: the
    step-cost fit learns each such call apart (its rows, its seconds), so that a call's fixed
    cost is not charged as rows; a prompt piece's call (cheaper rows) is not timed for it."""
    require_backend("llama_cpp")
    from worker.backends import BackendOptions, load_backend
    from worker.backends.base import BatchEntry

    options = BackendOptions(n_ctx=1024, n_slots=4, threads=1)
    backend = load_backend("llama_cpp", str(tiny_models.gguf_f16), options, None)
    try:
        prompt = list(range(10, 30))
        for seq in range(3):
            backend.decode([BatchEntry(seq, prompt, 0, True)])
        assert backend.timed_calls == []  # prompt pieces only
        backend.decode([BatchEntry(0, [5, 6, 7], 20, True, n_outputs=3), BatchEntry(1, [5], 20, True),
                        BatchEntry(2, [5], 20, True), BatchEntry(3, prompt, 0, False)])
        timed = backend.timed_calls
        assert [rows for rows, _ in timed] == [3, 2]
        assert all(seconds > 0 for _, seconds in timed)
    finally:
        backend.close()


@pytest.mark.parametrize(("target", "draft"), [("llama_cpp", "torch"), ("torch", "llama_cpp")])
def test_a_draft_model_on_either_backend_keeps_greedy_output(
    target: str, draft: str, tiny_models: ModelPaths
) -> None:
    """--spec-type draft-simple: the draft (the same tiny model on the other backend: same
    vocabulary) drafts greedily with a KV stream per slot; the answers stay the plain ones."""
    require_backend("torch")
    from worker.backends import BackendOptions, load_backend
    from worker.engine.engine import Engine
    from worker.engine.metrics import WorkerMetrics
    from worker.engine.speculation import SpecConfig

    path = {"llama_cpp": tiny_models.gguf_f32, "torch": tiny_models.hf_dir}
    options = BackendOptions(n_ctx=2048, n_slots=4, threads=1, device="cpu", dtype="float32")
    metrics = WorkerMetrics()
    eng = Engine(lambda progress: load_backend(target, str(path[target]), options, progress), 4, metrics,  # type: ignore[arg-type]  # one of the Literal values
                 spec=SpecConfig("draft-simple", n_max=4, max_generating=4),
                 draft_factory=lambda progress: load_backend(draft, str(path[draft]), options, progress))  # type: ignore[arg-type]  # likewise
    eng.start()
    try:
        wait_until(lambda: eng.status.is_ready, 60, what="models loaded")
        prompts = _prompts()[:4]
        plain = [_generate(eng, [p], 0)[0] for p in prompts]
        assert _generate(eng, prompts, 4) == plain
        assert metrics.spec_accepted_tokens._value.get() > 0  # type: ignore[attr-defined]  # the counter's value
    finally:
        eng.stop()


def test_a_draft_model_of_another_vocabulary_is_refused_at_load(tiny_models: ModelPaths,
                                                                tiny_reranker: ModelPaths) -> None:
    from worker.backends import BackendOptions, load_backend
    from worker.engine.engine import Engine
    from worker.engine.metrics import WorkerMetrics
    from worker.engine.speculation import SpecConfig

    options = BackendOptions(n_ctx=512, n_slots=1, threads=1)
    target = str(tiny_models.gguf_f32)
    eng = Engine(lambda p: load_backend("llama_cpp", target, options, p), 1, WorkerMetrics(),
                 spec=SpecConfig("draft-simple"),
                 draft_factory=lambda p: load_backend("llama_cpp", str(tiny_reranker.gguf_f32), options, p))
    eng.start()
    try:
        wait_until(lambda: eng.status.error is not None, 60, what="the load to fail")
        assert "a draft model must share the model's vocabulary" in str(eng.status.error)
    finally:
        eng.stop()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--spec-type", "draft-simple"], "draft-simple needs a draft model"),
        (["--spec-type", "ngram-simple", "-md", "x.gguf"], "a draft model is for --spec-type draft-simple"),
        (["--spec-type", "ngram-mod"], "omni-worker runs one of none, ngram-simple, draft-simple"),
        (["--spec-type", "ngram-simple", "--spec-draft-p-min", "0.5"], "there is no draft model"),
    ],
)
def test_what_is_not_run_is_refused_at_start(flags: list[str], message: str, tiny_models: ModelPaths) -> None:
    cmd = [sys.executable, "-m", "worker.server.cli", "-m", str(tiny_models.gguf_f32), *flags]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and message in r.stderr.replace("\n", " "), r.stderr


def test_a_draft_model_gone_while_asleep_fails_the_wake_whole(
    tiny_models: ModelPaths, tmp_path: Path
) -> None:
    """A wake is all or nothing with a draft model too: its file gone while asleep, the wake is a
    clear error and the model stays asleep (half awake, the next speculative step would draft
    with a freed model); once the file is back it wakes and drafts as before."""
    from worker.backends import BackendOptions, load_backend
    from worker.engine.engine import Engine
    from worker.engine.metrics import WorkerMetrics
    from worker.engine.speculation import SpecConfig

    draft = tmp_path / "draft.gguf"
    shutil.copyfile(tiny_models.gguf_f32, draft)
    options = BackendOptions(n_ctx=2048, n_slots=2, threads=1, device="cpu")
    eng = Engine(lambda progress: load_backend("llama_cpp", str(tiny_models.gguf_f32), options, progress), 2,
                 WorkerMetrics(), spec=SpecConfig("draft-simple", n_max=4, max_generating=2),
                 draft_factory=lambda progress: load_backend("llama_cpp", str(draft), options, progress))
    eng.start()
    try:
        wait_until(lambda: eng.status.is_ready, 60, what="models loaded")
        prompt = _prompts()[:1]
        before = _generate(eng, prompt, 4)
        eng.call_when_idle(eng.sleep).result(60)
        hidden = draft.rename(tmp_path / "elsewhere.gguf")
        for _ in range(2):
            with pytest.raises(RuntimeError, match="draft model could not be loaded again"):
                eng.call(eng.wake).result(60)
            assert eng.call(lambda: eng._require_backend().is_sleeping).result(10)
        hidden.rename(draft)
        eng.call(eng.wake).result(60)
        assert _generate(eng, prompt, 4) == before
    finally:
        eng.stop()
