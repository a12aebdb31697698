"""Test and demo models.

    tiny_models  deterministic random-weight Llama models, HF and GGUF twins of the same weights
"""
