"""Small building blocks of the decoder families: RMSNorm (Llama's and Gemma's), gated MLP activations,
embeddings, the LM head and soft-capping."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hpi_kernels.cpu.packed_linear import packed_weight_rows
from hpi_runtime.models.linear import default_weight_loader
from hpi_runtime.models.parallel import Span


class RMSNorm(nn.Module):
    """RMSNorm over the last dim. `unit_offset` (Gemma): the checkpoint stores weight - 1, and the scaling
    happens in fp32 before the cast back; otherwise (Llama) the weight scales after the cast."""

    def __init__(self, hidden_size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Exactly as transformers' LlamaRMSNorm / GemmaRMSNorm do.
        dtype = x.dtype
        normed = x.float()
        normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (normed * (1.0 + self.weight.float())).to(dtype)
        return self.weight * normed.to(dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate) * up


# transformers' activation name -> the gated activation over [.., 2 * n] (gate first, then up)
GATED_ACTIVATIONS = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul, "gelu": gelu_and_mul}


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): Gemma 2's soft-capping of attention scores and final logits."""
    return torch.tanh(x / cap) * cap


def load_vocab_rows(param: nn.Parameter, loaded: torch.Tensor, span: Span, vocab_size: int) -> None:
    """Copy rows `span` of a [vocab_size, hidden] checkpoint tensor (embedding or LM head) into `param`."""
    if loaded.shape[0] != vocab_size:
        raise ValueError(f"checkpoint has {loaded.shape[0]} vocabulary rows, the config says vocab_size {vocab_size}")
    default_weight_loader(param, loaded.narrow(0, span.start, span.size))


class VocabEmbedding(nn.Module):
    """Token embedding over this rank's vocabulary rows `vocab_span`. Tokens outside it look up zeros, so the
    sum over ranks (done by the model) is the full embedding."""

    def __init__(self, vocab_span: Span, hidden_size: int, vocab_size: int, scale: float | None = None) -> None:
        super().__init__()
        self.vocab_span, self.vocab_size, self.hidden_size = vocab_span, vocab_size, hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_span.size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # Gemma: sqrt(hidden_size) rounded to the weights' dtype, as transformers applies it (a host float, so
        # that a compiled step holds no tensor constant)
        self.scale = None if scale is None else float(torch.tensor(scale, dtype=self.weight.dtype, device="cpu"))
        self.packed = False  # cpu_layout.pack_cpu_weights: the matrix is a tied LM head's packed panels
        self.rows_dtype: torch.dtype | None = None  # ... and the model's dtype, which bf16 panels' rows widen to
        # quantize_model: the tied LM head, quantized (an int8 QuantizedLMHead), whose rows the tokens look up
        self.rows_from: nn.Module | None = None

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.rows_from is not None:
            return self.rows_from.weight_rows(ids)
        if self.packed:
            return packed_weight_rows(self.weight, ids, self.hidden_size).to(self.rows_dtype)
        return F.embedding(ids, self.weight)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        load_vocab_rows(param, loaded, self.vocab_span, self.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.vocab_span.size == self.vocab_size:
            hidden = self._rows(input_ids)
        else:
            local = input_ids - self.vocab_span.start
            outside = (local < 0) | (local >= self.vocab_span.size)
            hidden = self._rows(local.masked_fill(outside, 0)).masked_fill(outside.unsqueeze(-1), 0)
        if self.scale is not None:
            hidden = hidden * self.scale
        return hidden


class LMHead(nn.Module):
    """Hidden states -> fp32 logits of this rank's vocabulary rows. Shares the embedding matrix (and so its
    vocabulary span) when the model ties them."""

    def __init__(self, vocab_span: Span, hidden_size: int, vocab_size: int, tied_to: VocabEmbedding | None) -> None:
        super().__init__()
        self.vocab_span, self.vocab_size = vocab_span, vocab_size
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_span.size, hidden_size), requires_grad=False)
            self.weight.weight_loader = self.weight_loader
        self.packed = False  # cpu_layout.pack_cpu_weights: `weight` is hpi_kernels' packed column panels

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        load_vocab_rows(param, loaded, self.vocab_span, self.vocab_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed:  # the C++ op, called directly (opaque to torch.compile); its fp32 sums come out unrounded
            return torch.ops.hpi_kernels.packed_logits(hidden, self.weight, self.vocab_span.size)
        return F.linear(hidden, self.weight).float()
