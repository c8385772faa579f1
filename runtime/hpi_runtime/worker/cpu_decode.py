"""Decode steps on CPU as one C++ call for all of a stage's layers: hpi_kernels' DecodeStack.

A compiled step still pays per op: every norm, RoPE, linear, attention call and residual add of every layer goes
through Inductor's Python wrapper and a dispatch, and opens its own OpenMP region. For a one-request step of a
small model that is as long as reading the weights (~3 ms of a 7 ms int4 step of SmolLM2-135M on 2 cores:
bench/results/quant_llamacpp.md); llama.cpp runs the same token as one graph. The stack holds the layers' weights
and KV caches (registered once, after loading, packing and warm-up) and runs a step's layers in C++, calling
the same linear and attention kernels the model calls, so its output is the eager model's (the element-wise ops
round where the eager ones round).

It takes the steps it was measured faster on: decode-only steps (every request one new token, no drafts); the
rest (prefill chunks, speculative verification) run the compiled graph. A model takes it when every layer is the
shared decoder's block (models/decoder.py: DecoderAttention, with Qwen3's q/k norms or without; GatedMLP with SiLU
or GELU gates; Gemma's sandwich norms and second RoPE or not) on one tensor-parallel rank, without image inputs,
its linears in a form the C++ ops run (packed panels, int8/int4 panels, or plain float) and its attention on the
C++ kernel; `unsupported_reason` says why not otherwise. With LoRA adapters the stack holds each adapted linear's
slots (lora/layers.py, the C++ kernel's form) and adds each token's delta by the step's slots, as the hooks do.
"""

from __future__ import annotations

import torch
from torch import nn

from hpi_kernels.cpu import cpu_kernels_available
from hpi_runtime.attention.op import PagedAttentionInputs
from hpi_runtime.lora.layers import LoRAModel
from hpi_runtime.models.decoder import DecoderAttention, DecoderForCausalLM, DecoderLayer, GatedMLP
from hpi_runtime.models.layers import gelu_and_mul, gelu_tanh_and_mul, silu_and_mul
from hpi_runtime.models.linear import LinearBase
from hpi_runtime.quantization.linear import QuantizedLinear

# LinearKind in decode_stack.cpp
_UNPACKED, _PACKED, _INT8, _INT4, _INT4_A8, _INT8_A8 = 0, 1, 2, 3, 4, 5
# Activation in decode_stack.cpp, by GatedMLP's gate function
_ACTIVATIONS = {silu_and_mul: 0, gelu_tanh_and_mul: 1, gelu_and_mul: 2}
_NONE = torch.empty(0)


def _linear_args(module: nn.Module) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, int, int] | str:
    """DecodeStack.add_linear's arguments for one of the model's linears, or why it cannot take it."""
    if isinstance(module, QuantizedLinear):
        if not module.cpu_panels or module.input_perm is not None:
            return f"a quantized linear without the C++ panels ({module.extra_repr()})"
        bias = _NONE if module.bias is None else module.bias
        if module.method == "int8":
            kind = _INT8_A8 if module.int8_activations else _INT8
            return kind, module.qweight, module.scales, bias, module.out_features, 0
        kind = _INT4_A8 if module.int8_activations else _INT4
        return kind, module.qweight, module.scales_and_zeros, bias, module.out_features, module.group_size
    if isinstance(module, LinearBase):
        bias = _NONE if module.bias is None else module.bias
        if module.packed_out_features is not None:
            return _PACKED, module.weight, _NONE, bias, module.packed_out_features, 0
        return _UNPACKED, module.weight, _NONE, bias, module.weight.shape[0], 0
    return f"a {type(module).__name__} linear"


def unsupported_reason(model: DecoderForCausalLM, dtype: torch.dtype, uses_cpu_kernel: bool) -> str | None:
    """Why the stack cannot run this model's decode steps, or None when it can. `uses_cpu_kernel`: whether the
    model's attention runs the C++ CPU kernel (attention/op.py)."""
    if dtype not in (torch.float32, torch.bfloat16):
        return f"{dtype} activations (the stack runs fp32 and bf16)"
    if not cpu_kernels_available():
        return "the C++ CPU kernels did not build"
    if not uses_cpu_kernel:
        return "attention does not run the C++ CPU kernel"
    decoder = model.model
    if decoder.tp.size > 1:
        return "tensor parallelism (the layers' all-reduces run between their ops)"
    if decoder.rotary.mrope_axis is not None:
        return "M-RoPE (positions per axis)"
    if not decoder._own:
        return "no decoder layers on this pipeline stage"
    for layer, _ in decoder._own:
        attention = getattr(layer, "self_attn", None)
        if type(layer) is not DecoderLayer or not isinstance(attention, DecoderAttention) or (
                type(attention).forward is not DecoderAttention.forward):  # fmt: skip
            return (f"a {type(layer).__name__} with {type(attention).__name__} (the stack runs the shared "
                    "DecoderAttention's forward)")  # fmt: skip
        if type(layer.mlp) is not GatedMLP or layer.mlp.act_and_mul not in _ACTIVATIONS:
            return f"a {type(layer.mlp).__name__} MLP (the stack runs GatedMLP with SiLU or GELU gates)"
        for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
            if isinstance(args := _linear_args(linear), str):
                return args
    return None


def build_stack(model: DecoderForCausalLM, lora: LoRAModel | None = None) -> torch.ScriptObject:
    """A DecodeStack over this stage's layers (unsupported_reason must have said None), with the final norm on
    the last stage and `lora`'s adapter slots on the linears it adapts."""
    decoder, config = model.model, model.config
    first_layer = next(layer for layer, _ in decoder._own)
    first, first_mlp = first_layer.self_attn, first_layer.mlp
    stack = torch.classes.hpi_kernels.DecodeStack(
        first.num_heads, first.num_kv_heads, first.head_dim, config.rms_norm_eps, config.norm_unit_offset,
        decoder.rotary.cos.contiguous(), decoder.rotary.sin.contiguous(),
    )  # fmt: skip
    stack.set_activation(_ACTIVATIONS[first_mlp.act_and_mul])
    if decoder.sliding_rotary is not None:
        stack.set_sliding_rope(decoder.sliding_rotary.cos.contiguous(), decoder.sliding_rotary.sin.contiguous())
    for layer, uses_sliding_rope in decoder._own:
        attention, mlp = layer.self_attn, layer.mlp
        for linear in (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj):
            stack.add_linear(*_linear_args(linear))
            if isinstance(linear, QuantizedLinear) and linear.int8_activations:
                stack.set_a8_max_rows(linear.a8_max_rows)
            if lora is not None and (slots := lora.by_module.get(linear)) is not None:
                stack.set_lora(slots.a, slots.bt, slots.part_cols, slots.amx)
        attn = attention.attn
        stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, attn.k_cache,
                        attn.v_cache, attn.scale, attn.sliding_window or 0, attn.logit_softcap or 0.0)  # fmt: skip
        if attention.q_norm is not None:
            stack.set_head_norms(attention.q_norm.weight, attention.k_norm.weight)
        if layer.pre_feedforward_layernorm is not None:
            stack.set_sandwich_norms(layer.pre_feedforward_layernorm.weight, layer.post_feedforward_layernorm.weight)
        if uses_sliding_rope:
            stack.use_sliding_rope()
    if decoder.stage.is_last:
        stack.set_final_norm(decoder.norm.weight)
    return stack


class CpuDecodeStack:
    """The model's decode steps of up to `max_rows` tokens through a DecodeStack; `build` (re)registers the
    current weights and KV caches (at start-up, and after a wake), `release` drops them (before a sleep)."""

    def __init__(self, model: DecoderForCausalLM, max_rows: int, lora: LoRAModel | None = None) -> None:
        self.model, self.max_rows, self.lora = model, max_rows, lora
        self._stack: torch.ScriptObject | None = None
        self.steps = 0  # steps run here

    def build(self) -> None:
        self._stack = build_stack(self.model, self.lora)

    def release(self) -> None:
        self._stack = None

    def takes(self, num_tokens: int, max_query_len: int, num_drafts: tuple[int, ...]) -> bool:
        """Whether a step of these inputs runs here: decodes only, one token each, at most max_rows."""
        return (self._stack is not None and max_query_len == 1 and 0 < num_tokens <= self.max_rows
                and not any(num_drafts))  # fmt: skip

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: PagedAttentionInputs,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As the model's forward (models/decoder.py DecoderModel.forward) for a step `takes` accepted."""
        self.steps += 1
        hidden = self.model.model.embed(input_ids) if inputs_embeds is None else inputs_embeds
        # The step's adapter slots (set by the runner before the forward; "cpu" mode: always a tensor).
        lora_slots = _NONE if self.lora is None else self.lora.batch.token_slots
        return self._stack.forward(hidden, positions, metadata.slot_mapping, metadata.block_tables,
                                   metadata.query_start_loc, metadata.context_lens, lora_slots)  # fmt: skip
