"""The model families (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3, Mixtral, Qwen-MoE) on one shared decoder, their
config reading, the architecture registry and the safetensors loader."""
