"""Ollama's API end to end: the official `ollama` package, unmodified, against a real router with
real workers on the tiny models (llama.cpp), and request bodies replayed from Open WebUI, Home
Assistant and Continue (tests/router/fixtures/ollama/, each file names the source it follows).

One router serves the module, with `--api-key` (the client sends it as a Bearer header, as Home
Assistant does): `tiny` (text), `coder` (the tiny model with fill-in-the-middle tokens), `vlm`
(the tiny SmolVLM with its projector) and `embed` (the tiny model as an embedding model). The
tiny models have random weights: the tests assert on shapes, on what the grammar guarantees and
on equalities (greedy through two APIs), never on free text.
"""

from __future__ import annotations

import base64
import json
import math
import os
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import ollama
import pytest

from tests.router.conftest import PY
from tests.util import ROOT, free_port, preset_defaults, stop_process, wait_healthy, wait_until
from worker.testing.tiny_models import write_fim_variant
from worker.testing.tiny_vlm import VlmPaths, ensure_vlm, png

GGUF = ROOT / "models" / "tiny-llama-f32.gguf"
FIXTURES = Path(__file__).with_name("fixtures") / "ollama"
pytestmark = pytest.mark.skipif(not GGUF.exists(), reason="tiny models not generated (make models)")
KEY = "sk-ollama"
AUTH = {"Authorization": f"Bearer {KEY}"}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
GREEDY = {"temperature": 0, "num_predict": 12}
THINK_TEMPLATE = (  # the tiny model, made to think: the assistant's turn opens a <think> block
    "{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
MODELS = {"chat": "tiny", "fim": "coder", "vision": "vlm", "embed": "embed"}


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("ollama")
    vlm: VlmPaths = ensure_vlm(ROOT / "models")
    coder = tmp / "tiny-fim.gguf"
    write_fim_variant(coder)
    think = tmp / "think.jinja"
    think.write_text(THINK_TEMPLATE)
    preset = tmp / "preset.toml"
    preset.write_text(f"""
{preset_defaults(4096)}
[models.tiny]
model = "{GGUF}"
backend = "llama_cpp"

[models.tiny-terse]
variant-of = "tiny"
temp = 0
system-prompt = "Answer in one word."

[models.coder]
model = "{coder}"
backend = "llama_cpp"

[models.vlm]
model = "{vlm.gguf}"
mmproj = "{vlm.mmproj}"
backend = "llama_cpp"

[models.thinker]
model = "{GGUF}"
backend = "llama_cpp"
chat-template = "{think}"

[models.embed]
model = "{GGUF}"
backend = "llama_cpp"
embedding = true
pooling = "mean"
""")
    port = free_port()
    log_path = tmp / "router.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_STATE_HOME": str(tmp / "state")}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [PY, "-m", "router.cli", "--preset", str(preset), "--port", str(port), "--api-key", KEY],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, 30, lambda: log_path.read_text(errors="replace")[-3000:])
        yield base, log_path
    finally:
        stop_process(proc)


@pytest.fixture(scope="module")
def client(router: tuple[str, Path]) -> ollama.Client:
    return ollama.Client(host=router[0], headers=AUTH, timeout=120)


def _ps_names(client: ollama.Client) -> set[str]:
    return {m.model or "" for m in client.ps().models}


def test_root_version_list_show_and_ps(router: tuple[str, Path], client: ollama.Client) -> None:
    base = router[0]
    r = httpx.get(base + "/")  # no key needed, as Ollama's clients probe it
    assert (
        r.status_code == 200
        and r.text == "Ollama is running"
        and r.headers["content-type"].startswith("text/plain")
    )
    if (ROOT / "webui" / "index.html").exists():  # a browser still gets the web UI
        page = httpx.get(base + "/", headers={"accept": "text/html,application/xhtml+xml"})
        assert page.status_code == 200 and "Ollama is running" not in page.text
    assert httpx.get(base + "/api/version", headers=AUTH).json()["version"].count(".") == 2

    listed = {m.model: m for m in client.list().models}
    assert list(listed) == [  # a variant right after its base, with its base's file
        "tiny:latest", "tiny-terse:latest", "coder:latest", "vlm:latest", "thinker:latest", "embed:latest"]
    assert listed["tiny-terse:latest"].digest == listed["tiny:latest"].digest
    tiny = listed["tiny:latest"]
    assert tiny.size == GGUF.stat().st_size and len(tiny.digest or "") == 64
    assert tiny.details is not None and tiny.details.format == "gguf" and tiny.details.family == "llama"
    assert tiny.details.quantization_level == "F32"

    shown = client.show("tiny:latest")  # `name:latest` is `name`
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "llama"
    assert "llama.context_length" in shown.modelinfo
    assert shown.parameters is not None and "num_ctx 2048" in shown.parameters.splitlines()  # per slot
    assert shown.template and shown.capabilities is not None and "completion" in shown.capabilities
    assert "insert" not in shown.capabilities and "vision" not in shown.capabilities
    coder = client.show("coder")
    assert coder.capabilities is not None and "insert" in coder.capabilities
    assert coder.template is not None and ".Suffix" in coder.template  # what Continue looks for
    vision = client.show("vlm").capabilities
    assert vision is not None and "vision" in vision
    assert client.show("embed").capabilities == ["embedding"]
    older = httpx.post(base + "/api/show", headers=AUTH, json={"name": "tiny", "verbose": True}).json()
    assert older["model_info"]["tokenizer.ggml.tokens"][:1] and older["details"] == shown.details.model_dump()

    client.generate(model="tiny", prompt="")  # an empty prompt loads the model
    ps = {m.model: m for m in client.ps().models}
    assert "tiny:latest" in ps
    loaded = ps["tiny:latest"]
    assert (loaded.size or 0) > 0 and loaded.size_vram == 0 and loaded.expires_at is not None
    assert loaded.details is not None and loaded.details.family == "llama"
    assert client.show("tiny").parameters == shown.parameters  # the loaded worker says the same


def test_a_variant_answers_with_its_defaults_on_its_base_worker(client: ollama.Client) -> None:
    question = [{"role": "user", "content": "Name a colour."}]
    terse = client.chat(model="tiny-terse", messages=question, options={"num_predict": 8})
    system = [{"role": "system", "content": "Answer in one word."}]
    base = client.chat(model="tiny", messages=system + question, options={"temperature": 0, "num_predict": 8})
    assert terse.message.content == base.message.content and terse.model == "tiny-terse"


def test_chat_and_generate_streamed_and_whole(client: ollama.Client) -> None:
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    whole = client.chat(model="tiny", messages=messages, options=GREEDY, stream=False)
    assert whole.done and whole.done_reason in ("stop", "length")
    assert whole.message.role == "assistant" and isinstance(whole.message.content, str)
    assert 0 < (whole.eval_count or 0) <= 12 and (whole.prompt_eval_count or 0) > 0
    assert (whole.total_duration or 0) >= (whole.eval_duration or 0) > 0
    assert (whole.prompt_eval_duration or 0) > 0 and (whole.load_duration or 0) >= 0

    parts = list(client.chat(model="tiny", messages=messages, options=GREEDY, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content or "" for p in parts) == whole.message.content  # greedy: the same answer
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason

    gen = client.generate(model="tiny", prompt="Tell me about the sea.", system="Be brief.", options=GREEDY)
    assert gen.done and isinstance(gen.response, str) and (gen.eval_count or 0) > 0
    streamed = list(
        client.generate(
            model="tiny", prompt="Tell me about the sea.", system="Be brief.", options=GREEDY, stream=True
        )
    )
    assert "".join(p.response or "" for p in streamed) == gen.response and streamed[-1].done

    raw = client.generate(
        model="tiny", prompt="Once upon a time", raw=True, options={**GREEDY, "stop": ["\n"]}
    )
    assert raw.done and "\n" not in (raw.response or "")
    capped = client.generate(
        model="tiny",
        prompt="Once upon a time",
        raw=True,
        options={
            "num_predict": 3,
            "temperature": 0,
            "num_ctx": 512,
            "seed": 7,
            "top_k": 5,
            "top_p": 0.9,
            "min_p": 0.01,
            "repeat_penalty": 1.1,
            "repeat_last_n": 16,
            "presence_penalty": 0.1,
            "frequency_penalty": 0.1,
            "num_keep": 4,
        },
    )
    assert capped.eval_count == 3 and capped.done_reason == "length"


def test_logprobs_of_each_token(client: ollama.Client) -> None:
    r = client.chat(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        logprobs=True,
        top_logprobs=2,
        options={"num_predict": 4, "temperature": 0},
    )
    assert r.logprobs is not None and len(r.logprobs) == r.eval_count == 4
    assert all(lp.logprob <= 0 and len(lp.top_logprobs or []) == 2 for lp in r.logprobs)
    assert "".join(lp.token for lp in r.logprobs) == r.message.content
    parts = list(
        client.generate(
            model="tiny",
            prompt="hi",
            logprobs=True,
            stream=True,
            options={"num_predict": 4, "temperature": 0},
        )
    )
    assert sum(len(p.logprobs or []) for p in parts) == 4
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="tiny", prompt="hi", raw=True, logprobs=True)
    assert e.value.status_code == 400 and "logprobs" in e.value.error


def test_greedy_chat_equals_openai_chat_completions(router: tuple[str, Path], client: ollama.Client) -> None:
    messages = [{"role": "system", "content": "You answer."}, {"role": "user", "content": "Name a colour."}]
    ours = client.chat(model="tiny", messages=messages, options={"temperature": 0, "num_predict": 16})
    openai = httpx.post(
        router[0] + "/v1/chat/completions",
        headers=AUTH,
        timeout=60,
        json={"model": "tiny", "messages": messages, "temperature": 0, "max_tokens": 16},
    ).json()
    assert ours.message.content == openai["choices"][0]["message"]["content"]
    assert ours.eval_count == openai["usage"]["completion_tokens"]
    assert ours.prompt_eval_count == openai["usage"]["prompt_tokens"]


def test_format_schema_is_enforced(client: ollama.Client) -> None:
    r = client.chat(
        model="tiny",
        messages=[{"role": "user", "content": "Weather?"}],
        format=SCHEMA,
        options={"num_predict": 48, "seed": 3},
    )
    jsonschema.validate(json.loads(r.message.content or ""), SCHEMA)
    g = client.generate(model="tiny", prompt="Weather?", format=SCHEMA, options={"num_predict": 48})
    jsonschema.validate(json.loads(g.response or ""), SCHEMA)


def test_tools_and_tool_history_reach_the_model(client: ollama.Client) -> None:
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": SCHEMA},
    }
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}],
        },
        {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
    ]
    r = client.chat(model="tiny", messages=history, tools=[tool], options={"num_predict": 8})
    assert r.done and r.message.role == "assistant"
    for call in r.message.tool_calls or []:  # random weights: a call only if the model makes one
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)


def test_think_separates_the_reasoning(client: ollama.Client) -> None:
    assert "thinking" in (client.show("thinker").capabilities or [])
    assert "thinking" not in (client.show("tiny").capabilities or [])
    r = client.chat(
        model="thinker",
        messages=[{"role": "user", "content": "hi"}],
        think=True,
        options={"num_predict": 6, "temperature": 0},
    )
    assert r.message.thinking and r.eval_count == 6  # random weights never close the block: all reasoning
    g = list(
        client.generate(model="thinker", prompt="hi", think="high", stream=True, options={"num_predict": 6})
    )
    assert "".join(p.thinking or "" for p in g) and g[-1].done


def test_images_on_the_tiny_vlm(client: ollama.Client) -> None:
    image = png(32, 32, seed=1)
    r = client.chat(
        model="vlm",
        messages=[{"role": "user", "content": "What is this?", "images": [image]}],
        options={"num_predict": 4, "temperature": 0},
    )
    assert r.done and (r.prompt_eval_count or 0) > 20  # the image's tokens are in the prompt
    g = client.generate(
        model="vlm",
        prompt="What is this?",
        images=[base64.b64encode(image).decode()],
        options={"num_predict": 4, "temperature": 0},
    )
    assert g.done and (g.prompt_eval_count or 0) > 20
    with pytest.raises(ollama.ResponseError) as e:  # a text-only model refuses the image, 400
        client.chat(model="tiny", messages=[{"role": "user", "content": "?", "images": [image]}])
    assert e.value.status_code == 400


def test_suffix_fills_in_the_middle(client: ollama.Client) -> None:
    r = client.generate(
        model="coder",
        prompt="def add(a, b):\n",
        suffix="\nprint(add(1, 2))\n",
        options={"num_predict": 3, "temperature": 0},
    )
    assert r.done and r.eval_count == 3 and r.done_reason == "length" and (r.prompt_eval_count or 0) > 3
    with pytest.raises(ollama.ResponseError) as e:  # no FIM tokens: llama-server's 501
        client.generate(model="tiny", prompt="def add(a, b):\n", suffix="\n")
    assert e.value.status_code == 501 and "Infill is not supported" in e.value.error


def test_embed_and_embeddings(client: ollama.Client) -> None:
    r = client.embed(model="embed", input=["first", "second text"], keep_alive="10m")
    assert len(r.embeddings) == 2 and len(r.embeddings[0]) == len(r.embeddings[1]) > 4
    assert (r.prompt_eval_count or 0) > 0 and (r.total_duration or 0) > 0
    short = client.embed(model="embed", input="first", dimensions=4)
    assert len(short.embeddings[0]) == 4 and math.isclose(
        sum(x * x for x in short.embeddings[0]), 1.0, rel_tol=1e-5
    )
    old = client.embeddings(model="embed", prompt="first", keep_alive="10m")
    assert old.embedding == pytest.approx(r.embeddings[0], abs=1e-6)
    long_text = "word " * 3000  # more tokens than the context (and one batch)
    with pytest.raises(ollama.ResponseError) as e:
        client.embed(model="embed", input=long_text, truncate=False)
    assert e.value.status_code == 400
    cut = client.embed(model="embed", input=long_text)  # truncate (the default): its first tokens
    assert len(cut.embeddings) == 1 and len(cut.embeddings[0]) == len(r.embeddings[0])
    for call in (
        lambda: client.embed(model="embed", input="x", options={"temperature": 1}),
        lambda: client.embeddings(model="embed", prompt="x", options={"temperature": 1}),
    ):
        with pytest.raises(ollama.ResponseError) as e:  # options that cannot apply are refused, not ignored
            call()
        assert e.value.status_code == 400 and "temperature" in e.value.error


def test_keep_alive_sets_the_idle_unload_and_0_unloads(client: ollama.Client) -> None:
    client.chat(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        options={"num_predict": 1},
        keep_alive="5m",
    )
    expires = {m.model: m.expires_at for m in client.ps().models}["tiny:latest"]
    assert expires is not None
    left = (expires - datetime.now(UTC)).total_seconds()
    assert 240 < left <= 300
    client.generate(model="tiny", prompt="", keep_alive=-1)
    forever = {m.model: m.expires_at for m in client.ps().models}["tiny:latest"]
    assert forever is not None and forever.year > 2300
    done = client.generate(model="tiny", prompt="", keep_alive=0)
    assert done.done_reason == "unload"
    wait_until(lambda: "tiny:latest" not in _ps_names(client), 30, what="tiny to leave ps")
    assert client.chat(model="tiny", messages=[], keep_alive="1h").done_reason == "load"
    assert "tiny:latest" in _ps_names(client)


def test_errors_are_ollamas(router: tuple[str, Path], client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and e.value.error == "model 'nope' not found"
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="tiny", prompt="hi", options={"num_gpu": 1})
    assert e.value.status_code == 400 and "num_gpu" in e.value.error and "preset" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="tiny", prompt="hi", keep_alive="soon")
    assert e.value.status_code == 400 and "keep_alive" in e.value.error
    # an option at its off value is dropped, as on the other APIs
    assert client.generate(
        model="tiny", prompt="hi", options={"num_predict": 1, "mirostat": 0, "typical_p": 1.0}
    ).done
    for call, words in (
        (lambda: client.delete("tiny"), "preset"),
        (lambda: client.copy(source="tiny", destination="t2"), "aliases"),
        (lambda: client.push("tiny"), "push"),
        (lambda: client.create("x", from_="tiny"), "preset"),
    ):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 400 and words in e.value.error
    gone = httpx.request("DELETE", router[0] + "/api/delete", headers=AUTH, json={"name": "nope"})
    assert gone.status_code == 404 and gone.json() == {"error": "model 'nope' not found"}
    r = httpx.get(router[0] + "/api/tags")  # no key
    assert r.status_code == 401 and isinstance(r.json()["error"], str)


def test_unknown_routes_are_logged_once_with_the_user_agent(router: tuple[str, Path]) -> None:
    base, log_path = router
    for _ in range(2):
        assert (
            httpx.get(base + "/api/unheard-of", headers={**AUTH, "user-agent": "probe/1.0"}).status_code
            == 404
        )
    wait_until(lambda: "/api/unheard-of" in log_path.read_text(), 10, what="the unknown route's log line")
    lines = [ln for ln in log_path.read_text().splitlines() if "/api/unheard-of" in ln]
    assert len(lines) == 1 and "probe/1.0" in lines[0] and "GET" in lines[0]


def _replays() -> list[Any]:
    out = []
    for path in sorted(FIXTURES.glob("*.json")):
        for req in json.loads(path.read_text())["requests"]:
            out.append(pytest.param(req, id=f"{path.stem}: {req['name']}"))
    return out


@pytest.mark.parametrize("req", _replays())
def test_replayed_client_bodies(router: tuple[str, Path], req: dict[str, Any]) -> None:
    model = MODELS[req["model"]]
    text = json.dumps(req["body"]).replace('"MODEL"', json.dumps(model))
    text = text.replace("PNG_BASE64", base64.b64encode(png(32, 32, seed=2)).decode())
    r = httpx.request(req["method"], router[0] + req["path"], headers=AUTH, content=text, timeout=120)
    assert r.status_code == req.get("status", 200), r.text
    if r.status_code != 200:
        assert req["error"] in r.json()["error"]
        return
    objs = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    assert objs and "error" not in objs[-1]
    if req["path"] in ("/api/chat", "/api/generate"):
        assert objs[-1]["done"] is True and objs[-1]["eval_count"] >= 0
        assert len(objs) == 1 or req["body"].get("stream") is not False
    if req.get("schema"):
        text = "".join(o["message"]["content"] for o in objs)
        jsonschema.validate(json.loads(text), req["body"]["format"])
