"""The chat templates `--chat-template NAME` accepts, as Jinja sources.

The names are the ones llama.cpp accepts, and each template renders what llama.cpp's built-in C++
formatter (src/llama-chat.cpp) renders for that name: no BOS at the start (the tokenizer adds it),
literal special tokens, llama.cpp's spacing and trimming. chatml, llama3 and mistral-v7 also render
`tools` and tool calls (Hermes/Qwen2.5, Llama 3.1 JSON and Mistral formats), which llama.cpp's
C++ formatter does not.

Each source starts with a `content_text` macro: a message's content as text (a list: its text
parts joined with "\\n"; none: empty), so every builtin accepts every content shape.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

# Every builtin starts with this macro: message content as text (lists: their text parts).
_CONTENT_MACRO = """\
{%- macro content_text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is none -%}
{%- elif content is mapping -%}{{ content | tojson }}
{%- elif content is iterable -%}
{%- for part in content if part is mapping and part.text is defined -%}{{ part.text }}{{ '\\n' if not loop.last }}{%- endfor -%}
{%- else -%}{{ content }}
{%- endif -%}
{%- endmacro -%}
"""

_CHATML = """\
{%- if tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if messages and messages[0].role == 'system' -%}{{- content_text(messages[0].content) + '\\n\\n' -}}{%- endif -%}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' -}}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' -}}
{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    '\\n</tool_call><|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if not (tools and loop.first and message.role == 'system') -%}
{{- '<|im_start|>' + message.role + '\\n' + content_text(message.content) -}}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- ('\\n' if (loop.index0 > 0 or message.content) else '') + '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' -}}
{{- (fn.arguments if fn.arguments is string else (fn.arguments | tojson)) + '}\\n</tool_call>' -}}
{%- endfor -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}
"""

_LLAMA2 = """\
{#- llama.cpp's llama2 family; the variant sets has_system, bos_inside, strip -#}
{%- set ns = namespace(inside=true) -%}
{{- '[INST] ' -}}
{%- for message in messages -%}
{%- set content = content_text(message.content) -%}
{%- if strip %}{% set content = content | trim %}{% endif -%}
{%- if not ns.inside -%}{%- set ns.inside = true -%}{{- ('<s>[INST] ' if bos_inside else '[INST] ') -}}{%- endif -%}
{%- if message.role == 'system' -%}
{{- ('<<SYS>>\\n' + content + '\\n<</SYS>>\\n\\n') if has_system else (content + '\\n') -}}
{%- elif message.role == 'user' -%}{{- content + ' [/INST]' -}}
{%- else -%}{{- content + '</s>' -}}{%- set ns.inside = false -%}
{%- endif -%}
{%- endfor -%}
"""

_MISTRAL_V1_V3 = """\
{#- llama.cpp's mistral v1 / v3 / v3-tekken; the variant sets lead, trail, trim_assistant -#}
{%- set ns = namespace(inside=false) -%}
{%- for message in messages -%}
{%- if not ns.inside -%}{{- lead + '[INST]' + trail -}}{%- set ns.inside = true -%}{%- endif -%}
{%- set content = content_text(message.content) -%}
{%- if message.role == 'system' -%}{{- content + '\\n\\n' -}}
{%- elif message.role == 'user' -%}{{- content + lead + '[/INST]' -}}
{%- else -%}{{- trail + ((content | trim) if trim_assistant else content) + '</s>' -}}{%- set ns.inside = false -%}
{%- endif -%}
{%- endfor -%}
"""

_MISTRAL_V7 = """\
{#- llama.cpp's mistral v7 (sp = ' ') / v7-tekken (sp = ''), plus tools in Mistral's format -#}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}{%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for message in messages -%}
{%- set content = content_text(message.content) -%}
{%- if message.role == 'system' -%}{{- '[SYSTEM_PROMPT]' + sp + content + '[/SYSTEM_PROMPT]' -}}
{%- elif message.role == 'user' -%}
{%- if tools and loop.index0 == ns.last_user -%}{{- '[AVAILABLE_TOOLS]' + (tools | tojson) + '[/AVAILABLE_TOOLS]' -}}{%- endif -%}
{{- '[INST]' + sp + content + '[/INST]' -}}
{%- elif message.role == 'tool' -%}{{- '[TOOL_RESULTS]' + sp + content + '[/TOOL_RESULTS]' -}}
{%- elif message.tool_calls -%}
{{- sp + content + '[TOOL_CALLS][' -}}
{%- for call in message.tool_calls -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- ', ' if not loop.first -}}
{{- '{"name": ' + (fn.name | tojson) + ', "arguments": ' + (fn.arguments if fn.arguments is string else (fn.arguments | tojson)) + '}' -}}
{%- endfor -%}
{{- ']</s>' -}}
{%- else -%}{{- sp + content + '</s>' -}}
{%- endif -%}
{%- endfor -%}
"""

_LLAMA3 = """\
{#- llama.cpp's llama3, plus tools the Llama 3.1 way (listed in the first user message) -#}
{%- set ns = namespace(tools_pending=(tools is not none and tools | length > 0)) -%}
{%- for message in messages -%}
{%- set role = 'ipython' if message.role == 'tool' else message.role -%}
{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' -}}
{%- if ns.tools_pending and message.role == 'user' -%}
{%- set ns.tools_pending = false -%}
{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments '
    'that best answers the given prompt.\\n\\nRespond in the format {"name": function name, "parameters": '
    'dictionary of argument name and its value}. Do not use variables.\\n\\n' -}}
{%- for tool in tools -%}{{- (tool | tojson(indent=4)) + '\\n\\n' -}}{%- endfor -%}
{%- endif -%}
{{- content_text(message.content) | trim -}}
{%- for call in message.tool_calls or [] -%}
{%- set fn = call.function if call.function is defined else call -%}
{{- '{"name": ' + (fn.name | tojson) + ', "parameters": ' + (fn.arguments if fn.arguments is string else (fn.arguments | tojson)) + '}' -}}
{%- endfor -%}
{{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}
"""

_GEMMA = """\
{#- llama.cpp's gemma: no system role, system text goes into the next user turn -#}
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}{%- set ns.system = ns.system + (content_text(message.content) | trim) -%}
{%- else -%}
{%- set role = 'model' if message.role == 'assistant' else message.role -%}
{{- '<start_of_turn>' + role + '\\n' -}}
{%- if ns.system and role != 'model' -%}{{- ns.system + '\\n\\n' -}}{%- set ns.system = '' -%}{%- endif -%}
{{- (content_text(message.content) | trim) + '<end_of_turn>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""

_MONARCH = """\
{%- for message in messages -%}
{{- ('' if loop.first else '<s>') + message.role + '\\n' + content_text(message.content) + '</s>\\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<s>assistant\\n' -}}{%- endif -%}
"""

_OPENCHAT = """\
{%- for message in messages -%}
{%- if message.role == 'system' -%}{{- content_text(message.content) + '<|end_of_turn|>' -}}
{%- else -%}{{- 'GPT4 Correct ' + message.role[:1] | upper + message.role[1:] + ': ' + content_text(message.content) + '<|end_of_turn|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- 'GPT4 Correct Assistant:' -}}{%- endif -%}
"""


_ORION = """\
{#- no system role: system text goes into the next user turn; no separate generation prompt -#}
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
{%- if message.role == 'system' -%}{%- set ns.system = ns.system + content_text(message.content) -%}
{%- elif message.role == 'user' -%}
{{- 'Human: ' + ((ns.system + '\\n\\n') if ns.system else '') + content_text(message.content) + '\\n\\nAssistant: </s>' -}}
{%- set ns.system = '' -%}
{%- else -%}{{- content_text(message.content) + '</s>' -}}
{%- endif -%}
{%- endfor -%}
"""

_RWKV_WORLD = """\
{#- the model ends turns with "\\n\\n"; "Assistant:" follows a final user message -#}
{%- for message in messages -%}
{%- set content = content_text(message.content) | trim -%}
{%- if message.role == 'system' -%}{{- 'System: ' + content + '\\n\\n' -}}
{%- elif message.role == 'user' -%}{{- 'User: ' + content + '\\n\\n' + ('Assistant:' if loop.last else '') -}}
{%- elif message.role == 'assistant' -%}{{- 'Assistant: ' + content + '\\n\\n' -}}
{%- endif -%}
{%- endfor -%}
"""

_BAILING = """\
{%- for message in messages -%}
{{- '<role>' + ('HUMAN' if message.role == 'user' else message.role | upper) + '</role>' + content_text(message.content) -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<role>ASSISTANT</role>' -}}{%- endif -%}
"""


def _jinja_str(text: str) -> str:
    """A Jinja string literal for `text`."""
    return json.dumps(text, ensure_ascii=False)


def _simple(
    turns: Mapping[str, tuple[str, str]],
    generation: str,
    *,
    trim: bool = False,
    other: tuple[str, str] | None = None,
    start: str = "",
) -> str:
    """A template that wraps each message in per-role (prefix, suffix) text.

    Roles not in `turns` use `other` ("{role}" in its prefix becomes the role name), or are
    skipped when `other` is None, as llama.cpp does. `start` comes before the first message.
    """
    content = "(content_text(message.content) | trim)" if trim else "content_text(message.content)"

    def wrap(prefix: str, suffix: str) -> str:
        before, has_role, after = prefix.partition("{role}")
        head = (
            f"{_jinja_str(before)} + message.role + {_jinja_str(after)}" if has_role else _jinja_str(prefix)
        )
        return f"{{{{- {head} + {content} + {_jinja_str(suffix)} -}}}}"

    branches = [
        f"{{%- {'if' if i == 0 else 'elif'} message.role == {_jinja_str(role)} -%}}{wrap(*texts)}"
        for i, (role, texts) in enumerate(turns.items())
    ]
    if other is not None:
        branches.append(f"{{%- {'else' if branches else 'if true'} -%}}{wrap(*other)}")
    lines = ["{%- for message in messages -%}", *branches, "{%- endif -%}", "{%- endfor -%}"]
    if start:
        lines.insert(0, f"{{{{- {_jinja_str(start)} -}}}}")
    if generation:
        lines.append(f"{{%- if add_generation_prompt -%}}{{{{- {_jinja_str(generation)} -}}}}{{%- endif -%}}")
    return "\n".join(lines) + "\n"


def _variant(template: str, **values: str | bool) -> str:
    """`template` preceded by `{% set name = value %}` for each of `values`."""
    sets = "".join(
        f"{{%- set {key} = {str(value).lower() if isinstance(value, bool) else _jinja_str(value)} -%}}\n"
        for key, value in values.items()
    )
    return sets + template


_DEEPSEEK_EOS = "<｜end▁of▁sentence｜>"

_BUILTIN_BODIES: dict[str, str] = {
    "chatml": _CHATML,
    "llama2": _variant(_LLAMA2, has_system=False, bos_inside=False, strip=False),
    "llama2-sys": _variant(_LLAMA2, has_system=True, bos_inside=False, strip=False),
    "llama2-sys-bos": _variant(_LLAMA2, has_system=True, bos_inside=True, strip=False),
    "llama2-sys-strip": _variant(_LLAMA2, has_system=True, bos_inside=False, strip=True),
    "mistral-v1": _variant(_MISTRAL_V1_V3, lead=" ", trail=" ", trim_assistant=False),
    "mistral-v3": _variant(_MISTRAL_V1_V3, lead="", trail=" ", trim_assistant=True),
    "mistral-v3-tekken": _variant(_MISTRAL_V1_V3, lead="", trail="", trim_assistant=False),
    "mistral-v7": _variant(_MISTRAL_V7, sp=" "),
    "mistral-v7-tekken": _variant(_MISTRAL_V7, sp=""),
    "phi3": _simple({}, "<|assistant|>\n", other=("<|{role}|>\n", "<|end|>\n")),
    "phi4": _simple(
        {}, "<|im_start|>assistant<|im_sep|>", other=("<|im_start|>{role}<|im_sep|>", "<|im_end|>")
    ),
    "falcon3": _simple({}, "<|assistant|>\n", other=("<|{role}|>\n", "\n")),
    "zephyr": _simple({}, "<|assistant|>\n", other=("<|{role}|>\n", "<|endoftext|>\n")),
    "monarch": _MONARCH,
    "gemma": _GEMMA,
    "openchat": _OPENCHAT,
    "vicuna": _simple(
        {"system": ("", "\n\n"), "user": ("USER: ", "\n"), "assistant": ("ASSISTANT: ", "</s>\n")},
        "ASSISTANT:",
    ),
    "vicuna-orca": _simple(
        {"system": ("SYSTEM: ", "\n"), "user": ("USER: ", "\n"), "assistant": ("ASSISTANT: ", "</s>\n")},
        "ASSISTANT:",
    ),
    "deepseek": _simple(
        {
            "system": ("", ""),
            "user": ("### Instruction:\n", "\n"),
            "assistant": ("### Response:\n", "\n<|EOT|>\n"),
        },
        "### Response:\n",
    ),
    "deepseek2": _simple(
        {"system": ("", "\n\n"), "user": ("User: ", "\n\n"), "assistant": ("Assistant: ", _DEEPSEEK_EOS)},
        "Assistant:",
    ),
    "deepseek3": _simple(
        {"system": ("", "\n\n"), "user": ("<｜User｜>", ""), "assistant": ("<｜Assistant｜>", _DEEPSEEK_EOS)},
        "<｜Assistant｜>",
    ),
    "command-r": _simple(
        {
            "system": ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
            "user": ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
            "assistant": ("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
        },
        "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
        trim=True,
    ),
    "llama3": _LLAMA3,
    "llama4": _simple(
        {},
        "<|header_start|>assistant<|header_end|>\n\n",
        trim=True,
        other=("<|header_start|>{role}<|header_end|>\n\n", "<|eot|>"),
    ),
    "exaone3": _simple(
        {
            "system": ("[|system|]", "[|endofturn|]\n"),
            "user": ("[|user|]", "\n"),
            "assistant": ("[|assistant|]", "[|endofturn|]\n"),
        },
        "[|assistant|]",
        trim=True,
    ),
    "granite": _simple(
        {
            "assistant_tool_call": (
                "<|start_of_role|>assistant_tool_call<|end_of_role|><|tool_call|>",
                "<|end_of_text|>\n",
            )
        },
        "<|start_of_role|>assistant<|end_of_role|>",
        other=("<|start_of_role|>{role}<|end_of_role|>", "<|end_of_text|>\n"),
    ),
    "megrez": _simple(
        {}, "<|role_start|>assistant<|role_end|>", other=("<|role_start|>{role}<|role_end|>", "<|turn_end|>")
    ),
    "orion": _ORION,
    "minicpm": _simple({"user": ("<用户>", "<AI>")}, "", trim=True, other=("", "")),
    "chatglm3": _simple({}, "<|assistant|>", other=("<|{role}|>\n ", ""), start="[gMASK]sop"),
    "chatglm4": _simple({}, "<|assistant|>\n", other=("<|{role}|>\n", ""), start="[gMASK]<sop>"),
    "glmedge": _simple({}, "<|assistant|>", other=("<|{role}|>\n", "")),
    "exaone4": _simple(
        {
            "system": ("[|system|]", "[|endofturn|]\n"),
            "user": ("[|user|]", "\n"),
            "assistant": ("[|assistant|]", "[|endofturn|]\n"),
            "tool": ("[|tool|]", "[|endofturn|]\n"),
        },
        "[|assistant|]",
        trim=True,
    ),
    "rwkv-world": _RWKV_WORLD,
    "bailing": _BAILING,
    "smolvlm": _simple(
        {"system": ("", "\n\n"), "user": ("User: ", "<end_of_utterance>\n")},
        "Assistant:",
        other=("Assistant: ", "<end_of_utterance>\n"),
        start="<|im_start|>",
    ),
    "hunyuan-moe": _simple(
        {"system": ("<|startoftext|>", "<|extra_4|>"), "assistant": ("", "<|eos|>")},
        "",
        other=("<|startoftext|>", "<|extra_0|>"),
    ),
}
_BUILTIN_BODIES["mistral"] = _BUILTIN_BODIES["mistral-v7"]

BUILTIN_TEMPLATES: dict[str, str] = {name: _CONTENT_MACRO + body for name, body in _BUILTIN_BODIES.items()}
