"""Pre-quantized checkpoints: tiny GPTQ / AWQ / compressed-tensors models written as their tools write them,
loaded into our int4/int8 layers, compared with the weights each format's dequantization defines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hpi_runtime.attention.factory import get_attention_backend
from hpi_runtime.config import EngineArgs
from hpi_runtime.engine_factory import resolve_engine
from hpi_runtime.llm import LLM
from hpi_runtime.models.config import load_model_config
from hpi_runtime.models.loader import load_model
from hpi_runtime.quantization.checkpoint import parse_quantization_config, read_checkpoint_quantization
from hpi_runtime.quantization.linear import QuantizedLinear
from hpi_runtime.sampling_params import SamplingParams
from hpi_testing.quantized_checkpoints import (
    FORMATS,
    Format,
    compressed_tensors_config,
    gptq_config,
    write_quantized_checkpoint,
)

CPU = torch.device("cpu")
# Our layer -> the checkpoint linears stacked in it (along N), in order.
MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.fixture(scope="module")
def float_dir(tiny_model_factory) -> Path:
    # Every K (hidden 256, 8 heads x 32, intermediate 512) is two or more of the formats' groups of 128, so
    # act-order permutations are not trivial.
    return tiny_model_factory("llama", hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2)


def _load(model_dir: Path, dtype: torch.dtype):
    return load_model(load_model_config(model_dir), dtype, CPU, get_attention_backend("torch", dtype, CPU))


def _reference_weight(reference: dict[str, torch.Tensor], layer_name: str) -> torch.Tensor:
    parent, _, child = layer_name.rpartition(".")
    return torch.cat([reference[f"{parent}.{part}"] for part in MERGED.get(child, (child,))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_loaded_layers_compute_with_the_formats_dequantized_weights(
    fmt: Format, dtype: torch.dtype, float_dir: Path, tmp_path: Path
) -> None:
    reference = write_quantized_checkpoint(float_dir, tmp_path / fmt.name, fmt)
    assert read_checkpoint_quantization(tmp_path / fmt.name).bits == fmt.bits
    model = _load(tmp_path / fmt.name, dtype)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(layers) == 2 * 4  # qkv, o, gate_up, down in each of the 2 layers, all from the checkpoint
    generator = torch.Generator().manual_seed(1)
    for name, layer in layers.items():
        assert layer.method == ("int8" if fmt.bits == 8 else "int4")
        assert (layer.input_perm is not None) == fmt.act_order
        weight = _reference_weight(reference, name)
        x = torch.randn(5, weight.shape[1], generator=generator).to(dtype)
        expected = x.to(layer.compute_dtype).float() @ weight.T
        error = (layer(x).float() - expected).norm() / expected.norm()
        # bf16 scales/zeros and bf16 outputs: ~0.5%; a wrong nibble order, zero offset or permutation: > 10%.
        assert error < 0.02, f"{fmt.name} {name}: relative error {error:.4f}"
    # Nothing but the linears is quantized, and no float copy of a quantized weight was made.
    assert all(p.dtype == dtype for n, p in model.named_parameters() if n.rpartition(".")[0] not in layers)


def test_act_order_model_matches_its_dequantized_float_twin(float_dir: Path, tmp_path: Path) -> None:
    """The whole forward pass, permutations included: logits of the GPTQ act-order model against the same
    weights written back as a float checkpoint."""
    from safetensors.torch import load_file, save_file

    fmt = FORMATS[0]
    assert fmt.act_order
    quantized_dir = tmp_path / "gptq"
    reference = write_quantized_checkpoint(float_dir, quantized_dir, fmt)
    twin_dir = tmp_path / "twin"
    twin_dir.mkdir()
    for path in float_dir.iterdir():
        if path.suffix != ".safetensors":
            (twin_dir / path.name).write_bytes(path.read_bytes())
    state = load_file(str(float_dir / "model.safetensors"))
    state.update({f"{prefix}.weight": w for prefix, w in reference.items()})
    save_file(state, str(twin_dir / "model.safetensors"))
    ids = list(range(3, 40))
    logits = []
    for model_dir in (quantized_dir, twin_dir):
        llm_model = _load(model_dir, torch.float32)
        logits.append(_prefill_logits(llm_model, ids))
    error = (logits[0] - logits[1]).norm() / logits[1].norm()
    assert error < 0.02, f"relative logit error {error:.4f}"


def _prefill_logits(model, ids: list[int]) -> torch.Tensor:
    from hpi_runtime.attention.metadata import AttentionMetadata
    from hpi_runtime.worker.model_runner import KVCacheSpec, allocate_kv_caches

    n, backend = len(ids), get_attention_backend("torch", torch.float32, CPU)
    num_blocks = -(-n // 16)
    allocate_kv_caches(model, KVCacheSpec(num_blocks, 16, torch.float32), CPU)
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(n), block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        query_start_loc=torch.tensor([0, n], dtype=torch.int32), context_lens=torch.tensor([n], dtype=torch.int32),
        num_decode_reqs=0, max_query_len=n, max_context_len=n, block_size=16,
    )  # fmt: skip
    with torch.inference_mode():
        for attn in model.attention_layers():
            attn.backend = backend
        hidden = model(torch.tensor(ids), torch.arange(n), backend.build_metadata(metadata))
        return model.compute_logits(hidden)


def test_engine_serves_a_pre_quantized_checkpoint_without_requantizing(float_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "awq"
    write_quantized_checkpoint(float_dir, model_dir, FORMATS[2])
    llm = LLM(model_dir, dtype="bfloat16", kv_cache_memory_bytes=1 << 20, max_model_len=64, enforce_eager=True)
    assert llm.bundle.resolved.quantization == "int4"
    assert llm.bundle.resolved.quantization_scheme == "awq-int4-g128"
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert len(out.output_token_ids) == 4
    # Asking for the checkpoint's own precision is fine; asking to re-quantize it to another is not.
    resolve_engine(EngineArgs.from_options(model=str(model_dir), quantization="int4"))
    with pytest.raises(ValueError, match="pre-quantized"):
        resolve_engine(EngineArgs.from_options(model=str(model_dir), quantization="int8"))


@pytest.mark.parametrize(
    "config, match",
    [
        ({**gptq_config(), "bits": 3}, "only 4-bit GPTQ"),
        ({**gptq_config(), "group_size": -1}, "per-channel int4 is not supported"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "only the GEMM packing"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "unsupported quantization_config quant_method"),
        ({**compressed_tensors_config(4), "format": "marlin-24"}, "format 'marlin-24'"),
        (_w8a8 := {**compressed_tensors_config(8), "config_groups": {"g": {
            **compressed_tensors_config(8)["config_groups"]["group_0"],
            "input_activations": {"num_bits": 8, "type": "int"}}}}, "activation quantization"),  # fmt: skip
    ],
    ids=["gptq-3bit", "gptq-per-channel", "awq-gemv", "bitsandbytes", "ct-marlin", "ct-w8a8"],
)
def test_unsupported_quantization_configs_raise_value_error(config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_quantization_config(config)


def test_unsupported_checkpoint_fails_before_loading_weights(float_dir: Path, tmp_path: Path) -> None:
    model_dir = tmp_path / "gptq3"
    model_dir.mkdir()
    for path in float_dir.iterdir():
        (model_dir / path.name).write_bytes(path.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {**gptq_config(), "bits": 3}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="only 4-bit GPTQ"):
        resolve_engine(EngineArgs.from_options(model=str(model_dir)))
