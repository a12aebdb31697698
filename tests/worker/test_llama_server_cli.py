"""omni-worker takes llama-server's command line: the flags are parsed under llama-server's names
and short forms, and they take effect (sampling defaults, -n, --api-key, --no-slots, --metrics,
--tags, --sleep-idle-seconds). What it does not do is refused at start with one clear line.

One worker for the module, started with llama-server's short flags and without --metrics.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from tests.util import HTTP, ROOT, free_port, stop_process, wait_healthy, wait_until
from worker.testing.tiny_models import ModelPaths

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
LLAMA_SERVER_FLAGS = [
    "-a",
    "tiny",
    "--tags",
    "a, b",
    "-c",
    "512",
    "-np",
    "2",
    "-b",
    "64",
    "-ub",
    "64",
    "-t",
    "1",
    "-ngl",
    "all",
    "-fa",
    "off",
    "-ctk",
    "f32",
    "-ctv",
    "f32",
    "-cram",
    "0",
    "--jinja",
    "--no-context-shift",
    "--offline",
    "--temp",
    "0",
    "-n",
    "5",
    "--top-k",
    "3",
    "--seed",
    "7",
    "--repeat-penalty",
    "1.0",
    "--api-key",
    KEY,
    "--no-slots",
    "--sleep-idle-seconds",
    "1",
]


@contextlib.contextmanager
def serve(*args: str, host: str = "127.0.0.1") -> Iterator[str]:
    """`python -m worker.server.cli ARGS` exactly as given (no --metrics added)."""
    port = free_port()
    cmd = [sys.executable, "-m", "worker.server.cli", "--port", str(port), "--host", host, *args]
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(proc, url, 60)
            yield url
        finally:
            stop_process(proc)


@pytest.fixture(scope="module")
def url(tiny_models: ModelPaths) -> Iterator[str]:
    with serve("-m", str(tiny_models.gguf_f32), *LLAMA_SERVER_FLAGS) as u:
        yield u


def _complete(url: str, **body: object) -> dict[str, object]:
    r = HTTP.post(f"{url}/v1/completions", json={"prompt": "hello world", "ignore_eos": True, **body},
                   headers=AUTH, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, object] = r.json()
    return out


def test_props_report_the_command_line_defaults(url: str) -> None:
    props = HTTP.get(f"{url}/props", headers=AUTH, timeout=10).json()
    params = props["default_generation_settings"]["params"]
    assert (params["temperature"], params["n_predict"], params["top_k"], params["seed"]) == (0.0, 5, 3, 7)
    assert props["total_slots"] == 2 and props["model_alias"] == "tiny"


def test_n_predict_is_the_default_a_request_overrides(url: str) -> None:
    """As llama-server (n_predict_max = the task's n_predict unless -1, else -n): no cap."""
    assert _complete(url)["usage"]["completion_tokens"] == 5  # type: ignore[index]
    assert _complete(url, max_tokens=8)["usage"]["completion_tokens"] == 8  # type: ignore[index]
    assert _complete(url, n_predict=3)["usage"]["completion_tokens"] == 3  # type: ignore[index]


def test_temp_0_default_is_greedy_and_reproducible(url: str) -> None:
    texts = {_complete(url)["choices"][0]["text"] for _ in range(3)}  # type: ignore[index]
    assert len(texts) == 1


def test_api_key_guards_every_route_but_health(url: str) -> None:
    assert HTTP.get(f"{url}/health", timeout=10).status_code == 200
    r = HTTP.get(f"{url}/v1/models", timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert HTTP.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=10).status_code == 401
    assert (
        HTTP.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10).status_code
        == 401
    )
    card = HTTP.get(f"{url}/v1/models", headers={"X-Api-Key": KEY}, timeout=10).json()["data"][0]
    assert card["id"] == "tiny" and card["tags"] == ["a", "b"]


def test_slots_and_metrics_are_501_when_off(url: str) -> None:
    for path, flag in (("/slots", "--slots"), ("/metrics", "--metrics")):
        r = HTTP.get(url + path, headers=AUTH, timeout=10)
        assert r.status_code == 501, path
        assert r.json()["error"]["type"] == "not_supported_error" and flag in r.json()["error"]["message"]


def test_sleep_idle_seconds_sleeps_and_a_request_wakes(url: str) -> None:
    wait_until(
        lambda: HTTP.get(f"{url}/health", timeout=10).json()["is_sleeping"], 10, what="the idle sleep"
    )
    assert _complete(url)["usage"]["completion_tokens"] == 5  # type: ignore[index]
    assert HTTP.get(f"{url}/health", timeout=10).json()["is_sleeping"] is False


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-hf", "ggml-org/some-model-GGUF", "-m", "x.gguf"], "not both"),
        (["-hf", "not a repo"], "org/repo"),
        (["--model-url", "https://example.com/m.gguf"], "does not download a model from a URL"),
        (["-m", "x.gguf", "--context-shift"], "does not shift context"),
        (["-m", "x.gguf", "--control-vector", "a.gguf"], "unknown option --control-vector"),
        (["-m", "x.gguf", "--top-p", "2"], "--top-p"),
        ([], "-m PATH"),
    ],
)
def test_refused_flags_exit_2_with_one_line(args: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "worker.server.cli", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 2
    assert message in r.stderr and "Traceback" not in r.stderr, r.stderr
