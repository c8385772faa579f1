"""Random weights in real models' shapes, for the GPU check: the embedded model's GGUF (98 MB) and any 1B
checkpoint are too large to travel to the GPU machine, and timings depend on shapes, not on weight values.

Each model directory is a whole checkpoint (config.json, model.safetensors, the tokenizer and chat template), so
`hpi serve`, the engine and transformers load it by the same paths as a downloaded one. The tokenizer is the
embedded SmolLM2's (it travels in the kit folder: `make gpu-kit`), so prompts tokenize as they would in
production; every shape below keeps its 49,152-token vocabulary so that every sampled id decodes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

# SmolLM2-135M-Instruct, as the embedded model's config.json has it.
EMBEDDED_SHAPE = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
    head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
)
# Llama-3.2-1B's layers (hidden 2048, 16 layers, 32 query / 8 KV heads of 64, MLP 8192, rope theta 500000); its
# 128,256-token vocabulary is replaced by SmolLM2's (a 0.25 GB smaller LM head) so the shared tokenizer decodes
# every id.
ONE_B_SHAPE = dict(
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
    head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0,
)
# Llama-3.1-8B-Instruct's config.json (hidden 4096, 32 layers, 32 query / 8 KV heads of 128, MLP 14336, untied
# 128,256-token vocabulary, rope theta 500000; its llama3 rope scaling changes no timing): 8,030,261,248 parameters,
# the fleet optimizer's headline model (bench/fleet_sim/pools.py). The profile part builds it, no other: ids past
# the shared tokenizer's 49,152 decode to nothing, which `hpi profile` (token ids in, step times out) never reads.
EIGHT_B_SHAPE = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=500000.0, vocab_size=128256,
)
SHAPES = {"embedded": EMBEDDED_SHAPE, "1b": ONE_B_SHAPE, "8b": EIGHT_B_SHAPE}
VOCAB_SIZE = 49152  # SmolLM2's, every shape's but the 8B's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def build_random_model(
    shape: str, out_dir: Path, tokenizer_dir: Path, device: torch.device, dtype: torch.dtype = torch.bfloat16,
    seed: int = 0, num_layers: int | None = None,
) -> Path:
    """Write a random-weight Llama checkpoint of `shape` (a key of SHAPES; `num_layers` of its layers when
    given) to `out_dir` (kept when it is already complete) and return it. Weights are drawn on `device` (seconds
    for 1B on a GPU)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose from {sorted(SHAPES)}")
    if (out_dir / "model.safetensors").is_file() and (out_dir / "config.json").is_file():
        return out_dir
    missing = [name for name in TOKENIZER_FILES[:2] if not (tokenizer_dir / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{tokenizer_dir} lacks {', '.join(missing)} (make gpu-kit puts them in the kit)")
    fields = {"vocab_size": VOCAB_SIZE, **SHAPES[shape]}
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    rope_theta = fields.pop("rope_theta")
    config = LlamaConfig(
        max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta}, **fields,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    # transformers initialises with std 0.02, which leaves near-uniform logits; a wider spread makes greedy
    # choices decisive, so runs with and without CUDA graphs can be compared token for token.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.1 if "embed" in name else 0.04)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def parameter_count(shape: str, num_layers: int | None = None) -> int:
    """Parameters of `shape` (tied embeddings counted once), for the report."""
    s = {"vocab_size": VOCAB_SIZE, **SHAPES[shape], **({} if num_layers is None else {"num_hidden_layers": num_layers})}
    q = s["num_attention_heads"] * s["head_dim"]
    kv = s["num_key_value_heads"] * s["head_dim"]
    layer = s["hidden_size"] * (2 * q + 2 * kv) + 3 * s["hidden_size"] * s["intermediate_size"] + 2 * s["hidden_size"]
    embeddings = s["vocab_size"] * s["hidden_size"] * (1 if s["tie_word_embeddings"] else 2)
    return s["num_hidden_layers"] * layer + embeddings + s["hidden_size"]


def tokenizer_dir(kit_dir: Path) -> Path:
    """The kit's copy of the embedded tokenizer, else (on a development machine) the converted embedded model's."""
    if (kit_dir / "tokenizer" / "tokenizer.json").is_file():
        return kit_dir / "tokenizer"
    from hpi_runtime.embedded import embedded_model_dir

    return embedded_model_dir()


# A dry run checks the code, not the speed: the embedded shape with 2 of its 30 layers (every other size as is) runs
# the same paths in a fraction of the time on a CI machine's 2 cores.
DRY_RUN_LAYERS = 2


def run(ctx) -> dict:
    """The weights part: each shape's checkpoint under ctx.models' folder, built once (the 1B only on a GPU)."""
    import time

    results, skipped = {}, {}
    num_layers = DRY_RUN_LAYERS if ctx.dry_run else None
    if ctx.dry_run:
        skipped["all layers"] = f"the dry run builds {DRY_RUN_LAYERS} layers of each shape: code paths, not speed"
    for shape, path in ctx.models.items():
        if shape == "1b" and ctx.device.type != "cuda":
            skipped["1b"] = "1B-shaped weights (2.1 GB in bf16) are built only on a GPU machine"
            continue
        start = time.perf_counter()
        build_random_model(shape, path, tokenizer_dir(ctx.kit_dir), ctx.device, num_layers=num_layers)
        results[shape] = {"path": str(path), "parameters": parameter_count(shape, num_layers),
                          "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
    built = ", ".join(f"{shape} {r['parameters'] / 1e6:.0f}M in {r['seconds']} s" for shape, r in results.items())
    results["headline"] = [f"random bf16 weights: {built}"]
    return {**results, "skipped": skipped}
