"""The persistent batch: its vectorised step inputs equal a plain per-request construction through any
sequence of new, cached, finished and preempted requests, rows are reused and the arrays grow."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpi_runtime.core.interface import CachedRequestData, NewRequestData, SchedulerOutput
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.worker.input_batch import InputBatch

BLOCK_SIZE = 4
GREEDY = SamplingParams(temperature=0.0)


@dataclass
class Request:
    """The test's own copy of a request, as a scheduler would hold it."""

    token_ids: list[int]
    block_ids: list[int] = field(default_factory=list)
    num_computed: int = 0


def _expected(requests: dict[str, Request], scheduled: dict[str, int]) -> dict[str, list]:
    """Flat step inputs built request by request (decodes first), the obvious way."""
    order = sorted(scheduled, key=lambda r: scheduled[r] != 1)
    input_ids, positions, slots, loc, context_lens = [], [], [], [0], []
    for request_id in order:
        request, n = requests[request_id], scheduled[request_id]
        for pos in range(request.num_computed, request.num_computed + n):
            input_ids.append(request.token_ids[pos])
            positions.append(pos)
            slots.append(request.block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        loc.append(loc[-1] + n)
        context_lens.append(request.num_computed + n)
    return {"request_ids": order, "input_ids": input_ids, "positions": positions, "slot_mapping": slots,
            "query_start_loc": loc, "context_lens": context_lens}  # fmt: skip


def _check_step(batch: InputBatch, requests: dict[str, Request], scheduled: dict[str, int]) -> None:
    expected = _expected(requests, scheduled)
    step = batch.prepare(scheduled)
    assert list(step.request_ids) == expected["request_ids"]
    for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "context_lens"):
        assert getattr(step, name).tolist() == expected[name], name
    for row, request_id in enumerate(step.request_ids):  # the table's leading columns are the request's blocks
        num_blocks = -(-step.context_lens[row].item() // BLOCK_SIZE)
        assert step.block_tables[row, :num_blocks].tolist() == requests[request_id].block_ids[:num_blocks]
    assert step.num_decode_reqs == sum(1 for n in scheduled.values() if n == 1)
    assert step.is_sampled == tuple(
        requests[r].num_computed + scheduled[r] == len(requests[r].token_ids) for r in step.request_ids
    )


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_steps_match_a_per_request_construction(data) -> None:
    """Random request lifetimes: chunked prefills, decodes with sampled tokens, new blocks, finishes,
    preemptions (the request returns as new), over few initial rows so that the arrays grow."""
    batch = InputBatch(BLOCK_SIZE, frozenset(), max_reqs=2, max_len=8)
    requests: dict[str, Request] = {}
    next_block, next_id = 0, 0
    for _ in range(data.draw(st.integers(1, 12))):
        new, cached, finished, preempted = [], [], set(), set()
        for request_id in list(requests):
            if data.draw(st.integers(0, 9)) == 0:
                (finished if data.draw(st.booleans()) else preempted).add(request_id)
                del requests[request_id]
        for _ in range(data.draw(st.integers(0, 3))):
            prompt = data.draw(st.lists(st.integers(0, 999), min_size=1, max_size=30))
            requests[f"q{next_id}"] = Request(prompt)
            next_id += 1
        scheduled = {}
        for request_id, request in requests.items():
            remaining = len(request.token_ids) - request.num_computed
            n = data.draw(st.integers(1, remaining))
            needed = -(-(request.num_computed + n) // BLOCK_SIZE) - len(request.block_ids)
            added = list(range(next_block, next_block + needed))
            next_block += needed
            request.block_ids += added
            if request.num_computed == 0 and len(request.block_ids) == len(added):
                new.append(NewRequestData(request_id, tuple(request.token_ids), len(request.token_ids), GREEDY,
                                          tuple(request.block_ids), 0))  # fmt: skip
            else:
                cached.append(CachedRequestData(request_id, tuple(added), request.num_computed))
            scheduled[request_id] = n
        batch.update(SchedulerOutput(tuple(new), tuple(cached), scheduled, sum(scheduled.values()),
                                     frozenset(finished), frozenset(preempted)))  # fmt: skip
        if scheduled:
            _check_step(batch, requests, scheduled)
        assert set(batch.row_of) == set(requests)
        sampled = []
        for request_id, n in scheduled.items():
            request = requests[request_id]
            request.num_computed += n
            if request.num_computed == len(request.token_ids):
                sampled.append(request_id)
        tokens = data.draw(st.lists(st.integers(0, 999), min_size=len(sampled), max_size=len(sampled)))
        if sampled:
            batch.append_sampled(batch.rows_of(tuple(sampled)), tokens)
        for request_id, token in zip(sampled, tokens, strict=True):
            requests[request_id].token_ids.append(token)
        for request_id, request in requests.items():
            assert batch.request_token_ids(request_id) == request.token_ids


def _new(request_id: str, token_ids, block_ids, params: SamplingParams = GREEDY, num_prompt: int | None = None):
    num_prompt = len(token_ids) if num_prompt is None else num_prompt
    return NewRequestData(request_id, tuple(token_ids), num_prompt, params, tuple(block_ids), 0)


def test_rows_are_reused_and_capacity_grows() -> None:
    batch = InputBatch(BLOCK_SIZE, frozenset(), max_reqs=2, max_len=4)
    for i in range(5):
        batch.add(_new(f"r{i}", range(10 * i, 10 * i + 9), [i, i + 5, i + 10]))
    assert sorted(batch.row_of.values()) == list(range(5)) and batch.token_ids.shape[0] >= 5
    batch.remove("r1")
    batch.add(_new("again", [1, 2], [7]))
    assert batch.row_of["again"] == 1  # the freed row, not a new one
    assert batch.request_token_ids("r4") == list(range(40, 49))


def test_inconsistent_deltas_name_the_request() -> None:
    batch = InputBatch(BLOCK_SIZE, frozenset())
    batch.add(_new("a", [1, 2, 3, 4, 5], [0]))
    with pytest.raises(ValueError, match="request a needs 2 blocks, has 1"):
        batch.prepare({"a": 5})
    batch.add(_new("b", [1, 2], [3]))
    with pytest.raises(ValueError, match="request b: 3 tokens scheduled from 0, but only 2 are known"):
        batch.prepare({"b": 3})


def test_sampling_batch_columns_follow_the_rows() -> None:
    eos = frozenset({2})
    batch = InputBatch(BLOCK_SIZE, eos)
    hot = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=3, min_tokens=2, stop_token_ids=(9,),
                         repetition_penalty=1.2, logprobs=2)  # fmt: skip
    batch.add(_new("greedy", [5, 6], [0]))
    batch.add(_new("hot", [7, 8, 9], [1], hot, num_prompt=2))  # one output token so far
    sampling = batch.sampling_batch(batch.rows_of(("hot", "greedy")), torch.device("cpu"))
    torch.testing.assert_close(sampling.temperature, torch.tensor([0.7, 0.0]))
    assert sampling.top_k.tolist() == [5, 0] and sampling.num_logprobs == (2, None)
    assert sampling.seeds[1] is None and sampling.seeds[0] is not None
    assert sorted(sampling.banned_token_ids[0]) == [2, 9] and sampling.banned_token_ids[1] == ()
    assert sampling.prompt_token_ids == ((7, 8), (5, 6)) and sampling.output_token_ids == ((9,), ())
    torch.testing.assert_close(sampling.repetition_penalty, torch.tensor([1.2, 1.0]))
