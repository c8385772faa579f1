"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM) over flat token batches and a paged KV cache.

Inputs are flat: all requests' new tokens concatenated ([num_tokens]), with their positions and the
attention metadata saying which request each token belongs to. No batch or sequence axis, no padding.
"""

from __future__ import annotations

import torch
from torch import nn

from hpi_runtime.model.attention import Attention, AttentionBackend
from hpi_runtime.model.config import ModelConfig
from hpi_runtime.model.layers import LMHead, RMSNorm, VocabEmbedding, silu_and_mul
from hpi_runtime.model.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from hpi_runtime.model.parallel import SINGLE, Span, TensorParallel, balanced_span, mlp_span, split_heads
from hpi_runtime.model.rotary import RotaryEmbedding, apply_rotary

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [num_tokens, 1, head_dim // 2] for this step's positions


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        heads = split_heads(config.num_heads, config.num_kv_heads, tp.size, tp.rank)
        self.tp, self.head_dim = tp, config.head_dim
        self.num_heads, self.num_kv_heads = heads.q.size, heads.kv.size  # this rank's
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, heads, bias=config.qkv_bias)
        self.o_proj = RowParallelLinear(
            Span(heads.q.start * config.head_dim, heads.q.size * config.head_dim),
            config.hidden_size,
            bias=config.o_proj_bias,
            holds_bias=tp.is_first,
        )
        self.attn = Attention(self.num_heads, self.num_kv_heads, config.head_dim, backend)

    def forward(self, rope: Rope, hidden: torch.Tensor, metadata: object) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(hidden)
        # q and k rotate together: one set of element-wise ops instead of two.
        qk = apply_rotary(qkv[:, : q_size + kv_size].view(-1, self.num_heads + self.num_kv_heads, self.head_dim), *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].view(-1, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, metadata)
        return self.tp.all_reduce(self.o_proj(out.view(-1, q_size)))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        span = mlp_span(config.intermediate_size, tp.size, tp.rank)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [span, span], bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(span, config.hidden_size, bias=config.mlp_bias, holds_bias=tp.is_first)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope: Rope, hidden: torch.Tensor, metadata: object) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        vocab_span = balanced_span(config.vocab_size, tp.size, tp.rank)
        self.embed_tokens = VocabEmbedding(vocab_span, config.hidden_size, config.vocab_size)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, backend, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: object) -> torch.Tensor:
        hidden = self.tp.all_reduce(self.embed_tokens(input_ids))
        rope = self.rotary(positions)  # looked up once per step, used by every layer
        for layer in self.layers:
            hidden = layer(rope, hidden, metadata)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    # checkpoint tensor name part -> (our parameter name part, shard id) for merged projections
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, backend: AttentionBackend, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config, self.tp = config, tp
        self.model = LlamaModel(config, backend, tp)
        tied = self.model.embed_tokens if config.tie_word_embeddings else None
        self.lm_head = LMHead(self.model.embed_tokens.vocab_span, config.hidden_size, config.vocab_size, tied)
        self._vocab_sizes = [balanced_span(config.vocab_size, tp.size, r).size for r in range(tp.size)]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: object) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> final hidden states [num_tokens, hidden_size].

        `metadata`: the step's attention metadata as the attention backend built it (build_metadata)."""
        return self.model(input_ids, positions, metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[num_rows, hidden_size] -> fp32 logits [num_rows, vocab_size] on rank 0 (None on the others)."""
        return self.tp.gather_columns(self.lm_head(hidden), self._vocab_sizes)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]


# Mistral and Qwen2 differ from Llama only in config values (biases, sliding window) read by ModelConfig.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
}
