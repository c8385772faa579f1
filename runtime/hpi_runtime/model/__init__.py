"""Llama-family models (Llama 2/3, Mistral, Qwen2, SmolLM) loaded from Hugging Face safetensors directories."""
