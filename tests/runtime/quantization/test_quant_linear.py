"""The runtime step: quantized linears against dequantize-then-matmul, and swapping them into a model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from hpi_kernels.cpu import bf16_tile, int4_a8_linear, int8_a8_linear, prefill_gemm
from hpi_runtime.attention.factory import get_attention_backend
from hpi_runtime.models.config import load_model_config
from hpi_runtime.models.linear import LinearBase
from hpi_runtime.models.loader import load_model, weight_bytes
from hpi_runtime.quantization.linear import CPU_INT8_DEQUANT_MIN_ROWS, QuantizedLinear, op_dtype
from hpi_runtime.quantization.quantize import (
    QuantizationConfig,
    QuantizedLMHead,
    check_model_supported,
    quantize_model,
    quantize_weight,
    quantized_state_dict,
)

CONFIGS = [QuantizationConfig("int8"), QuantizationConfig("int4", 32), QuantizationConfig("int4", 64)]


def _reference(x: torch.Tensor, layer_weight, bias: torch.Tensor | None, compute_dtype: torch.dtype,
               weight_dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """Dequantize (rounded to `weight_dtype`), then matmul in fp32 on the activations as the op sees them."""
    out = x.to(compute_dtype).float() @ layer_weight.dequantize().to(weight_dtype).float().T
    return out if bias is None else out + bias.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.method}-g{c.group_size}")
def test_quantized_linear_matches_dequantize_then_matmul(config, dtype) -> None:
    """fp32 / bf16 on hpi_kernels' panels (activations as they are), fp16 on torch's ops."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 128, generator=generator).to(dtype)  # N = 40: padded to whole panels
    bias = torch.randn(40, generator=generator).to(dtype)
    qw = quantize_weight(weight, config, op_dtype(torch.device("cpu"), dtype))
    layer = QuantizedLinear(qw, bias, dtype, torch.device("cpu"))
    assert layer.cpu_panels == (dtype != torch.float16)
    compute_dtype = dtype if layer.cpu_panels else op_dtype(torch.device("cpu"), dtype)
    for num_tokens in (1, 7, 33, 400):  # 400: the prefill path (weight dequantized for MKL)
        x = torch.randn(num_tokens, 128, generator=generator).to(dtype)
        out = layer(x)
        assert out.dtype == dtype and out.shape == (num_tokens, 40)
        # bf16 x reads the dequantized weight rounded to bf16 in a prefill over the bf16 GEMM (where this CPU chose
        # it) and, for int4, on the AMX tiles (where this CPU chose them; int8's codes stay exact there)
        bf16_panels = layer.cpu_panels and dtype == torch.bfloat16
        amx_int4 = config.method == "int4" and bf16_tile() == "amx"
        bf16_gemm = bf16_panels and (prefill_gemm() == "bf16" if num_tokens > 320 else amx_int4)
        expected = _reference(x, qw, bias, compute_dtype, torch.bfloat16 if bf16_gemm else torch.float32)
        # The only differences: the output's rounding to its dtype and summation order.
        torch.testing.assert_close(out.float(), expected, **_OUT_TOLERANCE[dtype])
    assert layer(torch.empty(0, 128, dtype=dtype)).shape == (0, 40)
    assert layer(torch.randn(2, 3, 128).to(dtype)).shape == (2, 3, 40)


_OUT_TOLERANCE = {
    torch.float32: {"atol": 1e-4, "rtol": 1e-5},  # fp32 sums of 128 products in another order
    torch.bfloat16: {"atol": 2e-2, "rtol": 8e-3},  # + bf16 output rounding (2**-8 relative)
    torch.float16: {"atol": 2e-2, "rtol": 8e-3},
}


def test_cpu_panels_keep_fp32_activations_unrounded() -> None:
    """torch's CPU ops (the fallback) round fp32 activations to bf16; the panels do not, at any row count."""
    generator = torch.Generator().manual_seed(1)
    qw = quantize_weight(torch.randn(40, 128, generator=generator), QuantizationConfig("int8"), torch.bfloat16)
    bias = torch.randn(40, generator=generator)
    layer = QuantizedLinear(qw, bias, torch.float32, torch.device("cpu"))
    x = torch.randn(CPU_INT8_DEQUANT_MIN_ROWS, 128, generator=generator)
    exact = x @ qw.dequantize().T + bias
    torch.testing.assert_close(layer(x), exact, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(layer(x[:8]), exact[:8], atol=1e-4, rtol=1e-5)
    rounded = torch.ops.aten._weight_int8pack_mm(x[:8].bfloat16(), qw.qweight, qw.scales).float() + bias
    assert (rounded - exact[:8]).abs().max() > 1e-3  # what the fallback would give, visibly


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_layers_with_int8_activations_run_the_a8_ops(method: str) -> None:
    """activations="int8": rows through hpi_kernels' int4_a8_linear (W4A8) / int8_a8_linear (W8A8) (x rounded to
    int8 per group: close to, not equal to, the float op) at any row count, prefill-sized too."""
    generator = torch.Generator().manual_seed(2)
    qw = quantize_weight(torch.randn(40, 128, generator=generator), QuantizationConfig(method), torch.bfloat16)
    bias = torch.randn(40, generator=generator)
    a8 = QuantizedLinear(qw, bias, torch.float32, torch.device("cpu"), activations="int8")
    plain = QuantizedLinear(qw, bias, torch.float32, torch.device("cpu"), activations="float")
    assert a8.int8_activations and not plain.int8_activations

    def direct(x: torch.Tensor) -> torch.Tensor:
        if method == "int4":
            return int4_a8_linear(x, a8.qweight, a8.scales_and_zeros, 32, 40, bias)
        return int8_a8_linear(x, a8.qweight, a8.scales, 40, bias)

    x = torch.randn(7, 128, generator=generator)
    assert torch.equal(a8(x), direct(x))
    assert not torch.equal(a8(x), plain(x))
    assert (a8(x) - plain(x)).norm() < 0.02 * plain(x).norm()  # x's rounding to 8 bits per group of 32
    long = torch.randn(400, 128, generator=generator)
    assert torch.equal(a8(long), direct(long))
    assert (a8(long) - plain(long)).norm() < 0.02 * plain(long).norm()


def _tiny_model(model_dir: Path):
    config = load_model_config(model_dir)
    return load_model(config, torch.float32, torch.device("cpu"), get_attention_backend("torch", torch.float32))


@pytest.fixture(scope="module")
def qwen_untied_dir(tiny_model_factory) -> Path:
    """qkv bias (Qwen2) and an untied LM head: the cases the Llama default does not cover."""
    return tiny_model_factory("qwen2", tie_word_embeddings=False)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.method}-g{c.group_size}")
def test_swap_keeps_structure_and_frees_float_weights(config, qwen_untied_dir: Path) -> None:
    model = _tiny_model(qwen_untied_dir)
    float_bytes = weight_bytes(model)
    linear_names = {n for n, m in model.named_modules() if isinstance(m, LinearBase)}
    old_weights = [m.weight for m in model.modules() if isinstance(m, LinearBase)]
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert len(linear_names) == 4 * model.config.num_layers

    assert quantize_model(model, config) is model
    swapped = {n for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert swapped == linear_names
    assert not any(isinstance(m, LinearBase) for m in model.modules())
    assert all(w.untyped_storage().nbytes() == 0 for w in old_weights)  # released at once, not at gc time
    assert model.model.embed_tokens.weight is embed and model.lm_head.weight is head  # kept in float
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None  # Qwen2's qkv bias survives
    assert weight_bytes(model) < float_bytes


def test_quantized_model_stays_close_to_the_float_model(qwen_untied_dir: Path) -> None:
    from hpi_runtime.evaluation.perplexity import perplexity

    ids = torch.randint(3, 200, (48,), generator=torch.Generator().manual_seed(0)).tolist()
    backend = get_attention_backend("torch", torch.float32)
    reference = perplexity(_tiny_model(qwen_untied_dir), backend, ids)
    for config in CONFIGS:
        quantized = perplexity(quantize_model(_tiny_model(qwen_untied_dir), config), backend, ids)
        assert abs(quantized / reference - 1) < 0.05, (config, quantized, reference)


def test_chunked_perplexity_is_the_one_pass_perplexity_and_sees_w4a8(qwen_untied_dir: Path) -> None:
    """Perplexity over chunks (chunked prefill) equals the one-pass figure: for the float model, and for int4 with
    int8 activations (W4A8 at every row count), which differs from int4 with float activations and stays close."""
    from hpi_runtime.evaluation.perplexity import perplexity

    ids = torch.randint(3, 200, (400,), generator=torch.Generator().manual_seed(1)).tolist()
    backend = get_attention_backend("torch", torch.float32)
    model = _tiny_model(qwen_untied_dir)
    one_pass = perplexity(model, backend, ids)
    for chunk in (1, 7, 64):
        assert perplexity(model, backend, ids, chunk) == pytest.approx(one_pass, rel=1e-5)
    a8 = quantize_model(_tiny_model(qwen_untied_dir), QuantizationConfig("int4", int4_activations="int8"))
    float_x = quantize_model(_tiny_model(qwen_untied_dir), QuantizationConfig("int4", int4_activations="float"))
    chunked = perplexity(a8, backend, ids, 64)
    # The same kernels either way; attention's sums in another order flip a few of x's int8 roundings.
    assert perplexity(a8, backend, ids) == pytest.approx(chunked, rel=1e-4)
    assert chunked != perplexity(float_x, backend, ids, 64)
    assert chunked == pytest.approx(one_pass, rel=0.05)
    with pytest.raises(ValueError, match="chunk_size must be positive"):
        perplexity(model, backend, ids, 0)


def test_int4_int8_layers_take_x_in_int8_only_when_asked(qwen_untied_dir: Path) -> None:
    """quantize_model with an unresolved config (a library caller's): int4's int8 q/k/v keep float x under
    int8_activations' auto, whatever this CPU's tiles, and take W8A8 under int8."""
    model = quantize_model(_tiny_model(qwen_untied_dir), QuantizationConfig("int4"))
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.method == "int8" and not qkv.int8_activations
    asked = quantize_model(_tiny_model(qwen_untied_dir), QuantizationConfig("int4", int8_activations="int8"))
    assert asked.model.layers[0].self_attn.qkv_proj.int8_activations


def test_next_token_logprobs_give_the_perplexity_and_a_kl_divergence(qwen_untied_dir: Path) -> None:
    """bench_quantization's KL column: the log-probs' mean at the text's next tokens is the perplexity's, a model's
    KL to itself is 0, and int4's to the float model is positive and small."""
    from hpi_runtime.evaluation.perplexity import kl_divergence, next_token_logprobs, perplexity

    ids = torch.randint(3, 200, (150,), generator=torch.Generator().manual_seed(2)).tolist()
    backend = get_attention_backend("torch", torch.float32)
    model = _tiny_model(qwen_untied_dir)
    logprobs = next_token_logprobs(model, backend, ids, 64)
    assert logprobs.shape == (len(ids) - 1, model.config.vocab_size)
    nll = -logprobs.gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    assert math.exp(nll) == pytest.approx(perplexity(model, backend, ids, 64), rel=1e-5)
    assert kl_divergence(logprobs, next_token_logprobs(model, backend, ids)) == pytest.approx(0.0, abs=1e-6)
    int4 = quantize_model(_tiny_model(qwen_untied_dir), QuantizationConfig("int4"))
    assert 0 < kl_divergence(logprobs, next_token_logprobs(int4, backend, ids, 64)) < 0.05


def test_lm_head_quantized_only_when_asked(qwen_untied_dir: Path) -> None:
    model = quantize_model(_tiny_model(qwen_untied_dir), QuantizationConfig("int8", quantize_lm_head=True))
    assert isinstance(model.lm_head, QuantizedLMHead)
    assert model.compute_logits(torch.randn(3, model.config.hidden_size)).dtype == torch.float32
    assert not isinstance(quantize_model(_tiny_model(qwen_untied_dir), CONFIGS[0]).lm_head, QuantizedLMHead)


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tied_lm_head_quantizes_to_int8_and_the_embedding_reads_it(method, dtype, tiny_model_dir: Path) -> None:
    """A head tied to the embeddings becomes int8 whatever the method (the embeddings look their rows up in
    it, llama.cpp's choice in its Q4_0/Q8_0 files); with float x its logits are the fp32 sums of the int8 matmul,
    unrounded, and the float matrix is gone (x in int8: test_quant_wiring.py and the kernel's tests)."""
    config = load_model_config(tiny_model_dir)
    assert config.tie_word_embeddings
    model = load_model(config, dtype, torch.device("cpu"), get_attention_backend("torch", dtype))
    float_matrix = model.lm_head.weight.detach().clone()
    quantize_model(model, QuantizationConfig(method, 32, quantize_lm_head=True, lm_head_activations="float"))
    head, embedding = model.lm_head, model.model.embed_tokens
    assert isinstance(head, QuantizedLMHead) and head.method == "int8"
    assert embedding.weight.untyped_storage().nbytes() == 0
    reference = quantize_weight(float_matrix, QuantizationConfig("int8"), op_dtype(head.qweight.device, dtype))
    dequantized = reference.dequantize()  # [vocab, hidden] fp32
    ids = torch.tensor([[0, 5, config.vocab_size - 1], [7, 7, 3]])
    torch.testing.assert_close(embedding(ids), dequantized[ids].to(dtype), atol=0, rtol=0)
    hidden = torch.randn(4, config.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden.float() @ dequantized.T, atol=1e-4, rtol=1e-4)


def test_quantized_state_dict_names(tiny_model_dir: Path) -> None:
    model = _tiny_model(tiny_model_dir)
    state = quantized_state_dict(model, QuantizationConfig("int4", 32, int4_policy="uniform"))
    prefix = "model.layers.0.mlp.down_proj"
    assert state[f"{prefix}.qweight"].dtype == torch.uint8
    assert {f"{prefix}.scales", f"{prefix}.zeros"} <= state.keys()
    assert not any(k.startswith(("lm_head", "model.embed_tokens")) for k in state)


def test_group_size_must_divide_every_k_before_loading(tiny_model_dir: Path) -> None:
    config = load_model_config(tiny_model_dir)  # hidden 64: group 128 cannot tile it
    with pytest.raises(ValueError, match="does not divide"):
        check_model_supported(config, QuantizationConfig("int4", 128))
    check_model_supported(config, QuantizationConfig("int4", 32))
    check_model_supported(config, QuantizationConfig("int8", 128))  # group size is int4's only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.method}-g{c.group_size}")
def test_quantized_linear_on_cuda_uses_the_triton_kernels(config, dtype) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 256, generator=generator).to(dtype)
    qw = quantize_weight(weight, config)
    layer = QuantizedLinear(qw, None, dtype, device)
    assert layer.qweight.is_cuda
    for num_tokens in (1, 16, 80):
        x = torch.randn(num_tokens, 256, generator=generator).to(dtype)
        out = layer(x.to(device))
        expected = (x.float() @ qw.dequantize().T).to(dtype)
        tol = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 3e-2}[dtype]
        torch.testing.assert_close(out.cpu(), expected, atol=tol * 16, rtol=tol)
