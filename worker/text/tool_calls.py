"""Tool calls in a chat model's generated text, whole (`parse_tool_calls`) or streamed (`ToolCallStream`).

Formats (`ToolFormat`, picked from the chat template by `detect_format`):
- HERMES (Hermes, Qwen2.5, Qwen3): `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`,
  one block per call; any text outside the blocks is content.
- LLAMA3 (Llama 3.1-3.3): the whole message is `{"name": "f", "parameters": {...}}` (or
  "arguments"), optionally after `<|python_tag|>`; several calls are separated by `;` and/or
  whitespace. A message that does not start with `{` or the tag is content.
- MISTRAL: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` or `[TOOL_CALLS]f[ARGS]{...}`,
  repeated for several calls; content may precede the first `[TOOL_CALLS]`, nothing may follow
  the calls.

A call is a JSON object with a non-empty string "name" and, optionally, an object "arguments"
(or "parameters"); other keys are ignored. `ToolCall.arguments` is the object's JSON text exactly
as generated (`"{}"` when there was none). Output that breaks these rules anywhere (bad JSON,
an unterminated block, no name, arguments that are not an object, text after llama3/mistral
calls) is all content: no calls. Content is stripped of surrounding whitespace.

Streaming (`ToolCallStream`) keeps two promises: content reaches the client as soon as it cannot
be the beginning of a call, and the concatenated deltas equal `parse_tool_calls` of the whole
text. It runs a small incremental scanner to stream a call's name and arguments as they are
generated, and `finish()` reconciles with `parse_tool_calls`. Content that comes after the first
call marker is held until `finish()` (the scanner cannot know yet whether the output is
well-formed; before the marker it can).

Why one file of over 500 lines: each format is a pair, a whole-text parser and its streaming
twin, that must agree token for token; keeping all formats side by side is what lets the table
tests in tests/unit/test_tool_calls.py check every pair the same way.
"""

from __future__ import annotations

import json
import random
import re
import string
from dataclasses import dataclass, field
from enum import Enum, StrEnum

from worker.text.reasoning import TrimmedStream, partial_suffix_len


class ToolFormat(StrEnum):
    HERMES = "hermes"
    LLAMA3 = "llama3"
    MISTRAL = "mistral"


def detect_format(template_source: str | None) -> ToolFormat:
    """The tool-call format a chat template teaches its model; HERMES when it names none
    (llama.cpp's generic fallback is the same JSON-in-tags shape)."""
    src = template_source or ""
    if "<tool_call>" in src:
        return ToolFormat.HERMES
    if "[TOOL_CALLS]" in src:
        return ToolFormat.MISTRAL
    if "<|start_header_id|>" in src or "<|python_tag|>" in src:
        return ToolFormat.LLAMA3
    return ToolFormat.HERMES


_ID_CHARS = string.ascii_letters + string.digits


def new_call_id() -> str:
    # Unique, not secret: the module's generator (reseeded after fork) is 40x faster than `secrets`.
    return "call_" + "".join(random.choices(_ID_CHARS, k=24))


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object's JSON text as generated
    id: str = field(default_factory=new_call_id, compare=False)  # random: not part of equality


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True, slots=True)
class ToolArgsDelta:
    index: int
    text: str


Delta = ContentDelta | ToolCallStart | ToolArgsDelta

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_CALLS, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_JSON_WS = " \t\n\r"
_ARGS_KEYS = ("arguments", "parameters")
_MISTRAL_NAME = re.compile(r"[^\s\[\]{}\"',:]+")  # a bare function name before [ARGS]
_DECODER = json.JSONDecoder()


# --------------------------------------------------------------------------- whole text


class _Malformed(Exception):
    """The output breaks the format somewhere: all of it is content."""


def parse_tool_calls(fmt: ToolFormat, text: str, *, parallel: bool = True) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a complete output; never raises.

    Malformed output gives `(text.strip(), [])`: stripped like any content, because a stream
    drops leading whitespace before it can know. With `parallel=False` only the first call is
    kept; later ones are dropped, not made content.
    """
    try:
        content, calls = _PARSERS[fmt](text)
    except _Malformed:
        return text.strip(), []
    return content.strip(), calls if parallel else calls[:1]


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    parts: list[str] = []
    calls: list[ToolCall] = []
    pos = 0
    while (i := text.find(_HERMES_OPEN, pos)) >= 0:
        parts.append(text[pos:i])
        call, end = _call_object(text, _skip_space(text, i + len(_HERMES_OPEN)))
        end = _skip_space(text, end)
        if not text.startswith(_HERMES_CLOSE, end):
            raise _Malformed
        calls.append(call)
        pos = end + len(_HERMES_CLOSE)
    parts.append(text[pos:])
    return "".join(parts), calls


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    i = _skip_space(text, 0)
    if text.startswith(_PYTHON_TAG, i):
        i = _skip_space(text, i + len(_PYTHON_TAG))
    elif not text.startswith("{", i):
        return text, []
    calls: list[ToolCall] = []
    while True:
        call, i = _call_object(text, i)
        calls.append(call)
        i = _skip_separators(text, i)
        if i == len(text):
            return "", calls


def _parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    i = text.find(_MISTRAL_CALLS)
    if i < 0:
        return text, []
    content, calls = text[:i], []
    while True:  # at a [TOOL_CALLS]
        i = _skip_space(text, i + len(_MISTRAL_CALLS))
        if text.startswith("[", i):
            i = _skip_json_ws(text, i + 1)
            while True:
                call, i = _call_object(text, i)
                calls.append(call)
                i = _skip_json_ws(text, i)
                if text.startswith(",", i):
                    i = _skip_json_ws(text, i + 1)
                elif text.startswith("]", i):
                    i += 1
                    break
                else:
                    raise _Malformed
        else:
            j = text.find(_MISTRAL_ARGS, i)
            name = text[i:j].strip()
            if j < 0 or not _MISTRAL_NAME.fullmatch(name):
                raise _Malformed
            start = _skip_space(text, j + len(_MISTRAL_ARGS))
            args, i = _decode(text, start)
            if not isinstance(args, dict):
                raise _Malformed
            calls.append(ToolCall(name, text[start:i]))
        i = _skip_space(text, i)
        if i == len(text):
            return content, calls
        if not text.startswith(_MISTRAL_CALLS, i):
            raise _Malformed


_PARSERS = {
    ToolFormat.HERMES: _parse_hermes,
    ToolFormat.LLAMA3: _parse_llama3,
    ToolFormat.MISTRAL: _parse_mistral,
}


def _call_object(text: str, i: int) -> tuple[ToolCall, int]:
    """The call object at text[i] and the index after it; the arguments' span is kept verbatim."""
    if not text.startswith("{", i):
        raise _Malformed
    name: str | None = None
    args: str | None = None
    i = _skip_json_ws(text, i + 1)
    while not text.startswith("}", i):  # one key-value pair per turn
        if not text.startswith('"', i):
            raise _Malformed
        key, i = _decode(text, i)
        i = _skip_json_ws(text, i)
        if not text.startswith(":", i):
            raise _Malformed
        start = _skip_json_ws(text, i + 1)
        value, i = _decode(text, start)
        if key == "name":
            if name is not None or not isinstance(value, str) or not value:
                raise _Malformed
            name = value
        elif key in _ARGS_KEYS:
            if args is not None or not isinstance(value, dict):
                raise _Malformed
            args = text[start:i]
        i = _skip_json_ws(text, i)
        if text.startswith(",", i):
            i = _skip_json_ws(text, i + 1)
            if not text.startswith('"', i):  # no trailing comma
                raise _Malformed
        elif not text.startswith("}", i):
            raise _Malformed
    if name is None:
        raise _Malformed
    return ToolCall(name, "{}" if args is None else args), i + 1


def _decode(text: str, i: int) -> tuple[object, int]:
    try:
        return _DECODER.raw_decode(text, i)
    except ValueError:
        raise _Malformed from None


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


def _skip_json_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _JSON_WS:
        i += 1
    return i


def _skip_separators(text: str, i: int) -> int:
    while i < len(text) and (text[i] == ";" or text[i].isspace()):
        i += 1
    return i


# --------------------------------------------------------------------------- incremental JSON

_STRING_SPECIAL = re.compile(r'["\\]')
_OUTER_SPECIAL = re.compile(r'["{}\[\]]')


class _JsonSpan:
    """Finds where a JSON object, array or string ends, fed piece by piece.

    Tracks only string/escape state and bracket depth: enough to find the end of valid JSON,
    which is all it is used for (validity is `parse_tool_calls`'s business).
    """

    __slots__ = ("_depth", "_escape", "_in_string")

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escape = False

    def scan(self, text: str, i: int) -> int | None:
        """Read text[i:] (the first call starts at the value's first character); return the index
        just past the value's end, or None if it goes on."""
        while i < len(text):
            if self._escape:
                self._escape = False
                i += 1
            elif self._in_string:
                m = _STRING_SPECIAL.search(text, i)
                if m is None:
                    return None
                i = m.end()
                if m.group() == "\\":
                    self._escape = True
                else:
                    self._in_string = False
                    if self._depth == 0:
                        return i
            else:
                m = _OUTER_SPECIAL.search(text, i)
                if m is None:
                    return None
                i = m.end()
                ch = m.group()
                if ch == '"':
                    self._in_string = True
                elif ch in "{[":
                    self._depth += 1
                else:
                    self._depth -= 1
                    if self._depth <= 0:
                        return i
        return None


class _K(Enum):
    """_CallScanner states."""

    OPEN = "open"  # JSON whitespace, then `{`
    FIRST_KEY = "first_key"  # a key or `}`
    KEY = "key"  # a key (after a comma)
    COLON = "colon"
    VALUE = "value"  # the first character of a value
    SPAN = "span"  # inside a key, the name, the arguments or a skipped string/object/array
    SCALAR = "scalar"  # inside a skipped number/true/false/null
    NEXT = "next"  # `,` or `}`
    DONE = "done"
    FAILED = "failed"


class _CallScanner:
    """One call object `{"name": ..., "arguments": {...}}` fed piece by piece.

    `name` is set once its string is complete; `take_args()` returns the arguments' text read
    since the last call (it accumulates while the name is unknown, for "arguments" before "name").
    """

    __slots__ = ("_args", "_key", "_raw", "_span", "_what", "has_args", "name", "state")

    def __init__(self) -> None:
        self.state = _K.OPEN
        self.name: str | None = None
        self.has_args = False
        self._args: list[str] = []
        self._span = _JsonSpan()
        self._what = ""  # in SPAN: "key", "name", "args" or "skip"
        self._raw: list[str] = []  # the JSON text of the key or name being read
        self._key = ""

    def take_args(self) -> str:
        text = "".join(self._args)
        self._args.clear()
        return text

    def feed(self, text: str) -> int:
        """Read `text`; return how much of it belongs to the object (all of it unless DONE)."""
        i = 0
        while i < len(text) and self.state is not _K.DONE and self.state is not _K.FAILED:
            if self.state is _K.SPAN:
                end = self._span.scan(text, i)
                self._keep(text[i : len(text) if end is None else end])
                if end is None:
                    return len(text)
                i = end
                self._span_done()
            elif self.state is _K.SCALAR:
                while i < len(text) and text[i] not in ",}" and text[i] not in _JSON_WS:
                    i += 1
                if i < len(text):
                    self.state = _K.NEXT
            elif text[i] in _JSON_WS:
                i += 1
            else:
                i += 1
                self._char(text[i - 1])
        return i

    def _keep(self, piece: str) -> None:
        if self._what == "args":
            self._args.append(piece)
        elif self._what != "skip":
            self._raw.append(piece)

    def _open_span(self, what: str, first: str) -> None:
        self.state, self._what, self._span = _K.SPAN, what, _JsonSpan()
        self._raw.clear()
        self._span.scan(first, 0)
        self._keep(first)

    def _char(self, ch: str) -> None:
        state = self.state
        if state is _K.OPEN and ch == "{":
            self.state = _K.FIRST_KEY
        elif state in (_K.FIRST_KEY, _K.KEY) and ch == '"':
            self._open_span("key", ch)
        elif state in (_K.FIRST_KEY, _K.NEXT) and ch == "}":
            self.state = _K.DONE if self.name is not None else _K.FAILED
        elif state is _K.COLON and ch == ":":
            self.state = _K.VALUE
        elif state is _K.NEXT and ch == ",":
            self.state = _K.KEY
        elif state is _K.VALUE:
            self._value(ch)
        else:
            self.state = _K.FAILED

    def _value(self, ch: str) -> None:
        if self._key == "name":
            if ch != '"' or self.name is not None:
                self.state = _K.FAILED
            else:
                self._open_span("name", ch)
        elif self._key in _ARGS_KEYS:
            if ch != "{" or self.has_args:
                self.state = _K.FAILED
            else:
                self.has_args = True
                self._open_span("args", ch)
        elif ch in '"{[':
            self._open_span("skip", ch)
        else:
            self.state = _K.SCALAR

    def _span_done(self) -> None:
        self.state = _K.NEXT
        if self._what == "key":
            key = _loads("".join(self._raw))
            self._key = key if isinstance(key, str) else ""
            self.state = _K.COLON if isinstance(key, str) else _K.FAILED
        elif self._what == "name":
            name = _loads("".join(self._raw))
            if isinstance(name, str) and name:
                self.name = name
            else:
                self.state = _K.FAILED


def _loads(text: str) -> object:
    """The JSON value of `text`, or None if it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


# --------------------------------------------------------------------------- streaming


class _S(Enum):
    """ToolCallStream states (which formats use them)."""

    LEAD = "lead"  # llama3: whitespace, then `{` or <|python_tag|> (calls) or anything else (content)
    CONTENT = "content"  # hermes, mistral: text, watching for the call marker
    PLAIN = "plain"  # llama3: content, no call can follow
    SEEK = "seek"  # hermes, llama3: whitespace, then a call object
    OBJECT = "object"  # all: inside a call object
    CLOSE = "close"  # hermes: whitespace, then </tool_call>
    SEPARATOR = "separator"  # llama3: `;` and whitespace, then another call object
    HEAD = "head"  # mistral after [TOOL_CALLS]: `[` (array) or a function name
    ARRAY_NEXT = "array_next"  # mistral: `,` (another call object) or `]`
    NAME = "name"  # mistral: a function name, up to [ARGS]
    ARGS_SEEK = "args_seek"  # mistral: whitespace, then the `{` of the arguments
    ARGS = "args"  # mistral: inside the arguments object
    NEXT_SEGMENT = "next_segment"  # mistral: whitespace, then [TOOL_CALLS] or the end
    FAILED = "failed"  # malformed: nothing more is streamed; finish() emits it as content


# _between(): (state, first character) -> (characters it uses, next state)
_MOVES = {
    (_S.SEEK, "{"): (0, _S.OBJECT),
    (_S.SEPARATOR, "{"): (0, _S.OBJECT),
    (_S.HEAD, "["): (1, _S.OBJECT),  # mistral array form; otherwise HEAD -> NAME
    (_S.ARRAY_NEXT, ","): (1, _S.OBJECT),
    (_S.ARRAY_NEXT, "]"): (1, _S.NEXT_SEGMENT),
    (_S.ARGS_SEEK, "{"): (0, _S.ARGS),
}
_AFTER_OBJECT = {
    ToolFormat.HERMES: _S.CLOSE,
    ToolFormat.LLAMA3: _S.SEPARATOR,
    ToolFormat.MISTRAL: _S.ARRAY_NEXT,
}


@dataclass(slots=True)
class _Sent:
    """A call as the client has seen it."""

    id: str
    name: str
    args: list[str] = field(default_factory=list)


class ToolCallStream:
    """`parse_tool_calls` for text that arrives in pieces, as OpenAI-style deltas.

    `feed(delta)` returns what is certain now: content that cannot be the beginning of a call,
    a `ToolCallStart` once a call's name is complete, then its arguments' text as it arrives
    (the scanner holds "arguments" that come before "name" until the name is known).
    `finish()` returns the rest, reconciled with `parse_tool_calls` on the whole text.

    Malformed output: a client may have seen the start (and some arguments) of a call that
    `finish()` then finds malformed; the whole output is content then, and `finish()` emits as
    `ContentDelta` all of it the client has not seen as content. `calls_retracted` is then True;
    the non-streamed result (`parse_tool_calls`) is the authority.

    With `parallel=False` only the first call is streamed; later calls are dropped.
    """

    def __init__(self, fmt: ToolFormat, *, parallel: bool = True) -> None:
        self._fmt = fmt
        self._parallel = parallel
        self._text: list[str] = []  # everything fed, for finish()
        self._pending = ""  # fed text the current state has not consumed
        self._state = _S.LEAD if fmt is ToolFormat.LLAMA3 else _S.CONTENT
        self._content = TrimmedStream()
        self._content_sent: list[str] = []
        self._is_past_marker = False  # content is held from the first call marker on
        self._scanner = _CallScanner()
        self._args_span = _JsonSpan()
        self._is_named = False  # the current call's name is known (and its start sent, if shown)
        self._num_calls = 0  # calls begun, shown or not
        self._sent: list[_Sent] = []
        self.calls_retracted = False

    def feed(self, delta: str) -> list[Delta]:
        self._text.append(delta)
        self._pending += delta
        out: list[Delta] = []
        while self._pending and self._step(out):
            pass
        return out

    def finish(self) -> list[Delta]:
        content, calls = parse_tool_calls(self._fmt, "".join(self._text), parallel=self._parallel)
        out: list[Delta] = []
        sent = "".join(self._content_sent)
        if len(content) > len(sent) and content.startswith(sent):
            out.append(ContentDelta(content[len(sent) :]))
        if not calls:
            self.calls_retracted = bool(self._sent)
            return out
        for index, call in enumerate(calls):
            if index == len(self._sent):
                self._begin_shown(call.name, out)
            seen = self._sent[index]
            args_seen = "".join(seen.args)
            if seen.name == call.name and call.arguments.startswith(args_seen):
                self._send_args(index, call.arguments[len(args_seen) :], out)
        return out

    # ------------------------------------------------------------------ states

    def _step(self, out: list[Delta]) -> bool:
        """Consume from `_pending`; False when the state needs more text to go on."""
        state = self._state
        if state is _S.OBJECT:
            return self._object(out)
        if state is _S.ARGS:
            return self._args(out)
        if state is _S.CONTENT:
            return self._text_until_marker(out)
        if state is _S.PLAIN:
            self._send_content(self._pending, out)
            self._pending = ""
            return False
        if state is _S.LEAD:
            return self._lead()
        if state is _S.NAME:
            return self._mistral_name(out)
        if state is _S.FAILED:
            self._pending = ""
            return False
        return self._between()

    def _text_until_marker(self, out: list[Delta]) -> bool:
        marker = _HERMES_OPEN if self._fmt is ToolFormat.HERMES else _MISTRAL_CALLS
        buf = self._pending
        i = buf.find(marker)
        if i < 0:
            keep = partial_suffix_len(buf, marker)
            self._send_content(buf[: len(buf) - keep], out)
            self._pending = buf[len(buf) - keep :]
            return False
        self._send_content(buf[:i], out)
        self._is_past_marker = True
        self._enter(_S.SEEK if self._fmt is ToolFormat.HERMES else _S.HEAD, buf[i + len(marker) :])
        return True

    def _lead(self) -> bool:
        head = self._pending.lstrip()
        if head.startswith("{"):
            self._is_past_marker = True
            self._enter(_S.OBJECT, head)
        elif head.startswith(_PYTHON_TAG):
            self._is_past_marker = True
            self._enter(_S.SEEK, head[len(_PYTHON_TAG) :])
        elif _PYTHON_TAG.startswith(head):  # empty, or a possible tag
            return False
        else:
            self._state = _S.PLAIN
        return True

    def _between(self) -> bool:
        """The states between call objects: whitespace, then a closing marker or one character."""
        state = self._state
        head = self._pending.lstrip(_JSON_WS if state is _S.ARRAY_NEXT else None)
        if state is _S.SEPARATOR:
            head = head[_skip_separators(head, 0) :]
        self._pending = head
        if not head:
            return False
        if state is _S.CLOSE or state is _S.NEXT_SEGMENT:
            marker, then = (_HERMES_CLOSE, _S.CONTENT) if state is _S.CLOSE else (_MISTRAL_CALLS, _S.HEAD)
            if head.startswith(marker):
                self._enter(then, head[len(marker) :])
                return True
            if marker.startswith(head):
                return False
            self._fail()
            return False
        move = _MOVES.get((state, head[0]), (0, _S.NAME) if state is _S.HEAD else None)
        if move is None:
            self._fail()
            return False
        used, then = move
        self._enter(then, head[used:])
        return True

    def _enter(self, state: _S, rest: str) -> None:
        self._state, self._pending = state, rest
        if state is _S.OBJECT:
            self._scanner = _CallScanner()
        elif state is _S.ARGS:
            self._args_span = _JsonSpan()

    def _object(self, out: list[Delta]) -> bool:
        scanner = self._scanner
        used = scanner.feed(self._pending)
        self._pending = self._pending[used:]
        if scanner.state is _K.FAILED:
            self._fail()
            return False
        if not self._is_named and scanner.name is not None:
            self._begin(scanner.name, out)
        if self._is_named:
            self._send_args(self._num_calls - 1, scanner.take_args(), out)
        if scanner.state is not _K.DONE:
            return False
        if not scanner.has_args:
            self._send_args(self._num_calls - 1, "{}", out)
        self._is_named = False
        self._state = _AFTER_OBJECT[self._fmt]
        return True

    def _mistral_name(self, out: list[Delta]) -> bool:
        buf = self._pending
        j = buf.find(_MISTRAL_ARGS)
        if j < 0:
            # Fail early once the name so far (the text before a possible "[ARGS]") cannot be one.
            head = buf[: len(buf) - partial_suffix_len(buf, _MISTRAL_ARGS)].rstrip()
            if head and not _MISTRAL_NAME.fullmatch(head):
                self._fail()
            return False
        name = buf[:j].strip()
        if not _MISTRAL_NAME.fullmatch(name):
            self._fail()
            return False
        self._begin(name, out)
        self._enter(_S.ARGS_SEEK, buf[j + len(_MISTRAL_ARGS) :])
        return True

    def _args(self, out: list[Delta]) -> bool:
        buf = self._pending
        end = self._args_span.scan(buf, 0)
        self._send_args(self._num_calls - 1, buf if end is None else buf[:end], out)
        if end is None:
            self._pending = ""
            return False
        self._enter(_S.NEXT_SEGMENT, buf[end:])
        self._is_named = False
        return True

    def _fail(self) -> None:
        self._state, self._pending = _S.FAILED, ""

    # ------------------------------------------------------------------ output

    def _send_content(self, text: str, out: list[Delta]) -> None:
        if self._is_past_marker:
            return  # finish() sends it, once the whole output is known to be well-formed
        text = self._content.feed(text)
        if text:
            self._content_sent.append(text)
            out.append(ContentDelta(text))

    def _begin(self, name: str, out: list[Delta]) -> None:
        """A call's name is complete: the next call index, shown unless it is a dropped parallel one."""
        self._is_named = True
        self._num_calls += 1
        if self._parallel or self._num_calls == 1:
            self._begin_shown(name, out)

    def _begin_shown(self, name: str, out: list[Delta]) -> None:
        call = _Sent(new_call_id(), name)
        out.append(ToolCallStart(len(self._sent), call.id, name))
        self._sent.append(call)

    def _send_args(self, index: int, text: str, out: list[Delta]) -> None:
        """Arguments of call `index` (counted over all calls: only shown calls reach the client)."""
        if text and index < len(self._sent):
            self._sent[index].args.append(text)
            out.append(ToolArgsDelta(index, text))
