"""A request's structured-output fields -> one grammar, and its tools -> a validated tool set.

What a request may constrain its output with (at most one of them; two is a 400):
- `response_format`: `{"type": "text"}` (nothing), `{"type": "json_object"}` (any JSON object,
  or llama-server's `"schema"` inside it), `{"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}` (OpenAI; llama-server's flat `{"type": "json_schema", "schema"}` too);
- llama-server's `json_schema` (a schema) and `grammar` (GBNF) fields;
- `tool_choice: "required"` or a named function: a grammar that forces a call in the template
  family's syntax, its arguments matching the function's `parameters` schema.

Tools (`tools`, `tool_choice`, `parallel_tool_calls`) are validated here: only function tools,
a name, a `parameters` object schema that compiles; a named `tool_choice` must be in `tools`.
With `tool_choice: "none"` the tools are neither rendered nor parsed. Output parsing lives in
worker/text/tool_calls.py; this module only decides what the grammar is.

Every error is an `APIError` (400) naming the field. Compiling runs off the event loop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from worker.backends.base import Vocab
from worker.engine.grammar import Grammar, GrammarError, compile_grammar, json_schema_lark
from worker.protocol.errors import APIError
from worker.text.tool_calls import ToolFormat


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: str  # "auto", "none", "required" or "function"
    name: str | None = None  # the function, for mode "function"

    @property
    def is_forced(self) -> bool:
        return self.mode in ("required", "function")


@dataclass(frozen=True, slots=True)
class ToolSet:
    """The request's function tools (as sent, for the template) and its choice among them."""

    tools: list[dict[str, Any]]
    choice: ToolChoice
    parallel: bool

    @property
    def is_active(self) -> bool:
        """Tools are rendered and the output is parsed for calls."""
        return bool(self.tools) and self.choice.mode != "none"

    def functions(self) -> list[dict[str, Any]]:
        return [t["function"] for t in self.tools]


def check_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool) -> ToolSet | None:
    if tools is None or len(tools) == 0:
        if tool_choice not in (None, "none", "auto"):
            raise APIError("tool_choice needs tools: the request has none", param="tool_choice")
        return None
    names: set[str] = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise APIError(f"{where} must be an object", param=where)
        if tool.get("type") != "function":
            raise APIError(f"{where}.type {tool.get('type')!r} is not supported; only 'function' tools are",
                           param=f"{where}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(
                f"{where}.function.name must be a non-empty string", param=f"{where}.function.name"
            )
        params = fn.get("parameters")
        if params is not None and not (isinstance(params, dict) and params.get("type", "object") == "object"):
            raise APIError(f"{where}.function.parameters must be a JSON schema of type object",
                           param=f"{where}.function.parameters")
        names.add(fn["name"])
    return ToolSet(list(tools), _tool_choice(tool_choice, names), parallel)


def _tool_choice(value: Any, names: set[str]) -> ToolChoice:
    if value is None:
        return ToolChoice("auto")
    if value in ("auto", "none", "required"):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise APIError("tool_choice.function.name must be a string", param="tool_choice")
        if name not in names:
            raise APIError(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
        return ToolChoice("function", name)
    raise APIError(f"tool_choice must be 'auto', 'none', 'required' or a function, not {value!r}",
                   param="tool_choice")


@dataclass(frozen=True, slots=True)
class Constraint:
    """What to compile: a kind for worker/engine/grammar.py and its text, and the field it came from."""

    kind: str
    text: Any
    param: str


def output_constraint(req: Any) -> Constraint | None:
    """The one constraint among response_format / json_schema / grammar, if any."""
    found: list[Constraint] = []
    fmt = req.response_format
    if fmt is not None:
        c = _response_format(fmt)
        if c is not None:
            found.append(c)
    if req.json_schema is not None:
        found.append(Constraint("json_schema", req.json_schema, "json_schema"))
    if req.grammar is not None and req.grammar != "":
        found.append(Constraint("gbnf", req.grammar, "grammar"))
    if len(found) > 1:
        raise APIError(f"{found[0].param} and {found[1].param} cannot be combined: give one constraint",
                       param=found[1].param)
    return found[0] if found else None


def _response_format(fmt: dict[str, Any]) -> Constraint | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = fmt.get("schema", {"type": "object"})
        return Constraint(
            "json_schema", schema, "response_format.schema" if "schema" in fmt else "response_format"
        )
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if spec is None and "schema" in fmt:  # llama-server's flat form
            return Constraint("json_schema", fmt["schema"], "response_format.schema")
        if not isinstance(spec, dict):
            raise APIError("response_format.json_schema must be an object with a 'schema'",
                           param="response_format.json_schema")
        return Constraint("json_schema", spec.get("schema", {}), "response_format.json_schema.schema")
    raise APIError(
        f"response_format type {kind!r} is not supported: use 'text', 'json_object' or 'json_schema'",
        param="response_format.type",
    )


def compile_constraint(backend: Vocab, c: Constraint) -> Grammar:
    """Blocking (grammar construction): run it in a thread."""
    try:
        return compile_grammar(backend.grammar_tokenizer(), c.kind, c.text)
    except GrammarError as e:
        raise APIError(f"invalid {c.param}: {e}", param=c.param) from None


def check_tool_schemas(backend: Vocab, tools: ToolSet) -> None:
    """Each function's parameters compile (blocking: run it in a thread)."""
    tok = backend.grammar_tokenizer()
    for i, fn in enumerate(tools.functions()):
        params = fn.get("parameters")
        if params is None:
            continue
        try:
            compile_grammar(tok, "json_schema", params)
        except GrammarError as e:
            raise APIError(f"invalid tools[{i}].function.parameters: {e}",
                           param=f"tools[{i}].function.parameters") from None


# --------------------------------------------------------------------------- tool-call grammars

_ARGS_KEY = {ToolFormat.HERMES: "arguments", ToolFormat.LLAMA3: "parameters", ToolFormat.MISTRAL: "arguments"}


def _call_schema(fn: dict[str, Any], args_key: str) -> dict[str, Any]:
    params = fn.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, args_key: params},
        "required": ["name", args_key],
    }


def tool_call_lark(backend: Vocab, fmt: ToolFormat, tools: ToolSet, content: Constraint | None = None) -> str:
    """A Lark grammar (llguidance's dialect) for the calls the choice allows: one call, or
    several with `parallel_tool_calls`, in the family's syntax. `content`: with
    tool_choice auto, a JSON-schema answer allowed instead of calls."""
    fns = tools.functions()
    if tools.choice.mode == "function":
        fns = [f for f in fns if f["name"] == tools.choice.name]
    key = _ARGS_KEY[fmt]
    schemas = [_call_schema(f, key) for f in fns]
    call_json = json_schema_lark(schemas[0] if len(schemas) == 1 else {"anyOf": schemas})
    lit = _Literals(backend)
    if fmt is ToolFormat.HERMES:
        call, sep, head, tail = (
            f'{lit("<tool_call>")} "\\n" json_call "\\n" {lit("</tool_call>")}',
            '"\\n"',
            "",
            "",
        )
    elif fmt is ToolFormat.MISTRAL:
        call, sep, head, tail = "json_call", '", "', f'{lit("[TOOL_CALLS]")} "["', '"]"'
    else:
        call, sep, head, tail = "json_call", '"; "', "", ""
    calls = f"call ({sep} call)*" if tools.parallel else "call"
    lines = [f"calls: {head} {calls} {tail}".rstrip(), f"call: {call}", f"json_call: {call_json}"]
    if content is not None:
        lines.insert(0, "start: calls | answer")
        lines.append(f"answer: {json_schema_lark(content.text)}")
    else:
        lines.insert(0, "start: calls")
    return "\n".join(lines) + "\n"


class _Literals:
    """A marker as a Lark terminal: the special token itself where the vocabulary has one
    (`<[id]>`), else its text."""

    def __init__(self, backend: Vocab) -> None:
        self._backend = backend

    def __call__(self, text: str) -> str:
        ids = self._backend.tokenize(text, False, True)
        if len(ids) == 1 and self._backend.tokenize(text, False, False) != ids:
            return f"<[{ids[0]}]>"
        return json.dumps(text)
