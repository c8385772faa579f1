"""The `torch` attention backend as one opaque op per layer, so torch.compile graphs span whole layers:
Dynamo sees one call (its fake impl gives the output's shape) and never looks in.

Each op takes tensors and the layer's constants (scale, sliding window, soft-cap: 0 = none for the last
two) only: everything that changes from step to step is a tensor, so Dynamo has no host int to specialise
on and recompile for. The per-request tensors are marked unbacked-dynamic (`mark_step_dynamic`), since
nothing in the graph reads their sizes.

Per call: write the new tokens' K/V into their cache slots, then attend. Where hpi_kernels' C++ CPU kernel
is built and supports the layer, that is its `cached_paged_attention_cpu`, one C++ op (no Python runs per
layer: a Python op implementation cost ~65 us a call, 2 ms of a one-request step): the kernel reads the
paged cache in place, for decodes and prefill chunks alike, and beat gather + SDPA 1.4-10x on every shape
measured, long prefill chunks included (bench/results/model_runner.md). Otherwise `hpi::paged_attention`,
TorchAttentionBackend (gather + padded SDPA, the reference) behind a Python op, whose per-step grouping
is then rebuilt per layer (+0.25 ms a layer at 32 decodes: the price of passing only tensors; the
fallback serves head dims the kernel lacks and machines where it does not build).

The step's token rows may run past the real tokens (padded rows, as a captured graph would have):
`slot_mapping` covers the real tokens only and pad rows of the output are zeros.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from hpi_kernels.cpu import cpu_kernels_available
from hpi_runtime.attention.metadata import AttentionMetadata
from hpi_runtime.attention.torch_backend import TorchAttentionBackend

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL_HEAD_DIM_MULTIPLE = 16  # the C++ kernel's vector loop


# torch.library.define + impl rather than torch.library.custom_op: the latter's Python wrapper costs ~45 us
# a call (measured: 70 us against 28 us per decode call at batch 1), 1.3 ms of a 30-layer step.
torch.library.define(
    "hpi::paged_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
    "Tensor block_tables, Tensor query_start_loc, Tensor context_lens, float scale, "
    "int sliding_window=0, float logit_softcap=0.0) -> Tensor",
)


def paged_attention(
    q: torch.Tensor,  # [num_rows, num_heads, head_dim], rows >= the real tokens
    k: torch.Tensor,  # [num_rows, num_kv_heads, head_dim]
    v: torch.Tensor,  # [num_rows, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64, the real tokens only
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    context_lens: torch.Tensor,  # [num_reqs] int32, incl. this step's tokens
    scale: float,
    sliding_window: int = 0,  # 0: global attention
    logit_softcap: float = 0.0,  # 0: no soft-capping
) -> torch.Tensor:  # [num_rows, num_heads, head_dim]
    """The reference path: TorchAttentionBackend (gather + padded SDPA) over the metadata it needs."""
    num_tokens = slot_mapping.shape[0]
    common = _common_metadata(slot_mapping, block_tables, query_start_loc, context_lens, k_cache.shape[1])
    backend = TorchAttentionBackend(q.dtype)
    attended = backend.forward(
        q[:num_tokens],
        k[:num_tokens],
        v[:num_tokens],
        k_cache,
        v_cache,
        backend.build_metadata(common),
        scale,
        sliding_window=sliding_window or None,
        logit_softcap=logit_softcap or None,
    )
    if num_tokens == q.shape[0]:
        return attended
    out = q.new_zeros(q.shape)
    out[:num_tokens] = attended
    return out


torch.library.impl("hpi::paged_attention", "CompositeExplicitAutograd", paged_attention)


@torch.library.register_fake("hpi::paged_attention")
def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, query_start_loc, context_lens, scale, sliding_window=0,
      logit_softcap=0.0):  # fmt: skip
    return q.new_empty(q.shape)


def _common_metadata(
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    block_tables: torch.Tensor,  # [num_reqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    context_lens: torch.Tensor,  # [num_reqs] int32
    block_size: int,
) -> AttentionMetadata:
    """The host ints of AttentionMetadata, recovered from the tensors (the runner puts decodes first)."""
    query_lens = query_start_loc.diff()
    is_prefill = query_lens != 1
    num_decode_reqs = int(is_prefill.int().argmax()) if bool(is_prefill.any()) else query_lens.shape[0]
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        context_lens=context_lens,
        num_decode_reqs=num_decode_reqs,
        max_query_len=int(query_lens.max()),
        max_context_len=int(context_lens.max()),
        block_size=block_size,
    )


@dataclass(frozen=True)
class PagedAttentionInputs:
    """All the compiled step sees of attention: tensors only, built once per step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    context_lens: torch.Tensor  # [num_reqs] int32

    def mark_step_dynamic(self) -> None:
        """Before a compiled call: every size here may change per step without a recompile.

        Unbacked: only the opaque op reads these tensors, so no guard needs their sizes, and unlike a
        backed dynamic size, a step with one request (or one block) does not specialise the graph.
        """
        for f in fields(self):
            tensor = getattr(self, f.name)
            torch._dynamo.decorators.mark_unbacked(tensor, list(range(tensor.dim())))


class PagedAttentionOpBackend:
    """The CPU (and any-device fallback) backend: one attention op in every layer, compilable."""

    name = "torch"
    supports_compile = True  # the model forward with this backend traces into one graph

    def __init__(self, dtype: torch.dtype, prefer_cpu_kernel: bool) -> None:
        self.dtype = dtype
        # Built (or loaded) now, at start-up, not in the first step. Per layer, forward then checks only
        # static facts (head_dim, dtype, device), which Dynamo folds while tracing.
        self._kernel_built = prefer_cpu_kernel and cpu_kernels_available()

    def uses_cpu_kernel(self, q: torch.Tensor) -> bool:
        """Whether a layer with these queries runs the C++ kernel (else the reference op)."""
        return (self._kernel_built and q.device.type == "cpu" and q.dtype in KERNEL_DTYPES
                and q.shape[-1] % KERNEL_HEAD_DIM_MULTIPLE == 0)  # fmt: skip

    def build_metadata(self, common: AttentionMetadata) -> PagedAttentionInputs:
        return PagedAttentionInputs(
            slot_mapping=common.slot_mapping,
            block_tables=common.block_tables,
            query_start_loc=common.query_start_loc,
            context_lens=common.context_lens,
        )

    def forward(
        self,
        q: torch.Tensor,  # [num_rows, num_heads, head_dim]
        k: torch.Tensor,  # [num_rows, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_rows, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: PagedAttentionInputs,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:  # [num_rows, num_heads, head_dim]
        cpu_kernel = self.uses_cpu_kernel(q)
        op = torch.ops.hpi_kernels.cached_paged_attention_cpu if cpu_kernel else torch.ops.hpi.paged_attention
        return op(
            q,
            k,
            v,
            k_cache,
            v_cache,
            metadata.slot_mapping,
            metadata.block_tables,
            metadata.query_start_loc,
            metadata.context_lens,
            scale,
            sliding_window or 0,
            logit_softcap or 0.0,
        )
