"""The `triton` attention backend: hpi_kernels' paged kernels on CUDA (the `torch` backend stays the CPU path).

Per layer: one KV-cache write, then the step's decodes (the runner puts requests with one new token
first) through the split-KV decode kernel and the remaining prefill/extend chunks through the varlen
prefill kernel, both writing straight into one output buffer. Everything that does not change between
layers (group boundaries, rebased query offsets) is computed once per step in `build_metadata`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpi_runtime.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class TritonAttentionMetadata(AttentionMetadata):
    num_decode_tokens: int = 0  # = num_decode_reqs: decode requests own rows [0, num_decode_tokens)
    decode_block_tables: torch.Tensor | None = None  # [num_decode_reqs, max_blocks] int32
    decode_context_lens: torch.Tensor | None = None  # [num_decode_reqs] int32
    prefill_block_tables: torch.Tensor | None = None  # [num_prefill_reqs, max_blocks] int32
    prefill_context_lens: torch.Tensor | None = None  # [num_prefill_reqs] int32
    prefill_query_start_loc: torch.Tensor | None = None  # [num_prefill_reqs + 1] int32, from 0


class TritonAttentionBackend:
    """CUDA backend on hpi_kernels (also runs on CPU tensors under TRITON_INTERPRET=1, for tests)."""

    name = "triton"
    # For a step of decodes only, build_metadata just slices the common tensors, and the kernels size their grids
    # from shapes, never values: metadata built once over static buffers stays valid across CUDA-graph replays.
    supports_cuda_graphs = True

    def build_metadata(self, common: AttentionMetadata) -> TritonAttentionMetadata:
        num_decodes = common.num_decode_reqs
        fields = {f: getattr(common, f) for f in AttentionMetadata.__dataclass_fields__}
        prefill: dict[str, torch.Tensor | None] = {}
        if common.num_reqs > num_decodes:
            query_start_loc = common.query_start_loc[num_decodes:]
            prefill = {
                "prefill_block_tables": common.block_tables[num_decodes:],
                "prefill_context_lens": common.context_lens[num_decodes:],
                "prefill_query_start_loc": query_start_loc - query_start_loc[0],
            }
        return TritonAttentionMetadata(
            **fields,
            num_decode_tokens=num_decodes,
            decode_block_tables=common.block_tables[:num_decodes] if num_decodes else None,
            decode_context_lens=common.context_lens[:num_decodes] if num_decodes else None,
            **prefill,
        )

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        from hpi_kernels import paged_decode_attention, paged_prefill_attention, write_kv_cache

        assert isinstance(metadata, TritonAttentionMetadata), "metadata not built by TritonAttentionBackend"
        write_kv_cache(k, v, k_cache, v_cache, metadata.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        num_decode_tokens = metadata.num_decode_tokens
        if metadata.decode_block_tables is not None:
            paged_decode_attention(
                q[:num_decode_tokens],
                k_cache,
                v_cache,
                metadata.decode_block_tables,
                metadata.decode_context_lens,
                scale,
                out=out[:num_decode_tokens],
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
        if metadata.prefill_block_tables is not None:
            paged_prefill_attention(
                q[num_decode_tokens:],
                k_cache,
                v_cache,
                metadata.prefill_block_tables,
                metadata.prefill_query_start_loc,
                metadata.prefill_context_lens,
                scale,
                max_query_len=metadata.max_query_len,
                out=out[num_decode_tokens:],
                sliding_window=sliding_window,
                logit_softcap=logit_softcap,
            )
        return out
