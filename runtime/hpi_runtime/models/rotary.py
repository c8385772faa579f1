"""Rotary position embeddings (rotate-half layout, as Hugging Face checkpoints store q/k): default, linear, llama3
(Llama 3.1) and longrope (Phi-3) scaling, partial rotation (the first `rotary_dim` dims of each head), and
M-RoPE (Qwen2-VL: three position axes, each owning a section of the frequencies)."""

from __future__ import annotations

import math

import torch
from torch import nn

from hpi_runtime.models.config import RopeConfig


def rotary_dim(rope: RopeConfig, head_dim: int) -> int:
    return int(head_dim * rope.partial_rotary_factor)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2], float32, after the configured scaling (as transformers computes them)."""
    dim = rotary_dim(rope, head_dim)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope.rope_type == "longrope":
        factors = rope.long_factor if rope.use_long_factor else rope.short_factor
        if len(factors) != dim // 2:
            raise ValueError(f"longrope factors have {len(factors)} entries; rotary dim {dim} needs {dim // 2}")
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between.
    low_freq_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
    high_freq_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables; `forward` looks up a step's positions once, `apply_rotary` uses them in every layer."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope = rope
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), rope_inv_freq(rope, head_dim))
        scale = rope.attention_factor if rope.rope_type == "longrope" else 1.0
        # [max_positions, rotary_dim // 2] fp32; not parameters, never loaded from a checkpoint
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)
        axis = None
        if rope.mrope_section:
            if sum(rope.mrope_section) != freqs.shape[1]:
                raise ValueError(f"mrope_section {rope.mrope_section} must sum to rotary_dim // 2 = {freqs.shape[1]}")
            axis = torch.repeat_interleave(torch.arange(len(rope.mrope_section)), torch.tensor(rope.mrope_section))
            axis = axis % 3
        # [rotary_dim // 2] int64: which position axis (temporal, height, width) each frequency reads; None: no M-RoPE
        self.register_buffer("mrope_axis", axis, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (or [3, T] with M-RoPE) -> cos, sin [T, 1, rotary_dim // 2] (fp32)."""
        if positions.dim() == 2:
            return self._mrope(self.cos, positions), self._mrope(self.sin, positions)
        return self.cos.index_select(0, positions).unsqueeze(1), self.sin.index_select(0, positions).unsqueeze(1)

    def _mrope(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """table [max_positions, F], positions [3, T] -> [T, 1, F]: frequency f at position positions[axis(f)]."""
        if self.mrope_axis is None:
            raise ValueError("positions per axis need a model with M-RoPE (mrope_section)")
        looked_up = table[positions]  # [3, T, F]
        index = self.mrope_axis.view(1, 1, -1).expand(1, positions.shape[1], -1)
        return looked_up.gather(0, index).squeeze(0).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated in fp32 (as transformers does for fp32; more precise for 16-bit). With partial rotation
    (cos narrower than D / 2) the dims past the rotary ones pass through."""
    rotary = 2 * cos.shape[-1]
    if rotary != x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
