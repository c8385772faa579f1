"""GPU check, part `kv_tier`: the host KV tier's copy bandwidth over PCIe, both ways, against a raw pinned copy.

`HostKVCache` (runtime/hpi_runtime/worker/host_kv_cache.py) in the 1B shape (16 layers of 8 KV heads of 64, bf16,
16-token blocks: 512 KiB a block over all layers) moves 64, 512 and 2048 randomly chosen blocks (32 MiB to 1 GiB)
device -> host (gather, side-stream DMA to pinned staging, scatter into the host pool) and host -> device (gather,
pin, DMA, scatter), as a step's `KVTransfers` ask. Reported: GB/s each way, the ms an offload costs the step
before its forward may start (`d2h_issue_ms`: the rest overlaps the forward), and the same bytes as one raw
pinned `copy_` each way, the ceiling the tier's gathers and staging fall short of.

Dry run (CPU): two layers, a few blocks, CPU tensors (no pinned memory, no streams: the tier's CPU path), tagged.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from bench.gpu.part import PartContext, time_ms
from bench.gpu.shared import PAST_DEADLINE, failure_note, failure_record
from bench.gpu.weights import ONE_B_SHAPE
from hpi_runtime.core.interface import KVTransfers
from hpi_runtime.worker.host_kv_cache import HostKVCache


@dataclass(frozen=True)
class TierPlan:
    """What the part measures; the defaults are the GPU plan (the 1B shape), a dry run replaces the sizes."""

    num_layers: int = ONE_B_SHAPE["num_hidden_layers"]
    num_kv_heads: int = ONE_B_SHAPE["num_key_value_heads"]
    head_dim: int = ONE_B_SHAPE["head_dim"]
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    num_device_blocks: int = 4096
    transfer_blocks: tuple[int, ...] = (64, 512, 2048)  # blocks per measured transfer; the host pool holds the largest
    repeats: int = 3

    @property
    def block_bytes(self) -> int:
        """K and V of one block over all layers."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def plan_for(ctx: PartContext) -> TierPlan:
    if not ctx.dry_run:
        return TierPlan()
    return TierPlan(num_layers=2, num_device_blocks=32, transfer_blocks=(4, 16), repeats=2)


class _KVModel:
    """What HostKVCache reads of a model: its attention layers' device K/V caches. A stand-in, so the part needs no
    weights."""

    def __init__(self, plan: TierPlan, device: torch.device) -> None:
        shape = (plan.num_device_blocks, plan.block_size, plan.num_kv_heads, plan.head_dim)
        self.layers = [
            SimpleNamespace(k_cache=torch.randn(shape, device=device, dtype=plan.dtype),
                            v_cache=torch.randn(shape, device=device, dtype=plan.dtype))
            for _ in range(plan.num_layers)
        ]  # fmt: skip

    def attention_layers(self) -> list[SimpleNamespace]:
        return self.layers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tier_copies(cache: HostKVCache, plan: TierPlan, num_blocks: int, device: torch.device) -> dict:
    """Median over repeats of one offload of `num_blocks` random device blocks and one load of them back."""
    generator = torch.Generator().manual_seed(num_blocks)
    device_ids = torch.randperm(plan.num_device_blocks, generator=generator)[:num_blocks].tolist()
    to_host = KVTransfers(to_host=tuple(zip(device_ids, range(num_blocks), strict=True)))
    to_device = KVTransfers(to_device=tuple(zip(range(num_blocks), device_ids, strict=True)))
    issue_s, d2h_s, h2d_s = [], [], []
    for _ in range(plan.repeats):
        _sync(device)
        start = time.perf_counter()
        cache.apply(to_host)
        issued = time.perf_counter()
        cache.finish_offloads()  # waits for the DMA, then scatters into the host pool
        d2h_s.append(time.perf_counter() - start)
        issue_s.append(issued - start)
        start = time.perf_counter()
        cache.apply(to_device)
        _sync(device)
        h2d_s.append(time.perf_counter() - start)
    num_bytes = num_blocks * plan.block_bytes
    d2h, h2d = statistics.median(d2h_s), statistics.median(h2d_s)
    return {
        "blocks": num_blocks,
        "mib": num_bytes / 2**20,
        "d2h_issue_ms": 1000 * statistics.median(issue_s),
        "d2h_ms": 1000 * d2h,
        "d2h_gb_s": num_bytes / d2h / 1e9,
        "h2d_ms": 1000 * h2d,
        "h2d_gb_s": num_bytes / h2d / 1e9,
    }


def raw_copies(num_bytes: int, device: torch.device, iters: int) -> dict:
    """One contiguous copy of `num_bytes` each way, pinned host memory on CUDA (plain CPU memory in a dry run)."""
    on_device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    d2h_ms = time_ms(lambda: host.copy_(on_device, non_blocking=True), device, iters, warmup=1)
    h2d_ms = time_ms(lambda: on_device.copy_(host, non_blocking=True), device, iters, warmup=1)
    return {"raw_d2h_gb_s": num_bytes / d2h_ms / 1e6, "raw_h2d_gb_s": num_bytes / h2d_ms / 1e6}


def run(ctx: PartContext) -> dict:
    deadline = ctx.deadline()
    plan = plan_for(ctx)
    device = ctx.device
    skipped: dict[str, str] = {}
    if device.type != "cuda":
        skipped["pinned DMA"] = "pinned memory and copy streams need CUDA: the dry run copies between CPU tensors"
    model = _KVModel(plan, device)
    cache = HostKVCache(model, max(plan.transfer_blocks), device)
    transfers, errors = {}, []
    for num_blocks in plan.transfer_blocks:
        if time.perf_counter() > deadline:
            skipped[f"{num_blocks} blocks"] = PAST_DEADLINE
            continue
        try:
            measured = tier_copies(cache, plan, num_blocks, device)
            measured.update(raw_copies(num_blocks * plan.block_bytes, device, plan.repeats))
        except Exception as exc:  # one size failing (pinned memory running out) keeps the smaller sizes' numbers
            errors.append(exc)
            measured, skipped[f"{num_blocks} blocks"] = failure_record(exc), failure_note(exc)
        transfers[str(num_blocks)] = measured
    if errors and len(errors) == len(transfers):  # nothing measured: the part failed, with the first error's traceback
        raise errors[0]
    return {
        "headline": headline(transfers, plan.block_bytes),
        "shape": {"num_layers": plan.num_layers, "num_kv_heads": plan.num_kv_heads, "head_dim": plan.head_dim,
                  "block_size": plan.block_size, "dtype": str(plan.dtype).removeprefix("torch.")},  # fmt: skip
        "block_bytes": plan.block_bytes,
        "pinned": device.type == "cuda",
        "dry_run": ctx.dry_run,
        "transfers": transfers,
        "skipped": skipped,
    }


def headline(transfers: dict, block_bytes: int) -> list[str]:
    """Each transfer size: the tier's GB/s each way against a raw pinned copy of the same bytes."""
    return [f"{n} blocks ({int(n) * block_bytes / 2**20:.0f} MiB): d2h {r['d2h_gb_s']:.1f} GB/s (raw "
            f"{r['raw_d2h_gb_s']:.1f}), h2d {r['h2d_gb_s']:.1f} GB/s (raw {r['raw_h2d_gb_s']:.1f})"
            for n, r in transfers.items() if "d2h_gb_s" in r]  # fmt: skip
