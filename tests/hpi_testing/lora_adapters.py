"""Tiny PEFT LoRA adapters for tests, built with the `peft` library itself (the reference) on a model directory.

A and B are drawn at random and non-zero (PEFT initialises B to zero, which would make every adapter the base
model), so an adapter that is applied to the wrong tokens, projection or slot changes the output.
"""

from __future__ import annotations

from pathlib import Path

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(model_dir: Path, out_dir: Path, *, rank: int = 8, alpha: float | None = None,
                  targets: tuple[str, ...] = ALL_PROJECTIONS, seed: int = 0, std: float = 0.2,
                  use_rslora: bool = False) -> Path:  # fmt: skip
    """Write a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) and return it."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=list(targets),
                        lora_dropout=0.0, use_rslora=use_rslora)  # fmt: skip
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def reference_model(model_dir: Path, adapter_dir: Path | None):
    """transformers' model of `model_dir` in fp32, with peft's adapter on it when one is given."""
    import torch
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter_dir) if adapter_dir is not None else model


def greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy token ids and each one's logprob, as transformers generates them."""
    import torch

    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0)  # fmt: skip
    tokens = out.sequences[0, ids.shape[1] :].tolist()
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, tokens, strict=True)]
    return tokens, logprobs


def reference_greedy(model_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], max_new_tokens: int):
    """transformers (+ peft): greedy token ids and each one's logprob, in fp32."""
    return greedy(reference_model(model_dir, adapter_dir), prompt_ids, max_new_tokens)
