"""Multi-LoRA deltas for a batch whose tokens use different adapters (the punica / S-LoRA segmented matmul):
out[t] += B[s_t] @ (A[s_t] @ x[t]) for each token t of adapter slot s_t; tokens of the base model get nothing.

The adapters' weights live in fixed device slots, A [num_slots, W, K] and B [num_slots, N, W] (W: the slots'
rank width, zero-padded; the scaling folded into B). The step's tokens are grouped by slot on the host, once per
step (the runner knows each token's adapter before the forward), into `LoRAGroups`: the token rows in slot order,
and tiles of at most BLOCK_M rows of one slot each. Two kernels then run per projection, each program one tile:
- shrink: h[i] = A[slot] @ x[row_i] for the tile's rows, as one [BLOCK_M, K] x [K, W] dot: the rows of a tile
  share their adapter, so a prefill's tokens (or many decodes of one adapter) read that adapter's A once;
- expand: out[row_i] += B[slot] @ h[i], tiled over N. Each (row, column) belongs to exactly one program: the
  read-add-write of `out` needs no atomics.
h is [num_lora_tokens, W] in fp32. tests/kernels/test_lora.py checks both against reference.lora_delta_ref in
Triton's interpreter; CUDA runs them in the runtime (runtime/hpi_runtime/lora/layers.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hpi_kernels._validate import FLOAT_DTYPES, check_device, check_dim, check_dtype, check_rank, interpreting

BLOCK_M = 16  # token rows per tile (tl.dot needs 16)


@dataclass(frozen=True)
class LoRAGroups:
    """The step's adapter tokens grouped for the kernels (built by `group_tokens`, on the host, once a step)."""

    rows: torch.Tensor  # [num_lora_tokens] int32: token rows, those of one slot together
    tile_slot: torch.Tensor  # [num_tiles] int32: each tile's slot
    tile_start: torch.Tensor  # [num_tiles] int32: its first position in `rows`
    tile_len: torch.Tensor  # [num_tiles] int32: its row count (<= BLOCK_M)

    @property
    def num_tiles(self) -> int:
        return int(self.tile_slot.shape[0])


def group_tokens(token_slots: torch.Tensor, device: torch.device, base_slot: int = -1) -> LoRAGroups:
    """[num_tokens] slots (base_slot: the base model) on the CPU -> LoRAGroups on `device`."""
    check_rank("token_slots", token_slots, 1, "[num_tokens]")
    slots = token_slots.to("cpu", torch.int64)
    rows = torch.nonzero(slots != base_slot).flatten()
    rows = rows[torch.argsort(slots[rows], stable=True)]
    tile_slot, tile_start, tile_len = [], [], []
    position = 0
    for slot, count in zip(*torch.unique_consecutive(slots[rows], return_counts=True), strict=True):
        for offset in range(0, int(count), BLOCK_M):
            tile_slot.append(int(slot))
            tile_start.append(position + offset)
            tile_len.append(min(BLOCK_M, int(count) - offset))
        position += int(count)

    def on(values: list[int] | torch.Tensor) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.int32).to(device)

    return LoRAGroups(on(rows), on(tile_slot), on(tile_start), on(tile_len))


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, h_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
    K, W,
    stride_x_t, stride_x_k,
    stride_a_s, stride_a_w, stride_a_k,
    stride_h_i, stride_h_w,
    BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    length = tl.load(tile_len_ptr + tile)
    i = tl.arange(0, BLOCK_M)
    m_mask = i < length
    rows = tl.load(rows_ptr + start + i, mask=m_mask, other=0).to(tl.int64)
    w = tl.arange(0, BLOCK_W)
    w_mask = w < W
    acc = tl.zeros([BLOCK_M, BLOCK_W], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_x_t + k[None, :] * stride_x_k,
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        a = tl.load(a_ptr + slot * stride_a_s + w[None, :] * stride_a_w + k[:, None] * stride_a_k,
                    mask=k_mask[:, None] & w_mask[None, :], other=0.0)  # [BLOCK_K, BLOCK_W]  # fmt: skip
        if UPCAST:  # the interpreter gets bf16 arithmetic wrong
            x, a = x.to(tl.float32), a.to(tl.float32)
        acc += tl.dot(x, a, input_precision="ieee")
    tl.store(h_ptr + (start + i)[:, None].to(tl.int64) * stride_h_i + w[None, :] * stride_h_w, acc,
             mask=m_mask[:, None] & w_mask[None, :])  # fmt: skip


@triton.jit
def _expand_kernel(
    h_ptr, b_ptr, out_ptr, rows_ptr, tile_slot_ptr, tile_start_ptr, tile_len_ptr,
    N, W,
    stride_h_i, stride_h_w,
    stride_b_s, stride_b_n, stride_b_w,
    stride_out_t, stride_out_n,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    length = tl.load(tile_len_ptr + tile)
    i = tl.arange(0, BLOCK_M)
    m_mask = i < length
    rows = tl.load(rows_ptr + start + i, mask=m_mask, other=0).to(tl.int64)
    w = tl.arange(0, BLOCK_W)
    w_mask = w < W
    n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_mask = n < N
    h = tl.load(h_ptr + (start + i)[:, None].to(tl.int64) * stride_h_i + w[None, :] * stride_h_w,
                mask=m_mask[:, None] & w_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_W] fp32  # fmt: skip
    b = tl.load(b_ptr + slot * stride_b_s + n[None, :] * stride_b_n + w[:, None] * stride_b_w,
                mask=w_mask[:, None] & n_mask[None, :], other=0.0).to(tl.float32)  # [BLOCK_W, BLOCK_N]  # fmt: skip
    delta = tl.dot(h, b, input_precision="ieee")
    out_ptrs = out_ptr + rows[:, None] * stride_out_t + n[None, :] * stride_out_n
    mask = m_mask[:, None] & n_mask[None, :]
    base = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptrs, (base + delta).to(out_ptr.dtype.element_ty), mask=mask)


def lora_add_(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, groups: LoRAGroups) -> None:
    """out[t] += B[s_t] @ (A[s_t] @ x[t]) in place for the tokens in `groups`.

    out: [num_tokens, N]; x: [num_tokens, K]; a: [num_slots, W, K]; b: [num_slots, N, W]; one float dtype."""
    check_device(out=out, x=x, a=a, b=b, rows=groups.rows)
    check_rank("x", x, 2, "[num_tokens, K]")
    check_rank("out", out, 2, "[num_tokens, N]")
    check_rank("a", a, 3, "[num_slots, W, K]")
    check_rank("b", b, 3, "[num_slots, N, W]")
    for name, t in (("x", x), ("out", out), ("a", a), ("b", b)):
        check_dtype(name, t, FLOAT_DTYPES)
    check_dim("out", out, 0, x.shape[0], "x's token count")
    check_dim("a", a, 2, x.shape[1], "x's in features")
    check_dim("b", b, 0, a.shape[0], "a's slot count")
    check_dim("b", b, 1, out.shape[1], "out's features")
    check_dim("b", b, 2, a.shape[1], "a's rank width")
    if groups.num_tiles == 0:
        return
    num_rows, (_, width, k_dim), n_dim = groups.rows.shape[0], a.shape, out.shape[1]
    h = torch.empty(num_rows, width, dtype=torch.float32, device=x.device)
    block_w = max(16, triton.next_power_of_2(width))
    upcast = interpreting() and torch.bfloat16 in (x.dtype, a.dtype)
    _shrink_kernel[(groups.num_tiles,)](
        x, a, h, groups.rows, groups.tile_slot, groups.tile_start, groups.tile_len, k_dim, width,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), h.stride(0), h.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_W=block_w, BLOCK_K=64, UPCAST=upcast,
    )  # fmt: skip
    block_n = 64
    _expand_kernel[(groups.num_tiles, triton.cdiv(n_dim, block_n))](
        h, b, out, groups.rows, groups.tile_slot, groups.tile_start, groups.tile_len, n_dim, width,
        h.stride(0), h.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_W=block_w,
    )  # fmt: skip
