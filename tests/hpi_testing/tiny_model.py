"""Build tiny random-weight Hugging Face model directories with transformers' own classes.

The directory looks exactly like a downloaded checkpoint (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json with a ChatML chat template, generation_config.json), so the runtime's real loading
path runs in tests without any download. The tokenizer is a byte-level BPE trained in-process on a small
corpus: real merges, real special tokens, deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is Madrid.",
    "A paged KV cache stores keys and values in fixed-size blocks, like virtual memory pages.",
    "Continuous batching admits new requests at every step instead of waiting for a whole batch.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Kubernetes operators reconcile custom resources into deployments, services and pods.",
    "one two three four five six seven eight nine ten eleven twelve 0123456789 !?.,;:-_()[]{}",
    "Hello world! How are you today? I am fine, thank you. Stop here. STOP. The end.",
]

ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}

# Families whose norm weights are randomised too (transformers initialises them all alike, which would hide
# a norm applied to the wrong tensor or with the wrong offset).
_RANDOM_NORM_ARCHITECTURES = ("qwen3", "phi3", "gemma2", "gemma3")


def build_tokenizer(vocab_size: int = 384, *, add_bos_token: bool = False, extra_special_tokens: tuple[str, ...] = ()):
    """A byte-level BPE tokenizer with ChatML special tokens, trained on CORPUS.

    `add_bos_token=True` makes encoding with special tokens prepend the BOS token, as Llama 2/3 tokenizers
    do (the default adds nothing, like Qwen2's and SmolLM's). `extra_special_tokens` follow the ChatML ones
    (a vision model's image markers).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + list(extra_special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    bos_token = "<|im_start|>"
    if add_bos_token:
        # A post-processor is where tokenizer.json keeps "prepend BOS"; it survives save and reload.
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_token} $A:0",
            pair=f"{bos_token} $A:0 {bos_token} $B:1",
            special_tokens=[(bos_token, tok.token_to_id(bos_token))],
        )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos_token,
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny_model(
    out_dir: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    dtype: str = "float32",
    add_bos_token: bool = False,
    **config_overrides,
) -> Path:
    """Write a random-weight `arch` model directory to `out_dir` and return it.

    `config_overrides` go straight into the transformers config (e.g. `rope_parameters` for llama3
    scaling, `attention_bias`, `sliding_window`). `add_bos_token`: see `build_tokenizer`.
    """
    import torch
    import transformers

    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose from {sorted(ARCHITECTURES)}")
    config_cls_name, model_cls_name = ARCHITECTURES[arch]
    tokenizer = build_tokenizer(add_bos_token=add_bos_token)
    config = getattr(transformers, config_cls_name)(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_overrides,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls_name)(config)
    # Random init gives near-uniform logits; widen them so greedy decoding is decisive and parity tests
    # are not decided by float ties.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:  # MoE experts are [num_experts, out, in] in transformers 5
                param.normal_(0.0, 0.15 if "embed" in name or "lm_head" in name else 0.08)
            elif "norm" in name and arch in _RANDOM_NORM_ARCHITECTURES:
                param.add_(torch.randn_like(param) * 0.2)
    model = model.to(getattr(torch, dtype))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _check_written(out_dir)
    return out_dir


def _check_written(out_dir: Path) -> None:
    config = json.loads((out_dir / "config.json").read_text())
    if not config.get("architectures") or not list(out_dir.glob("*.safetensors")):
        raise RuntimeError(f"tiny model in {out_dir} is incomplete")
