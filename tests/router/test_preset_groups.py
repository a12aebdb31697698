"""Presets: groups ([groups.NAME] / [group:NAME]), variants (variant-of) and the scheduler's keys;
errors name the key path. Request defaults written into bodies (router/variants.py): tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from router import variants
from router.presets import GroupRule, PresetError, load_presets


def write(tmp_path: Path, text: str, suffix: str = ".toml") -> Path:
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    p = tmp_path / f"p{suffix}"
    p.write_text(text.replace("{m}", str(tmp_path / "m.gguf")))
    return p


TOML = """
[defaults]
ctx-size = 512
[models.a]
model = "{m}"
priority = 2
concurrency-limit = 3
load-delay = 1.5
[models.b]
model = "{m}"
[models.c]
model = "{m}"
system-prompt = "Be brief."
[models.precise]
variant-of = "a"
temp = 0
n-predict = 16
system-prompt = "You are precise."
chat-template-kwargs = { enable_thinking = false }
reasoning-budget = 64
alias = ["exact"]
[models.loose]
variant-of = "c"
top-k = 80
[groups.pair]
members = ["a", "b"]
[groups.keep]
members = ["c"]
swap = false
exclusive = false
persistent = true
"""

INI = """
[*]
c = 512
[a]
model = {m}
[b]
model = {m}
[precise]
variant-of = a
temp = 0
system-prompt = You are precise.
chat-template-kwargs = {"enable_thinking": false}
[group:pair]
members = a, b
exclusive = false
"""


def test_toml_groups_variants_and_scheduler_keys(tmp_path: Path) -> None:
    a, b, c, precise, loose = load_presets(write(tmp_path, TOML))
    assert a.group == b.group == GroupRule("pair") and c.group == GroupRule("keep", False, False, True)
    assert (a.priority, a.concurrency_limit, a.load_delay) == (2, 3, 1.5) and b.priority == 0
    assert a.ctx_size == 512 and precise.ctx_size is None  # [defaults] configure workers, not variants
    assert precise.variant_of == "a" and precise.model is None and precise.aliases == ("exact",)
    assert precise.request_defaults.view() == {
        "temperature": 0.0,
        "n_predict": 16,
        "thinking_budget_tokens": 64,
        "system_prompt": "You are precise.",
        "chat_template_kwargs": {"enable_thinking": False},
    }
    # on top of its base's router-side defaults
    assert loose.request_defaults.view() == {"top_k": 80, "system_prompt": "Be brief."}
    assert c.request_defaults.view() == {"system_prompt": "Be brief."} and not a.request_defaults


def test_ini_group_section_and_variant(tmp_path: Path) -> None:
    a, b, precise = load_presets(write(tmp_path, INI, ".ini"))
    assert a.group == b.group == GroupRule("pair", exclusive=False)
    assert precise.request_defaults.view() == {
        "temperature": 0.0,
        "system_prompt": "You are precise.",
        "chat_template_kwargs": {"enable_thinking": False},
    }


M = '[models.a]\nmodel = "{m}"\n'
ERRORS = [
    (
        M + '[models.v]\nvariant-of = "a"\nctx-size = 9\n',
        r"models\.v\.ctx-size: 'ctx-size' cannot be applied per request: a variant is served by its base",
    ),
    (
        M + '[models.v]\nvariant-of = "a"\nflash-attn = "on"\n',
        r"models\.v\.flash-attn: 'flash-attn' cannot be",
    ),
    (
        M + '[models.v]\nvariant-of = "nope"\n',
        r"models\.v\.variant-of: 'nope' is not a model of this preset file",
    ),
    (
        M + '[models.v]\nvariant-of = "a"\n[models.w]\nvariant-of = "v"\n',
        r"models\.w\.variant-of: 'v' is a variant",
    ),
    (
        M + '[models.v]\nvariant-of = "a"\nlora-scale = "0=0.5"\n',
        r"models\.v\.lora-scale: 'a': no LoRA adapter",
    ),
    (M + '[models.v]\nvariant-of = "a"\ntemp = -1\n', r"models\.v\.temp: invalid value '-1' for 'temp'"),
    (M + '[groups.g]\nmembers = ["a", "x"]\n', r"groups\.g\.members: 'x' is not a model of this preset file"),
    (M + "[groups.g]\nswap = true\n", r"groups\.g: missing key 'members'"),
    (
        M + '[groups.g]\nmembers = ["a"]\nswapp = true\n',
        r"groups\.g\.swapp: unknown group key 'swapp'; did you "
        r"mean 'swap'\?",
    ),
    (
        M + '[groups.g]\nmembers = ["a"]\npersistent = "maybe"\n',
        r"groups\.g\.persistent: invalid value 'maybe'",
    ),
    (
        M + '[groups.g]\nmembers = ["a"]\n[groups.h]\nmembers = ["a"]\n',
        r"groups\.h\.members: 'a' is already a member of group 'g'",
    ),
    (
        M + '[models.v]\nvariant-of = "a"\n[groups.g]\nmembers = ["v"]\n',
        r"groups\.g\.members: 'v' is a variant of 'a'",
    ),
    (
        M + 'priority = "high"\n',
        r"models\.a\.priority: invalid value 'high' for 'priority': expected an integer",
    ),
    (M + "concurrency-limit = 0\n", r"models\.a\.concurrency-limit: invalid value '0'"),
    (M + 'chat-template-kwargs = "x"\n', r"models\.a\.chat-template-kwargs: invalid value 'x'"),
]


@pytest.mark.parametrize(("text", "message"), ERRORS)
def test_errors_name_the_key_path(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(PresetError, match=message):
        load_presets(write(tmp_path, text))


def test_ini_errors_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(PresetError, match=r"p\.ini:4 \[group:g\]: missing key 'members'|p\.ini:4"):
        load_presets(write(tmp_path, "[a]\nmodel = {m}\n\n[group:g]\nswap = true\n", ".ini"))


D = variants.build(
    {"temp": "0.0", "n-predict": "8", "reasoning-format": "none", "reasoning": "off"},
    system_prompt="SYS",
    template_kwargs={"x": 1},
    reasoning_budget=None,
    lora_scale=((0, 0.5),),
)
USER = [{"role": "user", "content": "hi"}]
APPLY: list[tuple[str, dict[str, Any], str, dict[str, Any]]] = [
    (
        "chat: every default under the request's own",
        {"messages": USER, "temperature": 0.7},
        "/v1/chat/completions",
        {
            "messages": [{"role": "system", "content": "SYS"}, *USER],
            "temperature": 0.7,
            "n_predict": 8,
            "reasoning_format": "none",
            "lora": [{"id": 0, "scale": 0.5}],
            "chat_template_kwargs": {"x": 1, "enable_thinking": False},
        },
    ),
    (
        "a system message of its own: none added",
        {
            "messages": [{"role": "system", "content": "mine"}, *USER],
            "max_tokens": 3,
            "chat_template_kwargs": {"x": 2},
        },
        "/v1/chat/completions",
        {
            "messages": [{"role": "system", "content": "mine"}, *USER],
            "max_tokens": 3,
            "temperature": 0.0,
            "reasoning_format": "none",
            "lora": [{"id": 0, "scale": 0.5}],
            "chat_template_kwargs": {"x": 2, "enable_thinking": False},
        },
    ),
    (
        "text completion: sampling only",
        {"prompt": "p"},
        "/v1/completions",
        {"prompt": "p", "temperature": 0.0, "n_predict": 8, "lora": [{"id": 0, "scale": 0.5}]},
    ),
    ("embeddings: untouched", {"input": "p"}, "/v1/embeddings", {"input": "p"}),
]


@pytest.mark.parametrize(("body", "path", "expected"), [c[1:] for c in APPLY], ids=[c[0] for c in APPLY])
def test_apply_defaults(body: dict[str, Any], path: str, expected: dict[str, Any]) -> None:
    assert variants.apply(body, D, path) == expected


@pytest.mark.asyncio
async def test_a_reload_adds_and_removes_variants_without_a_worker_of_their_own(tmp_path: Path) -> None:
    from router.lifecycle.pool import Pool, PoolConfig
    from tests.router.fake_effects import FakeEffects

    first = load_presets(write(tmp_path, '[models.a]\nmodel = "{m}"\n'))
    pool = Pool(first, PoolConfig(), effects=FakeEffects())
    try:
        assert pool.get("v") is None
        text = '[models.a]\nmodel = "{m}"\n[models.v]\nvariant-of = "a"\nalias = ["vee"]\ntemp = 0\n'
        pool.apply(load_presets(write(tmp_path, text)))
        assert list(pool.handles) == ["a"] and pool.get("v") is pool.get("vee") is pool.handles["a"]
        assert [(c["id"], c.get("variant_of")) for c in pool.models()] == [("a", None), ("v", "a")]
        body = pool.with_defaults("vee", {"messages": [], "temperature": 0.5}, "/v1/chat/completions")
        assert body == {"messages": [], "temperature": 0.5}  # the request's own field wins
        assert pool.with_defaults("v", {"prompt": "p"}, "/v1/completions") == {
            "prompt": "p",
            "temperature": 0.0,
        }
        pool.apply(first)
        assert pool.get("v") is None and pool.variant("v") is None
    finally:
        await pool.close()
