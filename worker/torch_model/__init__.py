"""Our own PyTorch implementation of Llama-family HF checkpoints (no transformers at run time).

config.py reads config.json; weights.py streams safetensors into the model; model.py is the
forward pass over one flat mixed batch; kv_cache.py is the unified cell pool and the per-step
attention plan; sampler.py is the vectorised sampler chain; tokenizer.py wraps `tokenizers`
and the tokenizer/generation configs; cuda_graphs.py captures decode steps on CUDA;
cpu_kernels.py builds and loads the C kernels (cpu_kernels.c) of the CPU decode path;
vision.py is Idefics3/SmolVLM's vision tower and connector (image tiles -> text-width rows);
lora.py loads PEFT LoRA adapters and packs them as the model's matmuls are packed;
image.py is libmtmd's idefics3 preprocessing in numpy (resizes, tiles, normalization).
worker/backends/torch_backend.py ties them together behind the Backend Protocol.
"""
