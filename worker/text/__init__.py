"""Pure text handling, no engine and no backend: what goes into a prompt and comes out of one.

chat_template      OpenAI-style messages -> one prompt string (Jinja, the model's template)
builtin_templates  the templates `--chat-template NAME` accepts
chat_output        generated text -> an assistant message (content, tool calls, reasoning), whole or streamed
detok              incremental UTF-8 detokenization
stop_strings       incremental stop-string matching
tool_calls         tool calls in generated text (Hermes, Llama 3, Mistral, ...), whole or streamed
reasoning          `<think>...</think>` split from the answer, whole or streamed
fim                a code model's fill-in-the-middle tokens
rerank             the Qwen3-Reranker look-alike's prompt and head
generic_tools      tools for a model whose chat template cannot render them (SmolLM2's)
"""
