"""omni-worker behaves as llama-server where llama.cpp's own server test-suite looks (issue 14):
/infill, slot files, POST /props, fail_on_no_slot, CORS, the `llamacpp:` metrics, assistant
prefill and continue_final_message, `__verbose`, token counting endpoints, llama-server's
logit_bias forms, comma-separated aliases, several listen addresses, prompt progress.

Real worker processes on the tiny GGUF (and a FIM variant of it, written by the model factory).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.util import HTTP, wait_until
from tests.worker.test_llama_server_cli import serve as serve_as_given
from worker.testing.tiny_models import ModelPaths, write_fim_variant


def serve(*args: str, host: str = "127.0.0.1") -> contextlib.AbstractContextManager[str]:
    """A worker on `args` and one thread: its default, every core, spins and crawls on a shared
    2-core box (test_context_full_stops_at_n_ctx took 62 s that way, under 2 s with one)."""
    return serve_as_given(*args, "-t", "1", host=host)


@pytest.fixture(scope="module")
def save_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


@pytest.fixture(scope="module")
def url(tiny_models: ModelPaths, save_dir: Path) -> Iterator[str]:
    with serve("-m", str(tiny_models.gguf_f32), "-a", "zeta,alpha", "--tags", "t1", "-c", "1024", "-np", "2",
               "-b", "32", "--temp", "0", "--metrics", "--props", "--slot-save-path", str(save_dir),
               "--cors-origins", "localhost", "--http", "h11") as u:
        yield u


def post(url: str, path: str, body: object, **kw: object) -> httpx.Response:
    return HTTP.post(url + path, json=body, timeout=60, **kw)  # type: ignore[arg-type]


def native(url: str, **body: object) -> dict[str, object]:
    r = post(url, "/completion", {"n_predict": 4, **body})
    assert r.status_code == 200, r.text
    out: dict[str, object] = r.json()
    return out


# --------------------------------------------------------------------------- /infill


def test_infill_needs_fim_tokens(url: str) -> None:
    r = post(url, "/infill", {"input_prefix": "def f(", "input_suffix": "\n"})
    assert r.status_code == 501
    assert r.json()["error"]["message"] == ("Infill is not supported by this model: prefix token is missing. "
                                            "suffix token is missing. middle token is missing.")


@pytest.fixture(scope="module")
def fim_url() -> Iterator[tuple[str, dict[str, int]]]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "tiny-fim.gguf"
        fim = write_fim_variant(path)
        with serve("-m", str(path), "-c", "1024", "-np", "1", "-b", "512", "--temp", "0") as u:
            yield u, fim


def test_infill_lays_out_prefix_prompt_suffix_with_fim_tokens(fim_url: tuple[str, dict[str, int]]) -> None:
    url, fim = fim_url

    def tokens(text: str) -> list[int]:
        ids: list[int] = post(url, "/tokenize", {"content": text, "parse_special": False}).json()["tokens"]
        return ids

    body = {
        "input_prefix": "def add(a, b):\n",
        "prompt": "    return",
        "input_suffix": "\n\nprint(add(1, 2))\n",
        "n_predict": 3,
        "return_tokens": True,
    }
    r = post(url, "/infill", body)
    assert r.status_code == 200, r.text
    expected = [fim["pre"], *tokens(body["input_prefix"]), *tokens(body["prompt"]), fim["suf"],  # type: ignore[arg-type]
                *tokens(body["input_suffix"]), fim["mid"]]  # type: ignore[arg-type]
    out = r.json()
    assert out["tokens_evaluated"] == len(expected) and out["tokens_predicted"] == 3 and "content" in out
    # the same prompt sent as token ids to /completion generates the same text (greedy)
    assert native(url, prompt=expected, n_predict=3)["content"] == out["content"]
    # other files go first, each after a snippet line (the model has no file separator token)
    extra = [{"filename": "util.py", "text": "X = 1\n"}]
    with_extra = post(url, "/infill", {**body, "input_extra": extra}).json()
    assert with_extra["tokens_evaluated"] == len(expected) + len(tokens("\n\n--- snippet ---\n\n")) + len(
        tokens("X = 1\n")
    )


@pytest.mark.parametrize("chunk", [{}, {"filename": "ok"}, {"filename": 123}, {"filename": 123, "text": 456}])
def test_infill_bad_input_extra_is_400(fim_url: tuple[str, dict[str, int]], chunk: dict[str, object]) -> None:
    r = post(fim_url[0], "/infill", {"input_prefix": "a", "input_suffix": "b", "input_extra": [chunk]})
    assert r.status_code == 400 and "error" in r.json()


# --------------------------------------------------------------------------- slots, props


def test_slot_save_restore_erase(url: str, save_dir: Path) -> None:
    # A long prompt: its rows are reusable by a longer prompt (a short one is one piece, a class of its own).
    prompt = "the quick brown fox jumps over the lazy dog " * 16
    first = native(url, prompt=prompt, id_slot=1)
    n_prompt = first["timings"]["prompt_n"]  # type: ignore[index]
    saved = post(url, "/slots/1?action=save", {"filename": "fox.bin"}).json()
    assert saved["id_slot"] == 1 and saved["filename"] == "fox.bin" and saved["n_saved"] >= n_prompt
    assert saved["n_written"] == (save_dir / "fox.bin").stat().st_size and saved["timings"]["save_ms"] >= 0
    assert post(url, "/slots/0?action=erase", {}).json()["id_slot"] == 0
    restored = post(url, "/slots/0?action=restore", {"filename": "fox.bin"}).json()
    assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]
    again = native(url, prompt=prompt + "again", id_slot=0)  # the restored prefix is reused ...
    same = native(url, prompt=prompt + "again", id_slot=1)  # ... as much as in the slot it was saved from
    assert again["timings"]["cache_n"] == same["timings"]["cache_n"] > 0  # type: ignore[index]
    erased = post(url, "/slots/0?action=erase", {}).json()
    assert erased == {"id_slot": 0, "n_erased": erased["n_erased"]} and erased["n_erased"] > 0


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/slots/0?action=save", {"filename": "../escape.bin"}, 400),
    ("/slots/0?action=save", {"filename": "a/b.bin"}, 400),
    ("/slots/0?action=save", {"filename": ".."}, 400),
    ("/slots/0?action=save", {}, 400),
    ("/slots/0?action=save", {"filename": "x.bin", "overwrite": True}, 400),  # an unknown field (issue 26)
    ("/slots/0?action=restore", {"filename": "missing.bin"}, 400),
    ("/slots/9?action=save", {"filename": "x.bin"}, 400),
    ("/slots/x?action=save", {"filename": "x.bin"}, 400),
    ("/slots/0?action=fly", {"filename": "x.bin"}, 400),
])
def test_slot_action_errors(url: str, save_dir: Path, path: str, body: object, status: int) -> None:
    r = post(url, path, body)
    assert r.status_code == status and "error" in r.json()
    assert not (save_dir.parent / "escape.bin").exists()


def test_slot_restore_refuses_a_file_of_another_model(url: str, save_dir: Path) -> None:
    (save_dir / "junk.bin").write_bytes(b"not a slot file")
    assert post(url, "/slots/0?action=restore", {"filename": "junk.bin"}).status_code == 400


def test_slot_actions_and_props_are_501_without_their_flags(tiny_models: ModelPaths, url: str) -> None:
    assert post(url, "/props", {}).json() == {"success": True}
    refused = post(url, "/props", {"n_ctx": 4})  # nothing is settable: refused, not ignored
    assert refused.status_code == 400 and "n_ctx" in refused.json()["error"]["message"]
    with serve("-m", str(tiny_models.gguf_f32), "-c", "256", "-np", "1") as plain:
        for path in ("/slots/0?action=save", "/props"):
            r = post(plain, path, {"filename": "x.bin"})
            assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error", path


def test_fail_on_no_slot_is_503_while_every_slot_is_busy(tiny_models: ModelPaths) -> None:
    with serve("-m", str(tiny_models.gguf_f32), "-c", "2048", "-np", "1", "--slots") as u:
        assert HTTP.get(f"{u}/slots?fail_on_no_slot=1", timeout=10).status_code == 200
        with HTTP.stream(
            "POST",
            f"{u}/completion",
            json={"prompt": "a", "n_predict": 2000, "ignore_eos": True, "stream": True},
            timeout=60,
        ) as stream:
            lines = stream.iter_lines()  # kept: a dropped iterator closes the stream (and cancels the task)
            next(lines)  # generating now
            r = wait_until(
                lambda: (r := HTTP.get(f"{u}/slots?fail_on_no_slot=1", timeout=10)).status_code == 503 and r,
                10,
                what="GET /slots?fail_on_no_slot=1 to see the busy slot",
            )
            assert r.json()["error"]["message"] == "no slot available"


# --------------------------------------------------------------------------- HTTP surface


def test_cors_localhost_only_and_preflight_without_api_key(url: str) -> None:
    pre = {"Access-Control-Request-Method": "POST"}
    ok = httpx.options(f"{url}/completion", headers={"Origin": "http://localhost:3000", **pre}, timeout=10)
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert ok.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    evil = httpx.options(
        f"{url}/completion", headers={"Origin": "http://localhost.evil.com", **pre}, timeout=10
    )
    assert evil.status_code == 200 and "access-control-allow-origin" not in evil.headers
    got = HTTP.get(f"{url}/health", headers={"Origin": "http://[::1]:8080"}, timeout=10)
    assert got.headers["access-control-allow-origin"] == "http://[::1]:8080"


def test_metrics_are_llama_servers(url: str) -> None:
    native(url, prompt="hello there", n_predict=4)
    r = HTTP.get(f"{url}/metrics", timeout=10)
    assert b"Process-Start-Time-Unix" in [k for k, _ in r.headers.raw]  # llama-server's casing
    text = r.text
    for name, kind in (
        ("llamacpp:prompt_tokens_total", "counter"),
        ("llamacpp:prompt_tokens_cached_total", "counter"),
        ("llamacpp:n_tokens_max", "counter"),
        ("llamacpp:predicted_tokens_seconds", "gauge"),
        ("llamacpp:n_busy_slots_per_decode", "gauge"),
    ):
        assert f"# TYPE {name} {kind}\n" in text and f"# HELP {name} " in text
    assert "omni:requests_total" in text
    # the throughput gauges cover the time since the last scrape: nothing ran since
    assert "\nllamacpp:predicted_tokens_seconds 0\n" in HTTP.get(f"{url}/metrics", timeout=10).text


def test_aliases_and_tags(url: str) -> None:
    card = HTTP.get(f"{url}/v1/models", timeout=10).json()["data"][0]
    assert (card["id"], card["aliases"], card["tags"]) == ("alpha", ["alpha", "zeta"], ["t1"])


def test_several_listen_addresses(tiny_models: ModelPaths) -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    with serve("-m", str(tiny_models.gguf_f32), "-c", "256", "-np", "1", host="127.0.0.1,::1") as u:
        port = u.rsplit(":", 1)[1]
        assert HTTP.get(f"http://[::1]:{port}/health", timeout=10).status_code == 200
        assert HTTP.get(f"{u}/health", timeout=10).status_code == 200


# --------------------------------------------------------------------------- chat


def _messages(*turns: tuple[str, object]) -> list[dict[str, object]]:
    return [{"role": role, "content": content} for role, content in turns]


def test_assistant_prefill_continues_the_last_message(url: str) -> None:
    body = {"max_tokens": 2, "messages": _messages(("user", "hi"), ("assistant", "Wh")), "verbose": True}
    r = post(url, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["__verbose"]["prompt"].endswith("<|im_start|>assistant\nWh")
    parts = [{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}]
    r = post(
        url, "/v1/chat/completions", {**body, "messages": _messages(("user", "hi"), ("assistant", parts))}
    )
    assert r.json()["__verbose"]["prompt"].endswith("<|im_start|>assistant\nWh\n\nill")
    explicit = {**body, "add_generation_prompt": False, "continue_final_message": True}
    assert post(url, "/v1/chat/completions", explicit).json()["__verbose"]["prompt"].endswith("assistant\nWh")
    plain = post(url, "/v1/chat/completions", {**body, "verbose": False}).json()
    assert "__verbose" not in plain


@pytest.mark.parametrize(("extra", "messages"), [
    ({"add_generation_prompt": True, "continue_final_message": True}, [("user", "hi"), ("assistant", "x")]),
    ({}, [("user", "hi"), ("assistant", "x"), ("assistant", "y")]),
])
def test_continuation_errors(url: str, extra: dict[str, object], messages: list[tuple[str, object]]) -> None:
    r = post(url, "/v1/chat/completions", {"max_tokens": 2, "messages": _messages(*messages), **extra})
    assert r.status_code == 400


def test_first_stream_chunk_has_null_content_and_progress(url: str) -> None:
    body = {"max_tokens": 2, "messages": _messages(("user", "a fairly long prompt " * 20)), "stream": True,
            "return_progress": True, "timings_per_token": True, "stream_options": {"include_usage": True}}
    with HTTP.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert len(progress) > 1 and progress[0]["processed"] == progress[0]["cache"]
    assert progress[-1]["processed"] == progress[-1]["total"]
    assert all(a["processed"] < b["processed"] for a, b in itertools.pairwise(progress))
    assert "timings" in events[-1] and events[-1]["choices"] == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/chat/completions/input_tokens", {"messages": [{"role": "user", "content": "Hello world"}]}),
        ("/v1/responses/input_tokens", {"input": "Hello world"}),
        (
            "/v1/messages/count_tokens",
            {"messages": [{"role": "user", "content": "Hello world"}], "system": "Be brief"},
        ),
    ],
)
def test_input_token_counts(url: str, path: str, body: object) -> None:
    r = post(url, path, body)
    assert r.status_code == 200, r.text
    assert r.json()["input_tokens"] > 2


# --------------------------------------------------------------------------- completion


def test_logit_bias_forms(url: str) -> None:
    base = native(url, prompt="the quick brown", n_predict=8)["content"]
    assert isinstance(base, str) and base
    word = base.split()[0] if base.split() else base
    ids = post(url, "/tokenize", {"content": word}).json()["tokens"]
    for bias in ([[word, False]], {word: -100}, [[t, None] for t in ids], {str(t): -100 for t in ids}):
        out = native(url, prompt="the quick brown", n_predict=8, logit_bias=bias)
        assert not set(ids) & set(post(url, "/tokenize", {"content": out["content"]}).json()["tokens"]) or \
            out["content"] != base, bias


def test_ignore_eos_echoes_the_banned_tokens(url: str) -> None:
    settings = native(url, prompt="hi", ignore_eos=True)["generation_settings"]
    assert settings["logit_bias"] and all(e["bias"] is None for e in settings["logit_bias"])  # type: ignore[index]
    assert native(url, prompt="hi")["generation_settings"]["logit_bias"] == []  # type: ignore[index]


def test_json_prompt_object(url: str) -> None:
    assert "content" in native(url, prompt={"prompt_string": "hello"})
    r = post(url, "/completion", {"prompt": {"prompt_string": "x <__media__>", "multimodal_data": ["AAAA"]}})
    assert r.status_code == 400


def test_request_n_predict_wins_over_the_server_default(tiny_models: ModelPaths) -> None:
    with serve("-m", str(tiny_models.gguf_f32), "-c", "512", "-np", "1", "-n", "3") as u:
        assert native(u, prompt="a", ignore_eos=True, n_predict=6)["tokens_predicted"] == 6
        r = post(u, "/completion", {"prompt": "a", "ignore_eos": True})
        assert r.json()["tokens_predicted"] == 3


def test_context_full_stops_at_n_ctx_and_says_truncated(tiny_models: ModelPaths) -> None:
    with serve("-m", str(tiny_models.gguf_f32), "-c", "256", "-np", "1") as u:
        n_ctx = HTTP.get(f"{u}/props", timeout=10).json()["default_generation_settings"]["n_ctx"]
        out = native(u, prompt="hello world", n_predict=-1, ignore_eos=True)
        assert out["tokens_evaluated"] + out["tokens_predicted"] == n_ctx  # type: ignore[operator]
        assert out["truncated"] is True and native(u, prompt="hello", n_predict=2)["truncated"] is False


def test_prompt_that_no_valid_pieces_add_up_to_does_not_hang(tiny_models: ModelPaths) -> None:
    """Regression: with flash attention a prompt of 64+ rows is cut in pieces of at least 64 rows,
    and `-b 64` allows at most 64: a 65..127-token prompt had no valid cut and its request hung
    forever (llama.cpp's test_return_progress). Pieces then fit the batch instead."""
    with serve("-m", str(tiny_models.gguf_f32), "-c", "512", "-np", "1", "-b", "64", "-fa", "on") as u:
        ids = post(u, "/tokenize", {"content": "This is a test " * 20}).json()["tokens"][:70]
        out = native(u, prompt=ids, n_predict=2)
        assert out["tokens_evaluated"] == 70 and out["tokens_predicted"] == 2


def test_cors_proxy_forwards_only_the_named_headers(tiny_models: ModelPaths, url: str) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    seen: dict[str, str] = {}

    class Capture(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.update({k.lower(): v for k, v in self.headers.items()})
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: object) -> None:
            pass

    target = ThreadingHTTPServer(("127.0.0.1", 0), Capture)
    Thread(target=target.serve_forever, daemon=True).start()
    try:
        proxy = f"/cors-proxy?url=http://127.0.0.1:{target.server_port}/x"
        assert HTTP.get(url + proxy, timeout=10).status_code == 403  # off by default
        with serve(
            "-m", str(tiny_models.gguf_f32), "-c", "256", "-np", "1", "--ui-mcp-proxy", "--api-key", "k"
        ) as u:
            r = HTTP.get(
                u + proxy,
                timeout=10,
                headers={
                    "Authorization": "Bearer k",
                    "Cookie": "s=1",
                    "X-Llama-Server-Proxy-Header-Authorization": "Bearer t",
                    "x-llama-server-proxy-header-accept": "application/json",
                },
            )
            assert r.status_code == 200 and r.text == "ok"
            assert (
                seen["authorization"] == "Bearer t"
                and seen["accept"] == "application/json"
                and "cookie" not in seen
            )
            assert HTTP.get(u + "/cors-proxy?url=file:///etc/passwd", headers={"X-Api-Key": "k"},
                             timeout=10).status_code == 400
    finally:
        target.shutdown()
        target.server_close()


def test_reasoning_off_sets_enable_thinking_a_request_overrides(tiny_models: ModelPaths) -> None:
    template = (
        "{% if enable_thinking is defined %}[think={{ enable_thinking }}]{% endif %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    msgs = [{"role": "user", "content": "hi"}]
    with serve(
        "-m", str(tiny_models.gguf_f32), "-c", "256", "-np", "1", "--chat-template", template, "-rea", "off"
    ) as u:
        assert post(u, "/apply-template", {"messages": msgs}).json()["prompt"] == "[think=False]hi"
        body = {"messages": msgs, "chat_template_kwargs": {"enable_thinking": True}}
        assert post(u, "/apply-template", body).json()["prompt"] == "[think=True]hi"
        # OpenAI's reasoning_effort: "none"/"minimal" turn thinking off, the others on (issue 26)
        for effort, on in (("none", False), ("minimal", False), ("low", True), ("high", True)):
            chat = post(u, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "verbose": True,
                                                   "reasoning_effort": effort}).json()
            assert chat["__verbose"]["prompt"].endswith(f"[think={on}]hi"), (effort, chat["__verbose"])


@pytest.mark.parametrize("backend", ["llama_cpp", "torch"])
def test_post_sampling_probs(tiny_models: ModelPaths, backend: str) -> None:
    model = tiny_models.gguf_f32 if backend == "llama_cpp" else tiny_models.hf_dir
    with serve("-m", str(model), "--backend", backend, "-c", "256", "-np", "1") as u:
        body = {"prompt": "the quick brown", "n_probs": 10, "n_predict": 5, "temperature": 1.0, "top_k": 5}
        out = native(u, **body, post_sampling_probs=True)
        for tok in out["completion_probabilities"]:  # type: ignore[attr-defined]
            top = tok["top_probs"]
            assert 0 < tok["prob"] <= 1 and 0 < len(top) <= 5  # top_k 5 leaves at most 5 candidates
            assert all(0 < p["prob"] <= 1 for p in top) and sum(p["prob"] for p in top) == pytest.approx(
                1.0, abs=1e-4
            )
            assert tok["id"] in [p["id"] for p in top]
        greedy = native(u, **{**body, "temperature": 0}, post_sampling_probs=True)["completion_probabilities"]
        assert all(t["prob"] == 1.0 for t in greedy)  # type: ignore[attr-defined]
        plain = native(u, **body)["completion_probabilities"][0]  # type: ignore[index]
        assert "logprob" in plain and "top_logprobs" in plain
