"""Chat templates: turn OpenAI-style messages into one prompt string.

Templates are Jinja, rendered the way HF transformers' `apply_chat_template` renders them
(sandboxed, `trim_blocks`/`lstrip_blocks`, `loopcontrols`, a no-op `{% generation %}` tag, and the
globals `raise_exception` / `strftime_now` plus an HF-compatible `tojson` filter), so a template
from a GGUF file or a tokenizer_config.json gives the prompt the model was trained on.

Messages are copied and normalized before rendering (the caller's dicts are never changed):
- keys whose value is None are dropped (as HF does: templates handle a missing key, while
  `content: null` would render as "None" or crash);
- content that is a list of only text parts becomes one string (parts joined with "\\n", as
  llama.cpp and vLLM do), so templates that expect strings still work; a list holding any other
  part (an image, ...) is left to the template;
- `reasoning_content` is also offered as `thinking` (what gpt-oss style templates read), as HF does.

What a template can do is probed once per source by rendering small conversations with "needles"
(llama.cpp's minja does the same), and gaps are filled the way llama.cpp fills them:
- no system role (the template drops it or raises): system text goes to the front of the next
  user message, joined with "\\n";
- typed content required (the template only renders `[{"type": "text", ...}]` lists): string
  content is wrapped in one text part, and text-only lists stay lists;
- object arguments required (the template does `arguments | tojson`): assistant tool-call
  arguments given as JSON strings (the OpenAI wire form) are parsed; otherwise they stay strings.
`ChatTemplate.caps` reports the probe results (also whether tools and tool calls are rendered).

The rendered text contains BOS when the template emits it (HF templates usually start with
`{{ bos_token }}`); a caller whose tokenizer also adds BOS strips one leading `bos_token` first.
The builtins (worker.text.builtin_templates) never start with BOS, as llama.cpp's do not.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from worker.text.builtin_templates import BUILTIN_TEMPLATES

__all__ = [
    "BUILTIN_TEMPLATES",
    "ChatTemplate",
    "ChatTemplateError",
    "TemplateCaps",
    "chat_template_from_config",
    "load_chat_template",
]


class ChatTemplateError(ValueError):
    """A template failed to load, compile or render (the message says why)."""


@dataclasses.dataclass(frozen=True)
class TemplateCaps:
    """What a template renders, found by probing it (see the module docstring)."""

    supports_system_role: bool = True
    supports_tools: bool = False
    supports_tool_calls: bool = False
    requires_typed_content: bool = False
    requires_object_arguments: bool = False


class ChatTemplate:
    """One compiled chat template; `render` is thread-safe."""

    def __init__(
        self, source: str, *, bos_token: str = "", eos_token: str = "", name: str | None = None
    ) -> None:
        self.source = source
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = _compile(source, name)
        self.caps = _probe_caps(source)

    def __repr__(self) -> str:
        return f"ChatTemplate(name={self.name!r})"

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """The prompt for `messages`; extra kwargs (e.g. `enable_thinking`) become template variables."""
        caps = self.caps
        prepared = [_normalize_message(m, caps) for m in messages]
        if not caps.supports_system_role:
            prepared = _merge_system_into_user(prepared, typed=caps.requires_typed_content)
        context: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **kwargs,
            "messages": prepared,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(context)
        except ChatTemplateError:
            raise
        except Exception as exc:  # the template is untrusted code: any failure is its failure
            raise ChatTemplateError(f"{_label(self.name)} failed to render: {exc}") from exc


def load_chat_template(
    spec: str | None, gguf_template: str | None, *, bos_token: str, eos_token: str
) -> ChatTemplate:
    """The template a worker uses, from `--chat-template` (`spec`) and the model's own template.

    spec: None (or "") -> the model's template if it has one, else chatml; an existing file ->
    its contents (a .json file: its "chat_template" key, as in tokenizer_config.json or
    chat_template.json); a builtin name -> that; inline Jinja source (contains "{{" or "{%") ->
    that; anything else -> ChatTemplateError naming the builtin names.
    """
    tokens = {"bos_token": bos_token, "eos_token": eos_token}
    if not spec:
        if gguf_template:
            return ChatTemplate(gguf_template, name="model", **tokens)
        return ChatTemplate(BUILTIN_TEMPLATES["chatml"], name="chatml", **tokens)
    if spec in BUILTIN_TEMPLATES:
        return ChatTemplate(BUILTIN_TEMPLATES[spec], name=spec, **tokens)
    path = Path(spec)
    if _is_file(path):
        return ChatTemplate(_read_template_file(path), name=str(path), **tokens)
    if "{{" in spec or "{%" in spec:
        return ChatTemplate(spec, name="inline", **tokens)
    raise ChatTemplateError(
        f"unknown chat template {spec!r}: not a file, and not one of the builtin names: "
        + ", ".join(sorted(BUILTIN_TEMPLATES))
    )


def chat_template_from_config(config: Mapping[str, Any]) -> str | None:
    """The default template in a tokenizer_config.json / chat_template.json mapping, if any.

    HF allows a list of named templates ([{"name": "default", "template": ...}, ...]); the one
    named "default" (else the first) is taken.
    """
    value = config.get("chat_template")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        chosen = named.get("default", next(iter(named.values()), None))
        return chosen if isinstance(chosen, str) else None
    return None


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except (OSError, ValueError):  # a long inline template is not a valid path
        return False


def _read_template_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ChatTemplateError(f"cannot read chat template file {path}: {exc}") from exc
    if path.suffix.lower() != ".json":
        return text
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ChatTemplateError(f"chat template file {path} is not valid JSON: {exc}") from exc
    template = chat_template_from_config(data) if isinstance(data, Mapping) else None
    if template is None:
        raise ChatTemplateError(f'chat template file {path} has no "chat_template" string')
    return template


# --------------------------------------------------------------------------- message normalization

_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})


def _normalize_message(message: Mapping[str, Any], caps: TemplateCaps) -> dict[str, Any]:
    out = {key: value for key, value in message.items() if value is not None}
    content = out.get("content")
    if content is None and out.get("tool_calls"):  # only tool calls: templates concatenate content
        out["content"] = [] if caps.requires_typed_content else ""
    elif caps.requires_typed_content:
        if isinstance(content, str):
            out["content"] = [{"type": "text", "text": content}]
    elif isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") in _TEXT_PART_TYPES for p in content
    ):
        out["content"] = "\n".join(str(p.get("text", "")) for p in content)
    tool_calls = out.get("tool_calls")
    if caps.requires_object_arguments and isinstance(tool_calls, list):
        out["tool_calls"] = [_with_object_arguments(c) for c in tool_calls]
    if "reasoning_content" in out and "thinking" not in out:
        out["thinking"] = out["reasoning_content"]
    return out


def _with_object_arguments(call: Any) -> Any:
    """`call` with `function.arguments` parsed from JSON when it is a JSON string."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        return call
    arguments = call["function"].get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**call["function"], "arguments": parsed}}


def _content_as_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p["text"]) for p in content if isinstance(p, Mapping) and "text" in p)
    return ""


def _merge_system_into_user(messages: list[dict[str, Any]], *, typed: bool) -> list[dict[str, Any]]:
    """For templates without a system role: system text goes to the front of the next user message."""
    out: list[dict[str, Any]] = []
    pending: list[str] = []
    for message in messages:
        role = message.get("role")
        if role == "system":
            pending.append(_content_as_text(message.get("content")))
            continue
        if pending and role == "user":
            system, pending = "\n".join(pending), []
            content = message.get("content")
            if isinstance(content, list):
                merged: Any = [{"type": "text", "text": system + "\n"}, *content]
            else:
                text = _content_as_text(content)
                merged = f"{system}\n{text}" if text else system
            message = {**message, "content": merged}
        out.append(message)
    if pending:
        text = "\n".join(pending)
        out.append({"role": "user", "content": [{"type": "text", "text": text}] if typed else text})
    return out


# --------------------------------------------------------------------------- capability probes

_SYSTEM_NEEDLE = "<System Needle>"
_USER_NEEDLE = "<User Needle>"
_TOOL_NEEDLE = "tool_name_needle"
_CALL_NEEDLE = "call_name_needle"
_ARGS_NEEDLE = '{"code": "print'
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _TOOL_NEEDLE,
        "description": "probe",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}


def _probe(template: jinja2.Template, messages: list[dict[str, Any]], *, with_tools: bool = False) -> str:
    try:
        return template.render(
            messages=messages,
            tools=[_PROBE_TOOL] if with_tools else None,
            add_generation_prompt=False,
            bos_token="",
            eos_token="",
        )
    except Exception:  # a failed probe only means "does not support this"
        return ""


@functools.lru_cache(maxsize=64)
def _probe_caps(source: str) -> TemplateCaps:
    template = _compile_source(source)
    plain = _probe(template, [{"role": "user", "content": _USER_NEEDLE}])
    typed = _probe(template, [{"role": "user", "content": [{"type": "text", "text": _USER_NEEDLE}]}])
    requires_typed_content = _USER_NEEDLE not in plain and _USER_NEEDLE in typed

    def message(role: str, text: str, **extra: Any) -> dict[str, Any]:
        content: Any = [{"type": "text", "text": text}] if requires_typed_content else text
        return {"role": role, "content": content, **extra}

    def with_tool_call(arguments: Any) -> str:
        function = {"name": _CALL_NEEDLE, "arguments": arguments}
        call = {"id": "call_1___", "type": "function", "function": function}  # Mistral wants 9-char ids
        turns = [message("user", "u"), message("assistant", "", tool_calls=[call]), message("user", "ok")]
        return _probe(template, turns, with_tools=True)

    with_system = _probe(template, [message("system", _SYSTEM_NEEDLE), message("user", _USER_NEEDLE)])
    string_args = with_tool_call('{"code": "print(1)"}')
    object_args = with_tool_call({"code": "print(1)"})
    return TemplateCaps(
        # The system role is unsupported only if user messages do render (else we cannot tell).
        supports_system_role=_SYSTEM_NEEDLE in with_system or _USER_NEEDLE not in plain + typed,
        supports_tools=_TOOL_NEEDLE in _probe(template, [message("user", "u")], with_tools=True),
        supports_tool_calls=_CALL_NEEDLE in string_args + object_args,
        requires_typed_content=requires_typed_content,
        requires_object_arguments=_ARGS_NEEDLE not in string_args and _ARGS_NEEDLE in object_args,
    )


# --------------------------------------------------------------------------- the Jinja environment


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker) renders its body."""

    tags = {"generation"}  # noqa: RUF012 - jinja reads this class attribute

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's override: no HTML escaping (Jinja's own tojson escapes <, >, &, ').
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV = _make_environment()


@functools.lru_cache(maxsize=64)
def _compile_source(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


def _compile(source: str, name: str | None) -> jinja2.Template:
    try:
        return _compile_source(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"{_label(name)} does not compile: {exc} (line {exc.lineno})") from exc


def _label(name: str | None) -> str:
    return f"chat template {name!r}" if name else "chat template"
