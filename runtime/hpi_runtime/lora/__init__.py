"""Multi-LoRA serving: PEFT adapters on a shared base model, batched together (docs/lora.md).

request.py and peft_dir.py import no torch (the config tree and the API server read them); layer.py and
slots.py run in the model runner."""
