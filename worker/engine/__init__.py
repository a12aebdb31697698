"""The engine: one thread that owns the backend, with slot-based continuous batching.

engine        the thread and its step: reap, admit, plan, decode, commit, sample
scheduler     the slots, the queue of waiting tasks; admit, plan, commit, postprocess
              (the one writer of status)
kv            KV placement: copy, save, restore, offload between slots and the prompt cache
policy        pure scheduling decisions (which prompt pieces go in this step's batch)
slot          one KV sequence and the task it serves
adapters      the LoRA adapters' table (ids, global scales) and a request's adapter set
task          a request as the engine sees it, and the events it streams back
beam          beam search (best_of, use_beam_search, length_penalty): W slots, beams in the shared batch
prompt_cache  the host-RAM prompt cache (`--cache-ram`)
disk_cache    the disk tier of the prompt cache (`--cache-dir`, `--cache-disk`): files, index, writer
disk_tier     the engine's side of it: read a prefix before admission, write on stop and sleep
slot_file     llama-server's slot files (`--slot-save-path`)
speculation   speculative decoding: prompt-lookup drafts verified in the shared batch
step_cost     what a decode step costs per row, measured, and the draft length that pays
draft_model   speculative decoding's draft model (--spec-draft-model): a KV stream per slot
grammar       constrained decoding: per-slot token masks (llguidance)
reasoning_budget  thinking_budget_tokens: the reasoning block's end forced after N tokens
metrics       the worker's Prometheus metrics (llama-server's `llamacpp:` set and our `omni:` one)
"""
