"""LoRA adapters through a real omni-worker (llama.cpp's backend on the tiny GGUF, torch's on its
HF twin): llama-server's flags, GET/POST /lora-adapters and the per-request `lora` field; scale 1
gives the merged-weights model's greedy text and scale 0 the base's; a burst mixing adapters,
scales and the base gives each request its own answer (llama-server's pinned build reuses a
slot's cached prompt across scales and gets such a burst wrong); the bad inputs are 400s that
name the field; adapters load and unload at run time (--lora-runtime) and are reached by
`model` ("<model>:<adapter>") through the openai SDK."""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.util import HTTP, ROOT, run_worker
from worker.testing.tiny_lora import lora_paths, merged_paths
from worker.testing.tiny_models import ModelPaths

MODELS = ROOT / "models"
A, B, BAD = (lora_paths(MODELS, n) for n in ("a", "b", "bad"))
PROMPT = "the quick brown fox jumps over the lazy dog and then"
ARGS = ("-np", "4", "-c", "1024", "-t", "1")


def complete(base: str, lora: list[dict[str, Any]] | None = None, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"prompt": PROMPT, "n_predict": 12, "temperature": 0, **extra}
    if lora is not None:
        body["lora"] = lora
    return HTTP.post(f"{base}/completion", json=body, timeout=120)


def text(base: str, lora: list[dict[str, Any]] | None = None, **extra: Any) -> str:
    r = complete(base, lora, **extra)
    assert r.status_code == 200, r.text
    content: str = r.json()["content"]
    return content


# Each entry: the request's lora field and which reference answer it must give.
BURST: list[tuple[list[dict[str, Any]] | None, str]] = [
    ([], "base"), ([{"id": 0, "scale": 1.0}], "a"), ([{"id": 1, "scale": 1.0}], "b"),
    ([{"id": 0, "scale": 0.0}], "base"), ([{"id": 0, "scale": 0.5}], "a/2"), (None, "global"),
    ([{"id": 0, "scale": 1.0}], "a"), ([{"id": 1, "scale": 1.0}, {"id": 0, "scale": 0.0}], "b"),
]


def check_burst(base: str, default: str, rounds: int = 3) -> dict[str, str]:
    """Each lora of BURST alone first, then all at once, `rounds` times: every answer its own.
    `default`: what a request without `lora` (the global scales) answers."""
    alone = {name: text(base, lora) for lora, name in BURST}
    assert alone["global"] == alone[default]
    assert len({alone["base"], alone["a"], alone["b"], alone["a/2"]}) == 4, alone
    with ThreadPoolExecutor(len(BURST)) as pool:
        for _ in range(rounds):
            got = list(pool.map(lambda item: text(base, item[0]), BURST))
            assert got == [alone[name] for _, name in BURST]
    return alone


def test_llama_cpp_adapters_scales_burst_and_bad_input(tiny_loras: ModelPaths) -> None:
    with run_worker(tiny_loras.gguf_f32, *ARGS) as base:
        plain = text(base)
    with run_worker(merged_paths(MODELS)[1], *ARGS) as base:
        merged = text(base)
    with run_worker(tiny_loras.gguf_f32, *ARGS, "--lora", f"{A.gguf},{B.gguf}",
                    "--lora-init-without-apply") as base:
        listed = HTTP.get(f"{base}/lora-adapters").json()
        want = [(0, str(A.gguf), 0.0), (1, str(B.gguf), 0.0)]
        assert [(x["id"], x["path"], x["scale"]) for x in listed] == want
        alone = check_burst(base, "base")
        assert alone["a"] == merged, "scale 1: the merged-weights model's greedy text"
        assert alone["base"] == plain, "scale 0: the base model's"
        # the global scales: a request without `lora` runs with them; not listed -> 0
        assert HTTP.post(f"{base}/lora-adapters", json=[{"id": 0, "scale": 1.0}]).json() == {"success": True}
        assert [x["scale"] for x in HTTP.get(f"{base}/lora-adapters").json()] == [1.0, 0.0]
        assert text(base) == merged
        # bad input: a 400 naming the field
        for lora, what in (([{"id": 7, "scale": 1.0}], "no adapter with id 7"),
                           ([{"id": 0, "scale": "inf"}], "finite"), ([{"id": 0}], "")):
            r = complete(base, lora)
            assert r.status_code == 400 and r.json()["error"]["param"].startswith("lora"), r.text
            assert what in r.json()["error"]["message"]
        r = HTTP.post(f"{base}/lora-adapters", json=[{"id": 3, "scale": 1.0}])
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora"
        r = HTTP.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(B.gguf)})
        assert r.status_code == 501, "run-time loading is off without --lora-runtime"


def test_an_adapter_for_another_model_fails_the_load_with_the_reason(tiny_loras: ModelPaths) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "worker.server.cli", "-m", str(tiny_loras.gguf_f32), "--port", "0",
         "--lora", str(BAD.gguf)], cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert "made for another base model" in proc.stdout + proc.stderr


def test_an_adapter_deleted_while_asleep_fails_the_wake_whole_and_the_worker_lives(
    tiny_loras: ModelPaths, tmp_path: Path
) -> None:
    """Regression (issue 47, 3): load an adapter, sleep, delete its file, wake twice, decode: the
    worker died of a segfault (exit 139). The failed wake had left a context (so the backend no
    longer counted as asleep) and a NULL adapter, which the next decode gave to llama.cpp. Now a
    wake is all or nothing: each try is a clear error, the model stays asleep, the worker lives,
    and it wakes once the file is back, or once the adapter is unloaded (--lora-runtime)."""
    lora, runtime = tmp_path / "a.gguf", tmp_path / "b.gguf"
    shutil.copyfile(A.gguf, lora)
    shutil.copyfile(B.gguf, runtime)
    with run_worker(tiny_loras.gguf_f32, *ARGS, "--lora", str(lora), "--lora-runtime",
                    "--lora-allowed-path", str(tmp_path)) as base:
        adapted = text(base, [{"id": 0, "scale": 1.0}])
        r = HTTP.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "b.gguf"})
        assert r.status_code == 200 and r.json()["id"] == 1, r.text
        assert HTTP.post(f"{base}/sleep", timeout=60).status_code == 200
        lora.unlink()
        runtime.unlink()
        for _ in range(2):
            r = HTTP.post(f"{base}/wake", timeout=60)
            assert r.status_code == 500 and str(lora) in r.text, r.text
            assert r.json()["error"]["message"].startswith("the model could not wake: LoRA adapter 0")
            assert HTTP.get(f"{base}/health", timeout=10).json()["is_sleeping"] is True
        r = complete(base)
        assert r.status_code == 500, r.text
        message = r.json()["error"]["message"]
        assert "could not wake" in message and str(lora) in message
        assert HTTP.get(f"{base}/health", timeout=10).json() == {"status": "ok", "is_sleeping": True}
        shutil.copyfile(A.gguf, lora)  # the first is back; the second is not
        r = HTTP.post(f"{base}/wake", timeout=60)
        assert r.status_code == 500 and "LoRA adapter 1" in r.text and str(runtime) in r.text, r.text
        r = HTTP.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "b"}, timeout=60)  # while asleep
        assert r.status_code == 200, r.text
        assert text(base) == text(base, [{"id": 0, "scale": 1.0}]) == adapted


def test_adapters_loaded_at_run_time_and_reached_by_model_name(
    tiny_loras: ModelPaths, tmp_path: Path
) -> None:
    with run_worker(tiny_loras.gguf_f32, *ARGS, "--lora-runtime", "--lora-allowed-path", str(MODELS),
                    "-a", "tiny", "--slot-save-path", str(tmp_path)) as base:
        plain = text(base)
        r = HTTP.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(BAD.gguf)})
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
        assert "made for another base model" in r.json()["error"]["message"]
        r = HTTP.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": str(A.gguf)})
        assert r.status_code == 200, r.text
        assert r.json()["id"] == 0 and r.json()["scale"] == 1.0
        adapted = text(base, [{"id": 0, "scale": 1.0}], id_slot=0)
        assert adapted != plain
        r = HTTP.post(f"{base}/slots/0?action=save", json={"filename": "s.bin"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "id_slot", r.text  # adapter rows
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        for model, want in (("tiny:poet", adapted), ("tiny", adapted)):  # global scale 1: on for all
            out = client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0)
            assert out.choices[0].text == want, model
        assert HTTP.post(f"{base}/sleep", timeout=60).status_code == 200  # adapters reload at wake
        assert text(base, [{"id": 0, "scale": 1.0}]) == adapted
        r = HTTP.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "poet"})
        assert r.status_code == 200, r.text
        assert HTTP.get(f"{base}/lora-adapters").json() == []
        assert text(base) == plain
        r = complete(base, [{"id": 0, "scale": 1.0}])
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora"
        r = HTTP.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "poet"})
        assert r.status_code == 404
        # a global scale at load; unloaded by id (lora_int_id); ids are not reused
        r = HTTP.post(f"{base}/v1/load_lora_adapter",
                       json={"lora_name": "half", "lora_path": str(A.gguf), "scale": 0.5})
        assert r.json()["id"] == 1 and r.json()["scale"] == 0.5
        assert text(base) == text(base, [{"id": 1, "scale": 0.5}]) != plain
        assert HTTP.post(f"{base}/v1/unload_lora_adapter", json={"lora_int_id": 1}).status_code == 200
        assert text(base) == plain


def test_run_time_adapters_come_only_from_the_allowed_folder_with_one_refusal_for_all(
    tiny_loras: ModelPaths, tmp_path: Path
) -> None:
    """Regression (issue 47, 6): --lora-runtime loaded any path a client named, and its two errors
    ("no such file", "not a readable GGUF file") told the client which files exist on the box.
    Now --lora-runtime needs --lora-allowed-path; outside it (symlinks and '..' resolved), missing,
    or not a file: the same 400, word for word. Inside it, the adapter's own checks speak."""
    proc = subprocess.run([sys.executable, "-m", "worker.server.cli", "-m", str(tiny_loras.gguf_f32),
                           "--port", "0", "--lora-runtime"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "--lora-allowed-path" in proc.stdout + proc.stderr
    root = tmp_path / "adapters"
    (root / "sub").mkdir(parents=True)
    shutil.copyfile(A.gguf, root / "sub" / "a.gguf")
    shutil.copyfile(BAD.gguf, root / "bad.gguf")
    (root / "escape.gguf").symlink_to(B.gguf)  # a link inside that leads outside
    (root / "inner.gguf").symlink_to(root / "sub" / "a.gguf")  # a link that stays inside
    (tmp_path / "outside.gguf").write_bytes(b"GGUF" + bytes(100))
    refused = [str(B.gguf), str(root / "escape.gguf"), str(root / "sub" / ".." / ".." / "outside.gguf"),
               "../outside.gguf", str(root / "missing.gguf"), "sub", str(root), "/etc/hostname",
               "/nonexistent/x.gguf", str(tmp_path / "outside.gguf")]
    with run_worker(tiny_loras.gguf_f32, *ARGS, "--lora-runtime", "--lora-allowed-path", str(root)) as base:
        answers = set()
        for i, path in enumerate(refused):
            r = HTTP.post(f"{base}/v1/load_lora_adapter", json={"lora_name": f"x{i}", "lora_path": path})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", (path, r.text)
            answers.add(r.text)
        assert len(answers) == 1, answers
        assert "--lora-allowed-path" in answers.pop()
        r = HTTP.post(f"{base}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "bad.gguf"})
        assert r.status_code == 400 and "made for another base model" in r.json()["error"]["message"]
        for name, path in (("a", "sub/a.gguf"), ("inner", str(root / "inner.gguf"))):
            r = HTTP.post(f"{base}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})
            assert r.status_code == 200, r.text
            assert r.json()["path"] == str((root / "sub" / "a.gguf").resolve())
        assert [a["name"] for a in HTTP.get(f"{base}/lora-adapters").json()] == ["a", "inner"]


@pytest.mark.parametrize("kind", ["torch"])
def test_torch_peft_adapters_burst(tiny_loras: ModelPaths, kind: str) -> None:
    """The burst on the torch backend (its logits against the merged model's and the base's are
    tests/lora/test_torch_lora.py's); the answers alone equal the GGUF twin's on llama.cpp."""
    with run_worker(tiny_loras.hf_dir, *ARGS, "--lora", str(A.peft), "--lora-scaled", f"{B.peft}:0") as base:
        assert [x["scale"] for x in HTTP.get(f"{base}/lora-adapters").json()] == [1.0, 0.0]
        check_burst(base, "a", rounds=2)  # --lora: scale 1 for all
