"""Model loading (GGUF, safetensors), tokenizer, chat template and architectures."""
