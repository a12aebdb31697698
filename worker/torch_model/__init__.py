"""Our own PyTorch implementation of Llama-family HF checkpoints (no transformers at run time).

config.py reads config.json, weights.py streams safetensors into the model, model.py is the
forward pass over a flat mixed batch, kv_cache.py the unified cell pool it attends over, and
sampler.py the vectorised sampler chain. worker/backends/torch_backend.py ties them together.
"""
