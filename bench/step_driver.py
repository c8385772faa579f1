"""A scheduler stand-in for step-level benchmarks (bench/profile_model_step.py, the GPU check's step part): it
drives a `LocalExecutor` with hand-made `SchedulerOutput`s, so a benchmark times the model step itself (input
preparation, forward, LM head, sampler) without a scheduler, a KV manager or a process boundary in the way."""

from __future__ import annotations

import torch

from hpi_runtime.core.interface import CachedRequestData, NewRequestData, SchedulerOutput
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.worker.executor import LocalExecutor

BLOCK_SIZE = 16  # the executors these drive are built with it: block ids are handed out in its units


class DecodeDriver:
    """A scheduler stand-in: `num_reqs` requests of random prompts, prefilled a few per step, then decoded all
    together, one token each per step. Block ids are handed out in order from 0."""

    def __init__(
        self, executor: LocalExecutor, num_reqs: int, prompt_len: int, tag: str = "r",
        prefill_tokens_per_step: int = 0, seed: int = 0,
    ) -> None:  # fmt: skip
        """`prefill_tokens_per_step`: prompts are prefilled together up to about this many tokens a step (0: one
        prompt a step)."""
        self.executor = executor
        generator = torch.Generator().manual_seed(seed)
        self.tokens = {f"{tag}-{i}": torch.randint(10, 40000, (prompt_len,), generator=generator).tolist()
                       for i in range(num_reqs)}  # fmt: skip
        self.blocks: dict[str, list[int]] = {}
        self.next_block = 0
        self.params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
        self.prefill_tokens_per_step = prefill_tokens_per_step

    def _new_blocks(self, request_id: str, num_tokens: int) -> tuple[int, ...]:
        needed = -(-num_tokens // BLOCK_SIZE) - len(self.blocks.setdefault(request_id, []))
        added = tuple(range(self.next_block, self.next_block + max(0, needed)))
        self.next_block += len(added)
        self.blocks[request_id].extend(added)
        return added

    def _run(self, output: SchedulerOutput) -> None:
        result = self.executor.execute_model(output)
        for request_id, token_ids in result.sampled_token_ids.items():
            self.tokens[request_id].extend(token_ids)

    def prefill(self) -> None:
        pending = list(self.tokens)
        while pending:
            group, num_tokens = [], 0
            while pending and (not group or num_tokens + len(self.tokens[pending[0]]) <= self.prefill_tokens_per_step):
                group.append(pending.pop(0))
                num_tokens += len(self.tokens[group[-1]])
            new = tuple(
                NewRequestData(r, tuple(self.tokens[r]), len(self.tokens[r]), self.params,
                               self._new_blocks(r, len(self.tokens[r])), 0)
                for r in group
            )  # fmt: skip
            self._run(SchedulerOutput(new, (), {r: len(self.tokens[r]) for r in group}, num_tokens))

    def decode(self) -> None:
        cached = tuple(
            CachedRequestData(r, self._new_blocks(r, len(t)), len(t) - 1) for r, t in self.tokens.items()
        )
        self._run(SchedulerOutput((), cached, dict.fromkeys(self.tokens, 1), len(self.tokens)))

    def finish(self) -> None:
        self._run(SchedulerOutput((), (), {}, 0, finished_request_ids=frozenset(self.tokens)))
