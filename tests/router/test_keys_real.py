"""Keys with limits against a real router and a real tiny-model worker, through the official
SDKs: a limited key sees only its models, gets 429 past its rate and the SDK's own retry then
succeeds; 20 streams from a key limited to 4 at once run at most 4 at a time and none is lost;
the usage counted per key in /metrics is the sum of the usage the answers reported."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from router.keys.keyfile import hash_key
from tests.router.conftest import RouterProc, fake_model, running_router
from tests.util import ROOT, preset_defaults, wait_until

try:  # the anthropic SDK's own http client package (older versions used httpx)
    import httpx2 as anthropic_http
except ImportError:
    anthropic_http = httpx  # type: ignore[no-redef,unused-ignore]
GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
pytestmark = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")
Factory = Callable[..., RouterProc]
ADMIN, RATE, ANTH, CONC, OLLA, TOK = "sk-admin", "sk-rate", "sk-anth", "sk-conc", "sk-olla", "sk-tok"
KEYS = f"""
[keys.root]
sha256 = "{hash_key(ADMIN)}"
role = "admin"

[keys.rate]
sha256 = "{hash_key(RATE)}"
models = ["tiny"]
rpm = 30

[keys.anth]
sha256 = "{hash_key(ANTH)}"
models = ["ti*"]
rpm = 30

[keys.olla]
sha256 = "{hash_key(OLLA)}"
models = ["tiny"]
rpm = 30

[keys.tok]
sha256 = "{hash_key(TOK)}"
models = ["tiny"]
tpm = 40

[keys.line]
sha256 = "{hash_key("sk-line")}"
models = ["tiny"]
concurrency = 1

[keys.conc]
sha256 = "{hash_key(CONC)}"
models = ["tiny"]
concurrency = 4
"""
PRESET = f"""{preset_defaults(1024)}
[models.tiny]
model = "{GGUF}"
backend = "llama_cpp"
parallel = 8
load-on-startup = true
pin = true

{fake_model("other")}"""


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProc]:
    """One router for the module: each test uses its own keys, so their buckets do not meet."""
    tmp = tmp_path_factory.mktemp("keys-real")
    (tmp / "keys.toml").write_text(KEYS)
    with running_router(
        tmp, PRESET, "--keys", str(tmp / "keys.toml"), headers={"Authorization": f"Bearer {ADMIN}"}
    ) as r:
        r.wait_status("tiny", "loaded", 60)
        yield r


def drain(r: RouterProc, key: dict[str, str]) -> httpx.Response:
    """Spend the key's rpm bucket on cheap requests (tokenize) until the router says 429."""
    with r.client() as c:
        for _ in range(200):
            resp = c.post("/tokenize", json={"model": "tiny", "content": "hi"}, headers=key)
            if resp.status_code == 429:
                return resp
            assert resp.status_code == 200, resp.text
    raise AssertionError("no 429 after 200 requests from a key with rpm = 30")


def refused_after_drain(r: RouterProc, key: dict[str, str], attempt: Callable[[], bool]) -> None:
    """Drain the key's bucket, then `attempt()` (True: the router refused it, as it should). On
    a loaded box the bucket may refill between the two (a request every 2 s): then again."""
    for _ in range(3):
        drain(r, key)
        if attempt():
            return
    raise AssertionError("a request right after the key's bucket was drained got in, three times")


def raises(exc: type[Exception], call: Callable[[], object]) -> bool:
    try:
        call()
    except exc:
        return True
    return False


def statuses(log: list[int], module: Any = httpx) -> Any:
    """An http client (httpx's, or httpx2's: the anthropic SDK's) that logs each response's status."""
    return module.Client(event_hooks={"response": [lambda resp: log.append(resp.status_code)]})


def test_the_openai_sdk_sees_its_models_gets_429_past_the_rate_and_its_retry_succeeds(
    router: RouterProc,
) -> None:
    plain = openai.OpenAI(base_url=f"{router.base}/v1", api_key=RATE, max_retries=0)
    assert [m.id for m in plain.models.list()] == ["tiny"]
    with router.client() as c:  # a worker's own /props: its file's path for admin keys only
        assert (
            "model_path" not in c.get("/props?model=tiny", headers={"Authorization": f"Bearer {RATE}"}).json()
        )
        assert c.get("/props?model=tiny", headers=router.headers).json()["model_path"].endswith(GGUF.name)
    with pytest.raises(openai.NotFoundError):
        plain.chat.completions.create(
            model="other", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    resp = drain(router, {"Authorization": f"Bearer {RATE}"})
    err = resp.json()["error"]
    assert (
        err["type"] == "rate_limit_error"
        and err["code"] == "rate_limit_exceeded"
        and "'rate'" in err["message"]
    )
    assert 1 <= int(resp.headers["retry-after"]) <= 2 and 0 < int(resp.headers["retry-after-ms"]) <= 2000
    msgs: Any = [{"role": "user", "content": "hi"}]
    refused_after_drain(
        router,
        {"Authorization": f"Bearer {RATE}"},
        lambda: raises(
            openai.RateLimitError,
            lambda: plain.chat.completions.create(model="tiny", messages=msgs, max_tokens=2),
        ),
    )
    seen: list[int] = []
    retrying = openai.OpenAI(
        base_url=f"{router.base}/v1", api_key=RATE, max_retries=3, http_client=statuses(seen)
    )
    answers: list[Any] = []

    def retried() -> bool:
        seen.clear()
        answers.append(retrying.chat.completions.create(model="tiny", messages=msgs, max_tokens=2))
        return seen[0] == 429

    refused_after_drain(router, {"Authorization": f"Bearer {RATE}"}, retried)
    out = answers[-1]
    assert out.choices[0].finish_reason in ("stop", "length")
    assert seen[0] == 429 and seen[-1] == 200  # refused first, then the SDK's own retry got in


def test_the_anthropic_sdk_sees_its_models_gets_429_past_the_rate_and_its_retry_succeeds(
    router: RouterProc,
) -> None:
    plain = anthropic.Anthropic(base_url=router.base, api_key=ANTH, max_retries=0)
    assert [m.id for m in plain.models.list()] == ["tiny"]
    msgs: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError):
        plain.messages.create(model="other", max_tokens=2, messages=msgs)
    errors: list[anthropic.RateLimitError] = []

    def refused() -> bool:
        try:
            plain.messages.create(model="tiny", max_tokens=2, messages=msgs)
        except anthropic.RateLimitError as e:
            errors.append(e)
            return True
        return False

    refused_after_drain(router, {"x-api-key": ANTH}, refused)
    assert errors[-1].response.headers["retry-after"] in ("1", "2")
    seen: list[int] = []
    retrying = anthropic.Anthropic(
        base_url=router.base, api_key=ANTH, max_retries=3, http_client=statuses(seen, anthropic_http)
    )
    answers: list[Any] = []

    def retried() -> bool:
        seen.clear()
        answers.append(retrying.messages.create(model="tiny", max_tokens=2, messages=msgs))
        return seen[0] == 429

    refused_after_drain(router, {"x-api-key": ANTH}, retried)
    out = answers[-1]
    assert out.stop_reason in ("end_turn", "max_tokens")
    assert seen[0] == 429 and seen[-1] == 200


def test_the_ollama_sdk_sees_its_models_and_gets_429_past_the_rate(router: RouterProc) -> None:
    """The ollama client has no retry logic of its own: it raises the 429, and a retry after the
    Retry-After the router sent gets in."""
    client = ollama.Client(host=router.base, headers={"Authorization": f"Bearer {OLLA}"})
    assert [m.model for m in client.list().models] == ["tiny:latest"]
    assert [m.model for m in client.ps().models] == ["tiny:latest"]
    assert "FROM tiny" in client.show("tiny").modelfile  # the model's name, not its file's path
    for call in (lambda: client.show("other"), lambda: client.chat(model="other", messages=[])):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 404
    msgs = [{"role": "user", "content": "hi"}]
    errors: list[ollama.ResponseError] = []

    def refused() -> bool:
        try:
            client.chat(model="tiny", messages=msgs, options={"num_predict": 2})
        except ollama.ResponseError as e:
            errors.append(e)
            return True
        return False

    refused_after_drain(router, {"Authorization": f"Bearer {OLLA}"}, refused)
    assert errors[-1].status_code == 429 and "over its requests per minute" in errors[-1].error

    def retried() -> bool:
        try:
            return bool(client.chat(model="tiny", messages=msgs, options={"num_predict": 2}).done)
        except ollama.ResponseError as err:
            assert err.status_code == 429
            return False

    wait_until(retried, 5, interval=0.25, what="the rpm bucket to let one more request in")


def test_a_key_past_its_tokens_per_minute_gets_429_counted_from_the_answers_usage(router: RouterProc) -> None:
    client = openai.OpenAI(base_url=f"{router.base}/v1", api_key=TOK, max_retries=0)
    msgs: Any = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(  # one answer larger than the key's minute of tokens
        model="tiny", messages=msgs, max_tokens=48, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.total_tokens > 40
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1)
    assert "over its tokens per minute (40)" in e.value.message
    # the debt (total - 40 tokens) at 40 a minute: the key waits that long, and is told so
    wait_s = (out.usage.total_tokens - 40) * 60 / 40
    assert int(e.value.response.headers["retry-after"]) == pytest.approx(wait_s, abs=2)


def test_requests_that_waited_in_line_reach_the_translated_apis_whole(router: RouterProc) -> None:
    """The body read while a request waits at its key's gate is replayed to the app: Anthropic's
    and the Responses API's routes (Starlette) get it as the proxy does."""
    out: list[str] = []
    together = threading.Barrier(4)  # sent at once: three of them wait (concurrency 1)

    def anthropic_call(stream: bool) -> None:
        client = anthropic.Anthropic(base_url=router.base, api_key="sk-line", max_retries=0)
        msgs: Any = [{"role": "user", "content": "hi"}]
        together.wait(30)
        if stream:
            with client.messages.stream(model="tiny", max_tokens=8, messages=msgs) as s:
                out.append(s.get_final_message().stop_reason or "")
        else:
            out.append(client.messages.create(model="tiny", max_tokens=8, messages=msgs).stop_reason or "")

    def responses_call() -> None:
        client = openai.OpenAI(base_url=f"{router.base}/v1", api_key="sk-line", max_retries=0)
        together.wait(30)
        out.append(client.responses.create(model="tiny", input="hi", max_output_tokens=8).status or "")

    threads = [threading.Thread(target=anthropic_call, args=(s,)) for s in (True, False, True)]
    threads.append(threading.Thread(target=responses_call))
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(out) == 4 and all(out), out


def key_usage(text: str, key: str) -> dict[str, float]:
    """omni_router:key_* samples of `key` on model tiny from a /metrics scrape."""
    out = {}
    for name in ("requests", "prompt_tokens", "completion_tokens"):
        m = re.search(rf'^omni_router:key_{name}_total\{{key="{key}",model="tiny"\}} (\S+)$', text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    return out


def test_twenty_streams_from_a_key_limited_to_four_run_four_at_a_time_and_usage_adds_up(
    router: RouterProc,
) -> None:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    results: list[tuple[int, dict[str, Any] | None, bool]] = []
    lock = threading.Lock()
    running = threading.Event()
    together = threading.Barrier(20)  # all 20 are sent at once, whatever the box's load

    def one(i: int) -> None:
        client = openai.OpenAI(base_url=f"{router.base}/v1", api_key=CONC, max_retries=0)
        together.wait(60)
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"count {i}"}],
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},  # each runs its 24 tokens: the streams overlap
        )
        usage, finished = None, False
        for chunk in stream:
            running.set()
            if chunk.choices and chunk.choices[0].finish_reason:
                finished = True
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
        with lock:
            results.append((i, usage, finished))

    peak = 0
    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=router.base, headers=admin, timeout=10) as c:
        assert running.wait(60)
        while any(t.is_alive() for t in threads):
            m = re.search(
                r'^omni_router:requests_in_flight\{model="tiny"\} (\S+)$', c.get("/metrics").text, re.M
            )
            usage = {u["key"]: u for u in c.get("/keys/usage").json()["data"]}["conc"]
            peak = max(peak, int(float(m.group(1))) if m else 0, usage["active"])
            assert usage["active"] <= 4 and (m is None or float(m.group(1)) <= 4)
        for t in threads:
            t.join(60)
        assert len(results) == 20 and all(u is not None and done for _, u, done in results)  # none lost
        assert peak == 4  # they did overlap, four at a time
        want = {
            "requests": 20.0,
            "prompt_tokens": float(sum(u["prompt_tokens"] for _, u, _ in results if u)),
            "completion_tokens": float(sum(u["completion_tokens"] for _, u, _ in results if u)),
        }
        assert key_usage(c.get("/metrics").text, "conc") == want
        as_json = {u["key"]: u for u in c.get("/keys/usage").json()["data"]}["conc"]
        assert as_json["models"]["tiny"] == {k: int(v) for k, v in want.items()}
        assert json.dumps(as_json["limits"]) == json.dumps({"rpm": None, "tpm": None, "concurrency": 4})
