"""Fixtures for engine-core tests: a deterministic fake executor and a pool-invariant checker."""

from __future__ import annotations

import zlib
from collections import Counter
from dataclasses import dataclass, field

import pytest

from hpi_runtime.core.interface import ModelRunnerOutput, SchedulerOutput


def fake_token(request_id: str, position: int, vocab_size: int = 1000) -> int:
    """The fake model's output: a function of (request id, position) only, so every output is predictable
    and a recomputed request (after preemption) must reproduce exactly the same tokens."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % vocab_size


@dataclass
class _ExecutorRequestState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class FakeExecutor:
    """Stands in for the model runner. It follows the delta protocol of interface.py exactly as a real
    executor would (its own copy of token ids and block tables), and keeps a fake KV cache holding the token
    id written at each slot. Before "sampling" it reads back every position through its block table, as
    attention would, and asserts the cache holds the right token there: paging, sharing of prefix-cache
    blocks and recompute after preemption are all checked against what the model would really see. With
    `num_host_kv_blocks` it also keeps a fake host tier and runs the step's block copies first, so a block
    offloaded, swapped or loaded wrongly shows up as a position holding the wrong token. Draft tokens
    (speculative decoding) are written to the cache like any scheduled token and accepted while they equal the
    fake model's own tokens, so a rejected draft's KV that a later step or another request read would show too."""

    num_kv_blocks: int
    block_size: int
    num_host_kv_blocks: int = 0
    sliding_window: int | None = None  # read back only each new token's window, as a windowed kernel does
    vocab_size: int = 1000
    verify: bool = True
    token_fn: object = None  # (request_id, position) -> token id; default fake_token
    fail_on: set = field(default_factory=set)  # request ids whose presence in a batch raises
    states: dict = field(default_factory=dict)
    batches: list = field(default_factory=list)
    shut_down: bool = False

    def __post_init__(self) -> None:
        self.kv_slots = [-1] * (self.num_kv_blocks * self.block_size)
        self.host_slots = [-1] * (self.num_host_kv_blocks * self.block_size)
        self.num_copied_blocks = 0

    def stage_busy_s(self) -> tuple[float, ...]:
        return ()

    def register_failure_callback(self, callback) -> None:
        pass  # runs in this process: nothing can fail under it between steps

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.batches.append(so)
        size = self.block_size
        for device_id, host_id in so.kv_transfers.to_host:
            self.host_slots[host_id * size : (host_id + 1) * size] = self.kv_slots[device_id * size :][:size]
        for host_id, device_id in so.kv_transfers.to_device:
            self.kv_slots[device_id * size : (device_id + 1) * size] = self.host_slots[host_id * size :][:size]
        self.num_copied_blocks += len(so.kv_transfers.to_host) + len(so.kv_transfers.to_device)
        for request_id in so.finished_request_ids | so.preempted_request_ids:
            self.states.pop(request_id, None)
        for new in so.new_requests:
            assert new.request_id not in self.states, f"{new.request_id} sent as new twice"
            self.states[new.request_id] = _ExecutorRequestState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens
            )
        for cached in so.cached_requests:
            state = self.states[cached.request_id]
            assert state.num_computed_tokens == cached.num_computed_tokens
            state.block_ids.extend(cached.new_block_ids)
        assert set(so.num_scheduled_tokens) == {r.request_id for r in so.new_requests + so.cached_requests}
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        if self.fail_on & set(so.num_scheduled_tokens):
            raise RuntimeError("injected executor failure")
        sampled = {}
        token_fn = self.token_fn or (lambda rid, pos: fake_token(rid, pos, self.vocab_size))
        for request_id, num_tokens in so.num_scheduled_tokens.items():
            state = self.states[request_id]
            drafts = so.spec_token_ids.get(request_id, ())
            state.token_ids.extend(drafts)
            start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
            assert 0 < num_tokens and end <= len(state.token_ids)
            assert len(state.block_ids) * self.block_size >= end
            for pos in range(start, end):
                self.kv_slots[self._slot(state, pos)] = state.token_ids[pos]
            if self.verify:
                first = 0 if self.sliding_window is None else max(0, start - self.sliding_window + 1)
                seen = [self.kv_slots[self._slot(state, pos)] for pos in range(first, end)]
                assert seen == state.token_ids[first:end], f"{request_id}: KV cache does not hold its tokens"
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                known = end - len(drafts)
                del state.token_ids[known:]
                tokens = [token_fn(request_id, known + j) for j in range(len(drafts) + 1)]
                kept = next((j for j, d in enumerate(drafts) if d != tokens[j]), len(drafts)) + 1
                state.token_ids.extend(tokens[:kept])
                state.num_computed_tokens = len(state.token_ids) - 1
                sampled[request_id] = tuple(tokens[:kept])
        # LoRA prefetches: no adapter is read here, so each is ready by the end of the step that asked for it.
        ready = tuple(lora.lora_int_id for lora in so.lora_updates.prefetches)
        return ModelRunnerOutput(sampled_token_ids=sampled, lora_ready=ready)

    def _slot(self, state: _ExecutorRequestState, pos: int) -> int:
        return state.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def shutdown(self) -> None:
        self.shut_down = True


def check_pool_invariants(kv_cache_manager) -> None:
    """Every block is owned (ref == number of owners) or free (in the LRU queue), never both; only
    cached full blocks are shared; the hash map points only at blocks carrying that hash."""
    pool = kv_cache_manager.pool
    null = kv_cache_manager.null_block  # the sliding window's placeholder: the manager's own, shared by all
    tables = [[block for block in blocks if block is not null] for blocks in kv_cache_manager.req_to_blocks.values()]
    owners = Counter(block.block_id for blocks in tables for block in blocks)
    if null is not None:
        owners[null.block_id] = 1
        assert null.block_hash is None, "the placeholder was registered as a cached block"
    for blocks in tables:
        assert len({block.block_id for block in blocks}) == len(blocks), "a request holds a block twice"
    free_ids = pool.free_queue.block_ids()
    assert len(free_ids) == len(set(free_ids)) == pool.num_free
    free = set(free_ids)
    for block in pool.blocks:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == owners[block.block_id], f"{block} has {owners[block.block_id]} owners"
        assert (block.block_id in free) == (block.ref_cnt == 0)
        if block.ref_cnt > 1:
            assert block.block_hash is not None, f"{block} is shared but not a cached block"
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash
    if kv_cache_manager.host is not None:
        check_host_tier_invariants(kv_cache_manager)


def check_host_tier_invariants(kv_cache_manager) -> None:
    """The host pool obeys the same rules; its owners are swapped-out requests and the copies of the step in
    flight, so a block leaks if neither accounts for its references."""
    host = kv_cache_manager.host
    pool = host.pool
    owners = Counter(
        block.block_id
        for swapped in kv_cache_manager._swapped.values()
        for block in swapped.host_blocks
        if block is not None  # a block behind the sliding window: not kept
    )
    owners.update(block.block_id for block in host._held)
    free_ids = pool.free_queue.block_ids()
    assert len(free_ids) == len(set(free_ids)) == pool.num_free
    free = set(free_ids)
    for block in pool.blocks:
        assert block.ref_cnt == owners[block.block_id], f"host {block} has {owners[block.block_id]} owners"
        assert (block.block_id in free) == (block.ref_cnt == 0)
    for block_hash, block in pool.cached_blocks.items():
        assert block.block_hash == block_hash
    for swapped in kv_cache_manager._swapped.values():
        assert len(swapped.host_blocks) == -(-swapped.num_tokens // kv_cache_manager.block_size)


def drain_engine(engine, pool_invariants=None, after_step=None, max_steps: int = 10_000) -> dict:
    """Step until every request finished: {request id: final output}. `pool_invariants` and `after_step`
    (given the engine) run after every step."""
    finals = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return finals
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        if pool_invariants:
            pool_invariants(engine.kv_cache_manager)
        if after_step:
            after_step(engine)
    raise AssertionError("engine did not drain")


@pytest.fixture(scope="session")
def drain():
    return drain_engine


@pytest.fixture(scope="session")
def fake_executor_cls():
    return FakeExecutor


@pytest.fixture(scope="session")
def pool_invariants():
    return check_pool_invariants


@pytest.fixture(scope="session")
def expected_token():
    return fake_token


@pytest.fixture(scope="session")
def tokenizer():
    from hpi_testing.tiny_model import build_tokenizer

    return build_tokenizer()
