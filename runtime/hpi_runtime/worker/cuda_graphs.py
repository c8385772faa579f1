"""CUDA graphs for the decode step: the model's forward captured once per batch size, replayed each step.

A decode step of a small model on a GPU is mostly kernel-launch overhead (hundreds of launches a step, each a
few microseconds of host time); replaying a captured graph issues them all at once. As vLLM does:
- A ladder of batch sizes is captured (`capture_sizes`: 1, 2, 4, 8, then steps of 8, up to max_num_seqs); a step
  of n requests runs the graph of the next captured size, its extra rows padding (`padded_size`).
- A graph reads and writes fixed addresses, so the step's inputs live in static buffers sized for the largest
  captured batch (`DecodeGraphs`): token ids, positions, KV slots, block tables (one column per block of
  max_model_len, so the decode kernel's grid, chosen from the table's width without a host sync, is fixed),
  context lengths, query offsets and the output hidden states. The attention metadata of each size is built
  once, from views of those buffers; a step only copies its values into them ("updated in place").
- Padding rows write no KV (slot -1, which write_kv_cache skips) and attend nothing (context length 0, which
  the decode kernel answers with zeros without reading the cache); their outputs are never read.
- Only pure decode steps qualify (`graph_batch_size`): one new token per request, no prefill chunk, no draft
  tokens, no LoRA slots, within the captured sizes. Every other step runs the same model eagerly.
- Graphs bake in the addresses of the weights and the KV cache, so sleep mode drops them and waking recaptures.
- Warm-up calls run on a side stream before each capture (Triton compiles its kernels there, and the caching
  allocator settles); all sizes share one memory pool and are captured largest first, so the smaller graphs
  reuse the largest one's intermediate memory (graphs never run concurrently, and no output of one is live
  while another replays: each copies its result into the static output buffer).

How a graph is captured and replayed is injectable (`Capture`): `CudaGraphCapture` on a GPU; CPU tests pass
`run_eagerly`, which "replays" by calling the model on the static buffers again, so the ladder, padding, buffer
reuse and fallback logic run on CPU. Only a GPU test shows that capture itself works.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from hpi_runtime.attention.metadata import AttentionMetadata
from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.worker.input_batch import StepInputs

logger = logging.getLogger(__name__)

# vLLM's largest default capture size: beyond it a graph saves little next to the step's own work, and each
# size costs capture time and graph memory. Larger decode batches run eagerly.
MAX_CAPTURE_SIZE = 512

# (batch size, a function that runs that size's step on the static buffers) -> a function that runs it again
# (a graph's replay).
Capture = Callable[[int, Callable[[], None]], Callable[[], None]]


def capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The batch sizes to capture: 1, 2, 4, 8, then every multiple of 8, up to max_num_seqs (at most
    MAX_CAPTURE_SIZE); max_num_seqs itself is the top rung when it is not on the ladder, so every batch the
    scheduler can form (up to that cap) has a graph and none is padded past max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    top = min(max_num_seqs, MAX_CAPTURE_SIZE)
    ladder = [size for size in (1, 2, 4, *range(8, top + 1, 8)) if size <= top]
    if ladder[-1] != top:
        ladder.append(top)
    return tuple(ladder)


def padded_size(num_reqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `num_reqs` requests (`sizes` ascending); None when none does."""
    i = bisect.bisect_left(sizes, num_reqs)
    return sizes[i] if i < len(sizes) else None


def graph_batch_size(step: StepInputs, sizes: tuple[int, ...], max_blocks_per_seq: int) -> int | None:
    """The captured size that runs `step` (its request count padded up), or None: the step runs eagerly.

    A step qualifies when every request decodes one known token: a prefill or extend chunk, or draft tokens to
    verify, give a request several query rows, which the decode graphs (one row per request) cannot hold."""
    num_reqs = len(step.request_ids)
    if num_reqs == 0 or step.num_decode_reqs != num_reqs or step.input_ids.shape[0] != num_reqs:
        return None
    if any(step.num_drafts) or step.token_lora_slots is not None:
        return None
    if step.block_tables.shape[1] > max_blocks_per_seq:  # longer than max_model_len: not the scheduler's steps
        return None
    return padded_size(num_reqs, sizes)


def graphs_unsafe_reason(model: DecoderForCausalLM, backend: object, uses_lora: bool, is_compiled: bool) -> str | None:
    """Why this model's decode step cannot be captured (the whole model then runs eagerly), or None.

    A capture fails on any host sync (`.item()`, `.tolist()`, an output size that depends on values) and
    replays only what it saw: anything whose kernels or control flow change per step must stay eager."""
    if not getattr(backend, "supports_cuda_graphs", False):
        return f"the {getattr(backend, 'name', backend)} attention backend reads the step's lengths on the host"
    if is_compiled:
        return "the step is torch.compile'd (the CPU path)"
    if uses_lora:  # LoRABatch picks its delta's form per step, and its token slots are a fresh tensor each step
        return "LoRA adapters are enabled"
    if model.config.vision is not None:
        return "a vision-language model's step takes image embeddings"
    if model.config.moe is not None:  # bincount-sized routing (models/moe.py, hpi_kernels/fused_moe.py)
        return "the Mixture-of-Experts routing syncs with the host"
    if model.stage.size > 1:
        return "a pipeline stage exchanges hidden states with its neighbours on the host"
    if model.tp.size > 1:  # NCCL all-reduces can be captured, but no multi-GPU run has tested it here
        return "tensor parallelism (not yet tested under CUDA graphs)"
    return None


@dataclass(frozen=True)
class CudaGraphConfig:
    """What the runner captures: the batch sizes, the longest request (the block tables' width), and how."""

    sizes: tuple[int, ...]  # ascending, e.g. capture_sizes(max_num_seqs)
    max_model_len: int
    capture: Capture | None = None  # None: CudaGraphCapture; CPU tests pass run_eagerly

    def __post_init__(self) -> None:
        if not self.sizes or list(self.sizes) != sorted(set(self.sizes)) or self.sizes[0] < 1:
            raise ValueError(f"capture sizes must be distinct positive integers in ascending order, got {self.sizes}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")


def run_eagerly(size: int, run: Callable[[], None]) -> Callable[[], None]:
    """A stand-in for capture on CPU: "replaying" runs the step function again, eagerly, on the static buffers."""
    return run


class CudaGraphCapture:
    """Captures into torch.cuda.CUDAGraphs that share one memory pool (`Capture` for a CUDA device)."""

    def __init__(self, device: torch.device, num_warmups: int = 2) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)
        self.num_warmups = num_warmups

    def __call__(self, size: int, run: Callable[[], None]) -> Callable[[], None]:
        # Warm-up on a side stream (torch.cuda.graph's documented pattern): first calls compile Triton kernels
        # and create per-stream library handles and workspaces (cuBLAS), which capture must not see. The same
        # stream then captures, every size: torch's docs ask for one stream across captures that share a pool.
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(self.num_warmups):
                run()
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
            run()
        return graph.replay


class DecodeGraphs:
    """The static input/output buffers of the decode step and one replayable step per captured batch size."""

    def __init__(
        self,
        model: DecoderForCausalLM,  # one stage, no images: model(input_ids [T], positions [T], metadata) -> [T, H]
        build_metadata: Callable[[AttentionMetadata], object],  # the attention backend's
        config: CudaGraphConfig,
        block_size: int,
    ) -> None:
        self.model, self.build_metadata, self.config, self.block_size = model, build_metadata, config, block_size
        self.device = device = model.model.norm.weight.device
        hidden_size, dtype = model.config.hidden_size, model.model.norm.weight.dtype  # the final norm's output
        self.max_blocks_per_seq = -(-config.max_model_len // block_size)
        max_bs = config.sizes[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_bs, self.max_blocks_per_seq, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        # One query token per request: the offsets never change.
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self._replays: dict[int, Callable[[], None]] = {}

    @property
    def is_captured(self) -> bool:
        return bool(self._replays)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The static tensors every replay reads and writes (tests check that they stay the same objects)."""
        return (self.input_ids, self.positions, self.slot_mapping, self.block_tables, self.context_lens,
                self.query_start_loc, self.hidden)  # fmt: skip

    def capture(self) -> None:
        """Capture every size, largest first (the smaller ones then fit in the pool the largest one grew)."""
        capture = self.config.capture or CudaGraphCapture(self.device)
        start = time.perf_counter()
        # Dummy inputs: every row a padding row, so warm-up and capture write no KV and read none.
        self._fill_padding(0, self.config.sizes[-1])
        for size in reversed(self.config.sizes):
            self._replays[size] = capture(size, self._step_function(size))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs of the decode step (batch sizes %d..%d) in %.1f s",
                    len(self._replays), self.config.sizes[0], self.config.sizes[-1],
                    time.perf_counter() - start)  # fmt: skip

    def release(self) -> None:
        """Drop the graphs (and with them their memory pool): before the weights or KV cache move (sleep)."""
        self._replays.clear()

    def run(self, step: StepInputs) -> torch.Tensor | None:
        """The step's hidden states [num_tokens, H] (a view of the static output buffer, valid until the next
        step), by replaying its padded size's graph; None when the step does not qualify (run it eagerly)."""
        if not self._replays:
            return None
        size = graph_batch_size(step, self.config.sizes, self.max_blocks_per_seq)
        if size is None:
            return None
        n, width = len(step.request_ids), step.block_tables.shape[1]
        self.input_ids[:n].copy_(step.input_ids, non_blocking=True)
        self.positions[:n].copy_(step.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(step.slot_mapping, non_blocking=True)
        # Columns past `width` keep older ids: the kernel reads only a request's first ceil(len / block) columns.
        self.block_tables[:n, :width].copy_(step.block_tables, non_blocking=True)
        self.context_lens[:n].copy_(step.context_lens, non_blocking=True)
        self._fill_padding(n, size)
        self._replays[size]()
        return self.hidden[:n]

    def _fill_padding(self, start: int, stop: int) -> None:
        """Rows [start, stop) as padding: no KV write (slot -1), nothing attended (context length 0)."""
        if start < stop:
            self.input_ids[start:stop].zero_()
            self.positions[start:stop].zero_()
            self.slot_mapping[start:stop].fill_(-1)
            self.context_lens[start:stop].zero_()

    def _step_function(self, size: int) -> Callable[[], None]:
        """The model over the first `size` rows of the buffers, its result copied into the output buffer."""
        common = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            context_lens=self.context_lens[:size],
            num_decode_reqs=size,
            max_query_len=1,
            max_context_len=self.config.max_model_len,
            block_size=self.block_size,
        )
        metadata = self.build_metadata(common)
        input_ids, positions, hidden = self.input_ids[:size], self.positions[:size], self.hidden[:size]

        def step() -> None:
            hidden.copy_(self.model(input_ids, positions, metadata))

        return step
