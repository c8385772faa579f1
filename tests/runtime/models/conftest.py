"""Fixtures for model-runner tests: a hand-written scheduler that emits `SchedulerOutput` deltas.

`HandScheduler` is deliberately naive (no budget fairness, no eviction policy) but speaks the real
protocol: new vs cached requests, chunked prefill, block tables that grow, reused (dirty) blocks,
prefix-cache hits via shared blocks, preemption with recompute, finished requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from hpi_runtime.attention.torch_backend import TorchAttentionBackend
from hpi_runtime.core.interface import CachedRequestData, NewRequestData, SchedulerOutput
from hpi_runtime.models.config import load_model_config
from hpi_runtime.models.loader import load_model
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.worker.model_runner import KVCacheSpec, ModelRunner, allocate_kv_caches

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


@dataclass
class HandRequest:
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    known_to_runner: bool = False
    new_block_ids: list[int] = field(default_factory=list)


class HandScheduler:
    def __init__(self, num_blocks: int, block_size: int, chunk_size: int | None = None) -> None:
        self.block_size = block_size
        self.chunk_size = chunk_size  # max tokens per request per step (None: whole remainder)
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # pop() reuses the lowest ids first
        self.ref_counts: dict[int, int] = {}
        self.running: dict[str, HandRequest] = {}
        self.pending_finished: set[str] = set()
        self.pending_preempted: set[str] = set()

    def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams = GREEDY,
        shared_prefix_of: str | None = None,
        num_shared_blocks: int = 0,
    ) -> None:
        request = HandRequest(request_id, list(prompt), len(prompt), params)
        if shared_prefix_of is not None:
            # A prefix-cache hit: reuse the owner's first full blocks and skip computing them.
            owner = self.running[shared_prefix_of]
            num_shared_tokens = num_shared_blocks * self.block_size
            assert owner.token_ids[:num_shared_tokens] == prompt[:num_shared_tokens]
            request.block_ids = owner.block_ids[:num_shared_blocks]
            for b in request.block_ids:
                self.ref_counts[b] += 1
            request.num_computed_tokens = num_shared_blocks * self.block_size
        self.running[request_id] = request

    def _free(self, request: HandRequest) -> None:
        for b in request.block_ids:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_blocks.append(b)
        request.block_ids = []

    def finish(self, request_id: str) -> None:
        self._free(self.running.pop(request_id))
        self.pending_finished.add(request_id)

    def preempt(self, request_id: str) -> None:
        request = self.running[request_id]
        self._free(request)
        request.num_computed_tokens = 0
        request.known_to_runner = False
        self.pending_preempted.add(request_id)

    def schedule(self) -> SchedulerOutput:
        new, cached, scheduled = [], [], {}
        for request in self.running.values():
            n = len(request.token_ids) - request.num_computed_tokens
            if self.chunk_size:
                n = min(n, self.chunk_size)
            needed = -(-(request.num_computed_tokens + n) // self.block_size) - len(request.block_ids)
            added = [self.free_blocks.pop() for _ in range(needed)]
            for b in added:
                self.ref_counts[b] = 1
            request.block_ids.extend(added)
            if request.known_to_runner:
                cached.append(CachedRequestData(request.request_id, tuple(added), request.num_computed_tokens))
            else:
                new.append(
                    NewRequestData(
                        request.request_id,
                        tuple(request.token_ids),
                        request.num_prompt_tokens,
                        request.params,
                        tuple(request.block_ids),
                        request.num_computed_tokens,
                    )
                )
                request.known_to_runner = True
            scheduled[request.request_id] = n
            request.num_computed_tokens += n
        # A request preempted and rescheduled in the same step comes back as new after its state is dropped.
        output = SchedulerOutput(
            tuple(new),
            tuple(cached),
            scheduled,
            sum(scheduled.values()),
            frozenset(self.pending_finished),
            frozenset(self.pending_preempted),
        )
        self.pending_finished.clear()
        self.pending_preempted.clear()
        return output

    def append(self, request_id: str, token_id: int) -> None:
        self.running[request_id].token_ids.append(token_id)


@pytest.fixture
def make_runner():
    """make_runner(model_dir, num_blocks=64, block_size=8) -> ModelRunner (fp32, CPU, torch backend)."""

    def make(model_dir: Path, num_blocks: int = 64, block_size: int = 8, seed: int = 0) -> ModelRunner:
        config = load_model_config(model_dir)
        backend = TorchAttentionBackend()
        model = load_model(config, torch.float32, torch.device("cpu"), backend)
        allocate_kv_caches(model, KVCacheSpec(num_blocks, block_size, torch.float32), torch.device("cpu"))
        return ModelRunner(model, backend, block_size, config.eos_token_ids, seed)

    return make
