"""Table tests for worker.text.chat_template (pure: no model, no network)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from worker.text.chat_template import (
    BUILTIN_TEMPLATES,
    ChatTemplate,
    ChatTemplateError,
    TemplateCaps,
    chat_template_from_config,
    load_chat_template,
)

# llama.cpp's test conversation (tests/test-chat-template.cpp): the expected strings below are what
# llama.cpp's built-in formatter produces for it with `--chat-template NAME`.
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Who are you"},
    {"role": "assistant", "content": "   I am an assistant   "},
    {"role": "user", "content": "Another question"},
]

LLAMA_CPP_EXPECTED = {
    "chatml": "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
    "<|im_start|>assistant\nHi there<|im_end|>\n<|im_start|>user\nWho are you<|im_end|>\n"
    "<|im_start|>assistant\n   I am an assistant   <|im_end|>\n<|im_start|>user\nAnother question<|im_end|>\n"
    "<|im_start|>assistant\n",
    "llama2": "[INST] You are a helpful assistant\nHello [/INST]Hi there</s>[INST] Who are you [/INST]"
    "   I am an assistant   </s>[INST] Another question [/INST]",
    "llama2-sys": "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s>"
    "[INST] Who are you [/INST]   I am an assistant   </s>[INST] Another question [/INST]",
    "llama2-sys-bos": "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s>"
    "<s>[INST] Who are you [/INST]   I am an assistant   </s><s>[INST] Another question [/INST]",
    "llama2-sys-strip": "[INST] <<SYS>>\nYou are a helpful assistant\n<</SYS>>\n\nHello [/INST]Hi there</s>"
    "[INST] Who are you [/INST]I am an assistant</s>[INST] Another question [/INST]",
    "mistral-v1": " [INST] You are a helpful assistant\n\nHello [/INST] Hi there</s> [INST] Who are you [/INST]"
    "    I am an assistant   </s> [INST] Another question [/INST]",
    "mistral-v3": "[INST] You are a helpful assistant\n\nHello[/INST] Hi there</s>[INST] Who are you[/INST]"
    " I am an assistant</s>[INST] Another question[/INST]",
    "mistral-v3-tekken": "[INST]You are a helpful assistant\n\nHello[/INST]Hi there</s>[INST]Who are you[/INST]"
    "   I am an assistant   </s>[INST]Another question[/INST]",
    "mistral-v7": "[SYSTEM_PROMPT] You are a helpful assistant[/SYSTEM_PROMPT][INST] Hello[/INST] Hi there</s>"
    "[INST] Who are you[/INST]    I am an assistant   </s>[INST] Another question[/INST]",
    "mistral-v7-tekken": "[SYSTEM_PROMPT]You are a helpful assistant[/SYSTEM_PROMPT][INST]Hello[/INST]Hi there</s>"
    "[INST]Who are you[/INST]   I am an assistant   </s>[INST]Another question[/INST]",
    "phi3": "<|system|>\nYou are a helpful assistant<|end|>\n<|user|>\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n"
    "<|user|>\nWho are you<|end|>\n<|assistant|>\n   I am an assistant   <|end|>\n<|user|>\nAnother question<|end|>\n"
    "<|assistant|>\n",
    "phi4": "<|im_start|>system<|im_sep|>You are a helpful assistant<|im_end|><|im_start|>user<|im_sep|>Hello<|im_end|>"
    "<|im_start|>assistant<|im_sep|>Hi there<|im_end|><|im_start|>user<|im_sep|>Who are you<|im_end|>"
    "<|im_start|>assistant<|im_sep|>   I am an assistant   <|im_end|><|im_start|>user<|im_sep|>Another question"
    "<|im_end|><|im_start|>assistant<|im_sep|>",
    "falcon3": "<|system|>\nYou are a helpful assistant\n<|user|>\nHello\n<|assistant|>\nHi there\n<|user|>\n"
    "Who are you\n<|assistant|>\n   I am an assistant   \n<|user|>\nAnother question\n<|assistant|>\n",
    "zephyr": "<|system|>\nYou are a helpful assistant<|endoftext|>\n<|user|>\nHello<|endoftext|>\n<|assistant|>\n"
    "Hi there<|endoftext|>\n<|user|>\nWho are you<|endoftext|>\n<|assistant|>\n   I am an assistant   <|endoftext|>\n"
    "<|user|>\nAnother question<|endoftext|>\n<|assistant|>\n",
    "monarch": "system\nYou are a helpful assistant</s>\n<s>user\nHello</s>\n<s>assistant\nHi there</s>\n<s>user\n"
    "Who are you</s>\n<s>assistant\n   I am an assistant   </s>\n<s>user\nAnother question</s>\n<s>assistant\n",
    "gemma": "<start_of_turn>user\nYou are a helpful assistant\n\nHello<end_of_turn>\n<start_of_turn>model\nHi there"
    "<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\nI am an assistant"
    "<end_of_turn>\n<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n",
    "openchat": "You are a helpful assistant<|end_of_turn|>GPT4 Correct User: Hello<|end_of_turn|>GPT4 Correct Assistant:"
    " Hi there<|end_of_turn|>GPT4 Correct User: Who are you<|end_of_turn|>GPT4 Correct Assistant:    I am an "
    "assistant   <|end_of_turn|>GPT4 Correct User: Another question<|end_of_turn|>GPT4 Correct Assistant:",
    "vicuna": "You are a helpful assistant\n\nUSER: Hello\nASSISTANT: Hi there</s>\nUSER: Who are you\nASSISTANT:"
    "    I am an assistant   </s>\nUSER: Another question\nASSISTANT:",
    "vicuna-orca": "SYSTEM: You are a helpful assistant\nUSER: Hello\nASSISTANT: Hi there</s>\nUSER: Who are you\n"
    "ASSISTANT:    I am an assistant   </s>\nUSER: Another question\nASSISTANT:",
    "deepseek": "You are a helpful assistant### Instruction:\nHello\n### Response:\nHi there\n<|EOT|>\n### Instruction:\n"
    "Who are you\n### Response:\n   I am an assistant   \n<|EOT|>\n### Instruction:\nAnother question\n"
    "### Response:\n",
    "deepseek2": "You are a helpful assistant\n\nUser: Hello\n\nAssistant: Hi there<｜end▁of▁sentence｜>User: Who are you"
    "\n\nAssistant:    I am an assistant   <｜end▁of▁sentence｜>User: Another question\n\nAssistant:",
    "deepseek3": "You are a helpful assistant\n\n<｜User｜>Hello<｜Assistant｜>Hi there<｜end▁of▁sentence｜><｜User｜>"
    "Who are you<｜Assistant｜>   I am an assistant   <｜end▁of▁sentence｜><｜User｜>Another question<｜Assistant｜>",
    "command-r": "<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a helpful assistant<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hello<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>Hi there"
    "<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|USER_TOKEN|>Who are you<|END_OF_TURN_TOKEN|>"
    "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>I am an assistant<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|>"
    "<|USER_TOKEN|>Another question<|END_OF_TURN_TOKEN|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nYou are a helpful assistant<|eot_id|><|start_header_id|>"
    "user<|end_header_id|>\n\nHello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHi there<|eot_id|>"
    "<|start_header_id|>user<|end_header_id|>\n\nWho are you<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
    "\n\nI am an assistant<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nAnother question<|eot_id|>"
    "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "llama4": "<|header_start|>system<|header_end|>\n\nYou are a helpful assistant<|eot|><|header_start|>user"
    "<|header_end|>\n\nHello<|eot|><|header_start|>assistant<|header_end|>\n\nHi there<|eot|><|header_start|>user"
    "<|header_end|>\n\nWho are you<|eot|><|header_start|>assistant<|header_end|>\n\nI am an assistant<|eot|>"
    "<|header_start|>user<|header_end|>\n\nAnother question<|eot|><|header_start|>assistant<|header_end|>\n\n",
    "exaone3": "[|system|]You are a helpful assistant[|endofturn|]\n[|user|]Hello\n[|assistant|]Hi there[|endofturn|]\n"
    "[|user|]Who are you\n[|assistant|]I am an assistant[|endofturn|]\n[|user|]Another question\n[|assistant|]",
    "granite": "<|start_of_role|>system<|end_of_role|>You are a helpful assistant<|end_of_text|>\n<|start_of_role|>user"
    "<|end_of_role|>Hello<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>Hi there<|end_of_text|>\n"
    "<|start_of_role|>user<|end_of_role|>Who are you<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"
    "   I am an assistant   <|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Another question<|end_of_text|>\n"
    "<|start_of_role|>assistant<|end_of_role|>",
    "megrez": "<|role_start|>system<|role_end|>You are a helpful assistant<|turn_end|><|role_start|>user<|role_end|>"
    "Hello<|turn_end|><|role_start|>assistant<|role_end|>Hi there<|turn_end|><|role_start|>user<|role_end|>"
    "Who are you<|turn_end|><|role_start|>assistant<|role_end|>   I am an assistant   <|turn_end|>"
    "<|role_start|>user<|role_end|>Another question<|turn_end|><|role_start|>assistant<|role_end|>",
    "orion": "Human: You are a helpful assistant\n\nHello\n\nAssistant: </s>Hi there</s>Human: Who are you\n\n"
    "Assistant: </s>   I am an assistant   </s>Human: Another question\n\nAssistant: </s>",
    "minicpm": "You are a helpful assistant<用户>Hello<AI>Hi there<用户>Who are you<AI>I am an assistant<用户>"
    "Another question<AI>",
    "chatglm3": "[gMASK]sop<|system|>\n You are a helpful assistant<|user|>\n Hello<|assistant|>\n Hi there<|user|>\n"
    " Who are you<|assistant|>\n    I am an assistant   <|user|>\n Another question<|assistant|>",
    "chatglm4": "[gMASK]<sop><|system|>\nYou are a helpful assistant<|user|>\nHello<|assistant|>\nHi there<|user|>\n"
    "Who are you<|assistant|>\n   I am an assistant   <|user|>\nAnother question<|assistant|>\n",
    "glmedge": "<|system|>\nYou are a helpful assistant<|user|>\nHello<|assistant|>\nHi there<|user|>\nWho are you"
    "<|assistant|>\n   I am an assistant   <|user|>\nAnother question<|assistant|>",
    "exaone4": "[|system|]You are a helpful assistant[|endofturn|]\n[|user|]Hello\n[|assistant|]Hi there[|endofturn|]\n"
    "[|user|]Who are you\n[|assistant|]I am an assistant[|endofturn|]\n[|user|]Another question\n[|assistant|]",
    "rwkv-world": "System: You are a helpful assistant\n\nUser: Hello\n\nAssistant: Hi there\n\nUser: Who are you\n\n"
    "Assistant: I am an assistant\n\nUser: Another question\n\nAssistant:",
    "bailing": "<role>SYSTEM</role>You are a helpful assistant<role>HUMAN</role>Hello<role>ASSISTANT</role>Hi there"
    "<role>HUMAN</role>Who are you<role>ASSISTANT</role>   I am an assistant   <role>HUMAN</role>Another question"
    "<role>ASSISTANT</role>",
    "smolvlm": "<|im_start|>You are a helpful assistant\n\nUser: Hello<end_of_utterance>\nAssistant: Hi there"
    "<end_of_utterance>\nUser: Who are you<end_of_utterance>\nAssistant:    I am an assistant   <end_of_utterance>\n"
    "User: Another question<end_of_utterance>\nAssistant:",
    "hunyuan-moe": "<|startoftext|>You are a helpful assistant<|extra_4|><|startoftext|>Hello<|extra_0|>Hi there<|eos|>"
    "<|startoftext|>Who are you<|extra_0|>   I am an assistant   <|eos|><|startoftext|>Another question<|extra_0|>",
}
LLAMA_CPP_EXPECTED["mistral"] = LLAMA_CPP_EXPECTED["mistral-v7"]

# Real HF templates, as they appear in tokenizer_config.json (abridged only where noted).
QWEN25_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)

# A Qwen3-style thinking switch (abridged): extra kwargs must reach the template.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city — in °C",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

TOOL_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Zürich?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "c2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "18"},
    {"role": "tool", "tool_call_id": "c2", "content": "15"},
]


def with_object_arguments(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The HF form of `messages`: tool-call arguments as objects (OpenAI sends JSON strings)."""
    out = copy.deepcopy(messages)
    for message in out:
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def hf_render(source: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    """What transformers' apply_chat_template renders (bos <s>, eos </s>)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>")),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    rendered = tokenizer.apply_chat_template(messages, chat_template=source, tokenize=False, **kwargs)
    assert isinstance(rendered, str)
    return rendered


def render(source: str, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return ChatTemplate(source, bos_token="<s>", eos_token="</s>").render(messages, **kwargs)


# --------------------------------------------------------------------------- builtins


def test_required_builtin_names() -> None:
    required = {"chatml", "llama2", "llama3", "mistral", "gemma", "phi3", "zephyr", "vicuna", "deepseek"}
    assert required <= BUILTIN_TEMPLATES.keys()
    assert set(LLAMA_CPP_EXPECTED) == set(BUILTIN_TEMPLATES)


@pytest.mark.parametrize("name", sorted(LLAMA_CPP_EXPECTED))
def test_builtin_matches_llama_cpp(name: str) -> None:
    assert ChatTemplate(BUILTIN_TEMPLATES[name], name=name).render(CONVERSATION) == LLAMA_CPP_EXPECTED[name]


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_builtin_handles_odd_messages(name: str) -> None:
    template = ChatTemplate(BUILTIN_TEMPLATES[name], bos_token="<s>", eos_token="</s>", name=name)
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
        },
        {"role": "assistant", "content": None},
        {
            "role": "user",
            "content": [{"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "pic"}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "user", "content": "ünïcødé ✓ 你好"},
    ]
    text = template.render(messages)
    assert "part one\npart two" in text
    assert "pic" in text and "ünïcødé ✓ 你好" in text
    assert "None" not in text and "image_url" not in text
    assert template.render([]) == template.render([], add_generation_prompt=True)  # no crash on empty


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_builtin_generation_prompt_is_only_a_suffix(name: str) -> None:
    template = ChatTemplate(BUILTIN_TEMPLATES[name], name=name)
    with_prompt = template.render(CONVERSATION, add_generation_prompt=True)
    without = template.render(CONVERSATION, add_generation_prompt=False)
    assert with_prompt.startswith(without)


def test_chatml_renders_tools_and_tool_calls_like_qwen() -> None:
    # With tools, the builtin chatml uses the Hermes/Qwen2.5 tool format, so the same parser works.
    ours = render(BUILTIN_TEMPLATES["chatml"], TOOL_CONVERSATION, tools=[WEATHER_TOOL])
    qwen = hf_render(QWEN25_TEMPLATE, with_object_arguments(TOOL_CONVERSATION), tools=[WEATHER_TOOL])
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in ours
    assert "Weather for a city — in °C" in ours  # tojson keeps non-ASCII
    assert ours.split("<|im_start|>user\nWeather")[0] == qwen.split("<|im_start|>user\nWeather")[0]
    calls = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert "<|im_start|>assistant\n" + calls in ours
    assert calls in qwen


def test_mistral_renders_tools() -> None:
    text = render(BUILTIN_TEMPLATES["mistral"], TOOL_CONVERSATION, tools=[WEATHER_TOOL])
    assert text.index("[AVAILABLE_TOOLS]") < text.index("[INST] Weather in Paris")
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ' in text
    assert "[TOOL_RESULTS] 18[/TOOL_RESULTS][TOOL_RESULTS] 15[/TOOL_RESULTS]" in text


def test_llama3_renders_tools_in_first_user_message() -> None:
    text = render(BUILTIN_TEMPLATES["llama3"], TOOL_CONVERSATION, tools=[WEATHER_TOOL])
    user_turn = text.split("<|start_header_id|>user<|end_header_id|>\n\n")[1].split("<|start_header_id|>")[0]
    assert user_turn.startswith("Given the following functions")
    assert '"name": "get_weather"' in user_turn and user_turn.endswith(
        "Weather in Paris and Zürich?<|eot_id|>"
    )
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n18<|eot_id|>" in text


# --------------------------------------------------------------------------- parity with transformers

HF_CASES: list[tuple[str, str, list[dict[str, Any]], dict[str, Any]]] = [
    ("qwen2.5 plain", QWEN25_TEMPLATE, CONVERSATION, {}),
    ("qwen2.5 no system", QWEN25_TEMPLATE, CONVERSATION[1:], {"add_generation_prompt": False}),
    ("qwen2.5 tools", QWEN25_TEMPLATE, TOOL_CONVERSATION, {"tools": [WEATHER_TOOL]}),
    ("llama3", LLAMA3_TEMPLATE, CONVERSATION, {}),
    ("llama3 no gen prompt", LLAMA3_TEMPLATE, CONVERSATION[:3], {"add_generation_prompt": False}),
    ("gemma", GEMMA_TEMPLATE, CONVERSATION[1:], {}),
    ("chatml builtin", BUILTIN_TEMPLATES["chatml"], CONVERSATION, {}),
    ("thinking off", THINKING_TEMPLATE, CONVERSATION[1:2], {"enable_thinking": False}),
    ("thinking on", THINKING_TEMPLATE, CONVERSATION[1:2], {"enable_thinking": True}),
]


@pytest.mark.parametrize(
    ("source", "messages", "kwargs"), [c[1:] for c in HF_CASES], ids=[c[0] for c in HF_CASES]
)
def test_matches_transformers(source: str, messages: list[dict[str, Any]], kwargs: dict[str, Any]) -> None:
    kwargs = {"add_generation_prompt": True, **kwargs}
    expected = hf_render(source, with_object_arguments(messages), **kwargs)
    assert render(source, messages, **kwargs) == expected


def test_thinking_switch_reaches_template() -> None:
    off = render(THINKING_TEMPLATE, CONVERSATION[1:2], enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert render(THINKING_TEMPLATE, CONVERSATION[1:2]).endswith("<|im_start|>assistant\n")


# --------------------------------------------------------------------------- environment


@pytest.mark.parametrize(
    ("source", "kwargs", "expected"),
    [
        ("{{ bos_token }}|{{ eos_token }}", {}, "<s>|</s>"),
        ("{{ tools | tojson }}", {"tools": [{"name": "é<>&'"}]}, '[{"name": "é<>&\'"}]'),
        ("{{ {'a': [1, 2]} | tojson(indent=2) }}", {}, '{\n  "a": [\n    1,\n    2\n  ]\n}'),
        ("{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}", {}, '{"a": 2, "b": 1}'),
        ("{{ tools is none }}", {}, "True"),
        (
            "{% for i in range(5) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
            {},
            "02",
        ),
        ("{% generation %}kept{% endgeneration %}", {}, "kept"),
        ("  {% if true %}\n  x\n  {% endif %}\n", {}, "  x\n"),  # trim_blocks + lstrip_blocks
        ("{{ strftime_now('%Y') | length }}", {}, "4"),
        ("{{ messages[0].content }}", {}, "hi"),
        ("{{ messages[0]['content'].upper() }}", {}, "HI"),
        ("{{ custom_flag }}", {"custom_flag": 7}, "7"),
        ("{{ '{0.__class__}'.format(1) }}", {}, ""),  # the sandbox hides internals from str.format
    ],
)
def test_environment(source: str, kwargs: dict[str, Any], expected: str) -> None:
    assert render(source, [{"role": "user", "content": "hi"}], **kwargs) == expected


def test_raise_exception_becomes_chat_template_error() -> None:
    with pytest.raises(
        ChatTemplateError, match=r"^Conversation roles must alternate user/assistant/user/assistant/...$"
    ):
        render(GEMMA_TEMPLATE, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


@pytest.mark.parametrize(
    ("source", "match"),
    [
        ("{{ messages[0].content + 1 }}", "failed to render"),
        ("{{ undefined_thing.attr }}", "failed to render"),
        ("{% set x = [] %}{{ x.append(1) }}", "failed to render"),  # immutable sandbox
        ("{{ ''.__class__.__mro__ }}", "failed to render"),  # sandbox
    ],
)
def test_render_errors_are_chat_template_errors(source: str, match: str) -> None:
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(source, name="t").render([{"role": "user", "content": "x"}])


def test_syntax_error_at_construction() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}{{ m }}", name="broken")


def test_messages_are_not_mutated() -> None:
    messages = copy.deepcopy(TOOL_CONVERSATION)
    messages.append({"role": "user", "content": [{"type": "text", "text": "a"}]})
    before = copy.deepcopy(messages)
    render(BUILTIN_TEMPLATES["chatml"], messages, tools=[WEATHER_TOOL])
    assert messages == before


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            "'a\\nb'",
        ),
        ({"role": "user", "content": []}, "''"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "'type': 'image_url'"),
        ({"role": "user", "content": None}, "undefined"),
        ({"role": "assistant", "reasoning_content": "hmm"}, "hmm"),
    ],
)
def test_normalization_seen_by_templates(message: dict[str, Any], expected: str) -> None:
    source = (
        "{% set m = messages[0] %}{% if m.content is defined %}{{ m.content | pprint }}{% else %}undefined{% endif %}"
        "{{ m.thinking if m.thinking is defined }}"
    )
    assert expected in render(source, [message])


TOJSON_ARGUMENTS = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }};{% endfor %}{% endfor %}"
RAW_ARGUMENTS = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments }};{% endfor %}{% endfor %}"
TYPED_CONTENT = (
    "{% for m in messages %}{{ m.role }}:{% for p in m.content %}{% if p.type == 'text' %}{{ p.text }}{% endif %}"
    "{% endfor %};{% endfor %}"
)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            QWEN25_TEMPLATE,
            TemplateCaps(supports_tools=True, supports_tool_calls=True, requires_object_arguments=True),
        ),
        (LLAMA3_TEMPLATE, TemplateCaps()),
        (GEMMA_TEMPLATE, TemplateCaps(supports_system_role=False)),
        (THINKING_TEMPLATE, TemplateCaps()),
        (
            TOJSON_ARGUMENTS,
            TemplateCaps(requires_object_arguments=True),  # (it renders no tool names)
        ),
        (RAW_ARGUMENTS, TemplateCaps()),
        (TYPED_CONTENT, TemplateCaps(requires_typed_content=True)),
        ("{{ raise_exception('always') }}", TemplateCaps()),  # unknown: assume the plain path
        (BUILTIN_TEMPLATES["chatml"], TemplateCaps(supports_tools=True, supports_tool_calls=True)),
        (BUILTIN_TEMPLATES["llama3"], TemplateCaps(supports_tools=True, supports_tool_calls=True)),
        (BUILTIN_TEMPLATES["mistral"], TemplateCaps(supports_tools=True, supports_tool_calls=True)),
        (BUILTIN_TEMPLATES["gemma"], TemplateCaps()),
    ],
)
def test_caps(source: str, expected: TemplateCaps) -> None:
    assert ChatTemplate(source).caps == expected


def test_system_role_polyfill_matches_llama_cpp() -> None:
    # llama.cpp's expected_output_jinja for google/gemma-7b-it: system text joins the first user turn.
    expected = (
        "<s><start_of_turn>user\nYou are a helpful assistant\nHello<end_of_turn>\n<start_of_turn>model\nHi there"
        "<end_of_turn>\n<start_of_turn>user\nWho are you<end_of_turn>\n<start_of_turn>model\nI am an assistant"
        "<end_of_turn>\n<start_of_turn>user\nAnother question<end_of_turn>\n<start_of_turn>model\n"
    )
    assert render(GEMMA_TEMPLATE, CONVERSATION) == expected


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        (
            [
                {"role": "system", "content": "s1"},
                {"role": "system", "content": "s2"},
                {"role": "user", "content": "u"},
            ],
            "s1\ns2\nu",
        ),
        ([{"role": "system", "content": "s"}, {"role": "user", "content": ""}], "s"),
        (
            [
                {"role": "system", "content": [{"type": "text", "text": "s"}]},
                {"role": "user", "content": "u"},
            ],
            "s\nu",
        ),
        ([{"role": "user", "content": "u"}, {"role": "system", "content": "late"}], "u|late"),
    ],
)
def test_system_role_polyfill_cases(messages: list[dict[str, Any]], expected: str) -> None:
    source = "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}{% endif %}{{ m.content }}{{ '|' if not loop.last }}{% endfor %}"
    assert render(source, messages) == expected


def test_typed_content_polyfill() -> None:
    messages = [
        {"role": "user", "content": "plain"},
        {"role": "assistant", "content": [{"type": "text", "text": "typed"}]},
    ]
    assert render(TYPED_CONTENT, messages) == "user:plain;assistant:typed;"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        # `arguments | tojson` templates get objects (as HF expects) ...
        (TOJSON_ARGUMENTS, '{"x": [1, "ü"]};{};"not json";{"already": "object"};'),
        # ... templates that print the string keep it verbatim.
        (RAW_ARGUMENTS, "{\"x\":[1,\"ü\"]};;not json;{'already': 'object'};"),
    ],
)
def test_tool_call_arguments(source: str, expected: str) -> None:
    calls = [
        {"type": "function", "function": {"name": "f", "arguments": '{"x":[1,"ü"]}'}},
        {"type": "function", "function": {"name": "f", "arguments": ""}},
        {"type": "function", "function": {"name": "f", "arguments": "not json"}},
        {"type": "function", "function": {"name": "f", "arguments": {"already": "object"}}},
    ]
    assert (
        render(source, [{"role": "user", "content": "u"}, {"role": "assistant", "tool_calls": calls}])
        == expected
    )


def test_each_source_is_compiled_once() -> None:
    source = "{{ messages | length }} compiled-once"
    a, b = ChatTemplate(source), ChatTemplate(source, name="other")
    assert a._template is b._template


# --------------------------------------------------------------------------- loading


def test_load_defaults() -> None:
    tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    model = load_chat_template(None, LLAMA3_TEMPLATE, **tokens)
    assert model.source == LLAMA3_TEMPLATE and model.name == "model"
    assert model.render(CONVERSATION[:2]).startswith("<s><|start_header_id|>system")
    fallback = load_chat_template(None, None, **tokens)
    assert fallback.name == "chatml" and fallback.source == BUILTIN_TEMPLATES["chatml"]
    assert load_chat_template("", "", **tokens).name == "chatml"


@pytest.mark.parametrize("name", ["chatml", "llama3", "mistral", "gemma", "deepseek3"])
def test_load_builtin_overrides_model_template(name: str) -> None:
    template = load_chat_template(name, LLAMA3_TEMPLATE, bos_token="", eos_token="")
    assert template.name == name and template.source == BUILTIN_TEMPLATES[name]


def test_load_unknown_name_lists_builtins() -> None:
    with pytest.raises(ChatTemplateError, match="unknown chat template 'chatm1'") as info:
        load_chat_template("chatm1", None, bos_token="", eos_token="")
    for name in ("chatml", "llama3", "mistral", "zephyr"):
        assert name in str(info.value)


def test_load_inline_jinja() -> None:
    template = load_chat_template(
        "{% for m in messages %}{{ m.content }}{% endfor %}", None, bos_token="", eos_token=""
    )
    assert template.render(CONVERSATION[:2]) == "You are a helpful assistantHello"


def test_load_jinja_file(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(GEMMA_TEMPLATE, encoding="utf-8")
    template = load_chat_template(str(path), LLAMA3_TEMPLATE, bos_token="<bos>", eos_token="")
    assert template.name == str(path)
    assert (
        template.render(CONVERSATION[1:2])
        == "<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n"
    )


@pytest.mark.parametrize(
    "config",
    [
        {
            "chat_template": THINKING_TEMPLATE,
            "bos_token": "<s>",
            "model_max_length": 4096,
        },  # tokenizer_config.json
        {"chat_template": THINKING_TEMPLATE},  # chat_template.json
        {
            "chat_template": [
                {"name": "tool_use", "template": "x"},
                {"name": "default", "template": THINKING_TEMPLATE},
            ]
        },
    ],
)
def test_load_json_file(tmp_path: Path, config: dict[str, Any]) -> None:
    path = tmp_path / "tokenizer_config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    assert load_chat_template(str(path), None, bos_token="", eos_token="").source == THINKING_TEMPLATE


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "not valid JSON"),
        ('{"bos_token": "<s>"}', 'no "chat_template"'),
        ('["a"]', 'no "chat_template"'),
    ],
)
def test_load_bad_json_file(tmp_path: Path, content: str, match: str) -> None:
    path = tmp_path / "chat_template.json"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ChatTemplateError, match=match):
        load_chat_template(str(path), None, bos_token="", eos_token="")


def test_load_file_with_broken_template(tmp_path: Path) -> None:
    path = tmp_path / "broken.jinja"
    path.write_text("{% if %}", encoding="utf-8")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        load_chat_template(str(path), None, bos_token="", eos_token="")


def test_chat_template_from_config() -> None:
    assert chat_template_from_config({}) is None
    assert chat_template_from_config({"chat_template": [{"name": "rag", "template": "r"}]}) == "r"
    assert chat_template_from_config({"chat_template": 3}) is None
