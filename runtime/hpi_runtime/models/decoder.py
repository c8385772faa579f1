"""The shared decoder-only transformer every dense family is built from, over flat token batches and a paged KV cache.

Inputs are flat: all requests' new tokens concatenated ([num_tokens]), with their positions and the
attention metadata saying which request each token belongs to. No batch or sequence axis, no padding.

What differs between families is read from ModelConfig (biases, q/k norms, Gemma's norm offset, sandwich
norms, embedding scale and soft-capping, per-layer sliding windows and RoPE, the MLP activation); the
family modules (llama.py, qwen2.py, qwen3.py, phi3.py, gemma.py, ...) say how their config.json sets those
fields (`config_rules`, family.py), name their checkpoint layout and, where a family has one, their own
attention or MLP class. A family with another MLP (Mixture-of-Experts) overrides
`DecoderForCausalLM.make_mlp`; one with another attention, `make_attention`.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from hpi_runtime.attention.backend import AttentionBackend
from hpi_runtime.attention.layer import Attention
from hpi_runtime.models.config import ModelConfig
from hpi_runtime.models.family import FamilyRules
from hpi_runtime.models.layers import GATED_ACTIVATIONS, LMHead, RMSNorm, VocabEmbedding, softcap
from hpi_runtime.models.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from hpi_runtime.models.parallel import (
    SINGLE,
    SINGLE_STAGE,
    PipelineStage,
    Span,
    TensorParallel,
    balanced_span,
    mlp_span,
    split_heads,
)
from hpi_runtime.models.rotary import RotaryEmbedding, apply_rotary

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [num_tokens, 1, rotary_dim // 2] for this step's positions


def _plus_residual(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor | None,
                   tp: TensorParallel) -> torch.Tensor:  # fmt: skip
    """proj(x) summed over tensor-parallel ranks, plus `residual` when given. Without tensor parallelism a float
    linear adds it itself (LinearBase.forward): the packed CPU op then folds the add into its GEMM, as Inductor
    folds it into addmm over torch's own linears. Left to the compiled graph after an opaque op, each layer's
    `hidden + out` stayed unrealized and every RMSNorm summed up to five [tokens, hidden] buffers again (and a
    2,048-token bf16 prefill step of SmolLM2-135M spent 40-55 ms in its norms against 12 with torch's linears;
    bench/results/amx.md)."""
    if residual is not None and tp.size == 1 and isinstance(proj, LinearBase):
        return proj(x, residual)
    out = tp.all_reduce(proj(x))
    return out if residual is None else residual + out


def _with_residual(block: nn.Module, residual: torch.Tensor, *args: object) -> torch.Tensor:
    """residual + block(*args), the add handed to a block that takes it (adds_residual)."""
    if getattr(block, "adds_residual", False):
        return block(*args, residual=residual)
    return residual + block(*args)


class DecoderAttention(nn.Module):
    """Fused qkv projection, optional per-head q/k RMSNorm (`config.qk_norm`), RoPE, paged attention with the
    layer's sliding window and soft-cap, output projection. Heads are split over tensor-parallel ranks."""

    def __init__(self, config: ModelConfig, layer: int, backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        heads = split_heads(config.num_heads, config.num_kv_heads, tp.size, tp.rank)
        self.tp, self.head_dim = tp, config.head_dim
        self.num_heads, self.num_kv_heads = heads.q.size, heads.kv.size  # this rank's
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, config.head_dim, heads, bias=config.qkv_bias, total_q_heads=config.num_heads
        )
        self.o_proj = RowParallelLinear(
            Span(heads.q.start * config.head_dim, heads.q.size * config.head_dim),
            config.hidden_size,
            bias=config.o_proj_bias,
            holds_bias=tp.is_first,
        )
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_unit_offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_unit_offset)
        self.attn = Attention(
            self.num_heads,
            self.num_kv_heads,
            config.head_dim,
            backend,
            scale=config.attention_scale,
            sliding_window=config.layer_sliding_windows[layer],
            logit_softcap=config.attn_logit_softcap,
        )

    adds_residual = True  # forward takes `residual` (DecoderLayer)

    def forward(self, rope: Rope, hidden: torch.Tensor, metadata: object,
                residual: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The attention block's output, plus `residual` when given (folded into o_proj: _plus_residual)."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(hidden)
        qk = qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        # q and k rotate together: one set of element-wise ops instead of two.
        qk = apply_rotary(qk, *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, metadata)
        return _plus_residual(self.o_proj, out.view(-1, q_size), residual, self.tp)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up in one column-parallel matrix."""

    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        span = mlp_span(config.intermediate_size, tp.size, tp.rank)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [span, span], bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(span, config.hidden_size, bias=config.mlp_bias, holds_bias=tp.is_first)
        self.act_and_mul = GATED_ACTIVATIONS[config.hidden_act]

    adds_residual = True  # forward takes `residual` (DecoderLayer)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's output, plus `residual` when given (folded into down_proj: _plus_residual)."""
        return _plus_residual(self.down_proj, self.act_and_mul(self.gate_up_proj(x)), residual, self.tp)


class DecoderLayer(nn.Module):
    """Pre-norm residual block. With `config.sandwich_norms` (Gemma 2/3) the attention and MLP outputs are
    normed too before they join the residual, and the MLP input has its own norm."""

    def __init__(self, config: ModelConfig, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        eps, offset = config.rms_norm_eps, config.norm_unit_offset
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)

    def forward(self, rope: Rope, hidden: torch.Tensor, metadata: object) -> torch.Tensor:
        if self.pre_feedforward_layernorm is None:
            hidden = _with_residual(self.self_attn, hidden, rope, self.input_layernorm(hidden), metadata)
            return _with_residual(self.mlp, hidden, self.post_attention_layernorm(hidden))
        attended = self.self_attn(rope, self.input_layernorm(hidden), metadata)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class MissingLayer(nn.Module):
    """The place of a layer another pipeline stage holds: no parameters, so checkpoint names keep their global
    layer index (model.layers.N...) on every stage (vLLM's PPMissingLayer)."""


class DecoderModel(nn.Module):
    def __init__(
        self, config: ModelConfig, layers: list[nn.Module], tp: TensorParallel, stage: PipelineStage = SINGLE_STAGE
    ) -> None:
        super().__init__()
        self.config, self.tp, self.stage = config, tp, stage
        vocab_span = balanced_span(config.vocab_size, tp.size, tp.rank)
        embed_scale = config.hidden_size**0.5 if config.scale_embeddings else None
        self.vocab_span = vocab_span
        self.embed_tokens = None  # on the first stage, and on the last when the LM head is tied to it
        if stage.is_first or (stage.is_last and config.tie_word_embeddings):
            self.embed_tokens = VocabEmbedding(vocab_span, config.hidden_size, config.vocab_size, embed_scale)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        self.sliding_rotary = None
        if config.sliding_rope is not None:
            self.sliding_rotary = RotaryEmbedding(config.sliding_rope, config.head_dim, config.max_position_embeddings)
        # per layer: whether it takes the sliding-window layers' RoPE
        self._uses_sliding_rope = tuple(config.layer_rope(i) is not config.rope for i in range(config.num_layers))
        self.layers = nn.ModuleList(layers)
        # This stage's layers (all of them without pipeline parallelism), with the RoPE each takes.
        self._own = [(layer, uses) for layer, uses in zip(layers, self._uses_sliding_rope, strict=True)
                     if not isinstance(layer, MissingLayer)]  # fmt: skip
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> the token embeddings [num_tokens, hidden_size] (summed over ranks)."""
        return self.tp.all_reduce(self.embed_tokens(input_ids))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: object,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`inputs_embeds`: the hidden states to start from instead of input_ids' embeddings: image rows merged in
        (a multimodal model), or the previous pipeline stage's output. Returns the normed final hidden states on
        the last stage, this stage's raw output on the others."""
        hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        rope = self.rotary(positions)  # looked up once per step, used by every layer
        sliding_rope = self.sliding_rotary(positions) if self.sliding_rotary is not None else rope
        for layer, uses_sliding_rope in self._own:
            hidden = layer(sliding_rope if uses_sliding_rope else rope, hidden, metadata)
        return self.norm(hidden) if self.stage.is_last else hidden


class DecoderForCausalLM(nn.Module):
    """A dense decoder family; subclasses set their config rules and checkpoint layout and may override the
    attention or MLP. The base class is Llama's."""

    config_rules: ClassVar[FamilyRules] = FamilyRules()  # how the family reads config.json (family.py)
    # Checkpoint names under these prefixes load as they are, never through packed_modules_mapping (a vision
    # tower's own q/k/v or gate/up projections).
    unpacked_prefixes: ClassVar[tuple[str, ...]] = ()

    # checkpoint tensor name part -> (our parameter name part, shard id) for merged projections
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel = SINGLE,
        stage: PipelineStage = SINGLE_STAGE,
    ) -> None:  # fmt: skip
        super().__init__()
        self.config, self.tp, self.stage = config, tp, stage
        layers = [
            DecoderLayer(config, self.make_attention(config, i, backend, tp), self.make_mlp(config, i, tp))
            if stage.owns_layer(i) else MissingLayer()
            for i in range(config.num_layers)
        ]  # fmt: skip
        self.model = DecoderModel(config, layers, tp, stage)
        self.lm_head = None  # on the last stage only
        if stage.is_last:
            tied = self.model.embed_tokens if config.tie_word_embeddings else None
            self.lm_head = LMHead(self.model.vocab_span, config.hidden_size, config.vocab_size, tied)
        self._vocab_sizes = [balanced_span(config.vocab_size, tp.size, r).size for r in range(tp.size)]

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """A checkpoint tensor's name as this class's parameters spell it (a family saved under other names)."""
        return name

    def make_attention(
        self, config: ModelConfig, layer: int, backend: AttentionBackend, tp: TensorParallel
    ) -> nn.Module:
        return DecoderAttention(config, layer, backend, tp)

    def make_mlp(self, config: ModelConfig, layer: int, tp: TensorParallel) -> nn.Module:
        return GatedMLP(config, tp)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: object,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden_size] (a pipeline stage
        before the last: its output, the next stage's `inputs_embeds`).

        `metadata`: the step's attention metadata as the attention backend built it (build_metadata).
        `inputs_embeds` ([num_tokens, hidden_size]): the inputs instead of input_ids' embeddings (image rows merged
        in, positions then [3, num_tokens] with M-RoPE; or the previous pipeline stage's output)."""
        return self.model(input_ids, positions, metadata, inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_rows, hidden_size] -> fp32 logits [num_rows, vocab_size] on rank 0 (None on the others)."""
        logits = self.tp.gather_columns(self.lm_head(hidden), self._vocab_sizes)
        cap = self.config.final_logit_softcap
        return softcap(logits, cap) if cap is not None and logits is not None else logits

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers if not isinstance(layer, MissingLayer)]
