"""The model runner: scheduler deltas in, one batched forward over all scheduled tokens, sampled tokens out.

It keeps each request's token ids, block ids, progress and sampling settings in a persistent batch
(input_batch.py) updated from the `SchedulerOutput` deltas, takes the step's flat tensors from it (decodes
first, then prefill chunks), runs the model once for all of them (compiled, see compiled_model.py, or
eagerly), computes logits only for the rows that are sampled, and samples. A request verifying draft tokens
(speculative decoding) has every draft position sampled; it keeps the drafts that match and the token after
them (spec_decode/verify.py). With a draft model (spec_decode/draft_model.py) the drafts are proposed here,
just before the forward that verifies them; a sampled request's drafts are then verified by rejection
sampling against the draft's own distribution. A vision-language model's step (worker/multimodal.py) first runs
the vision encoder on the images the scheduler named, then feeds embeddings with image rows merged in.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from hpi_runtime.attention.backend import AttentionBackend
from hpi_runtime.attention.metadata import AttentionMetadata
from hpi_runtime.core.interface import ModelRunnerOutput, NewRequestData, SchedulerOutput, TokenLogprobs
from hpi_runtime.lora.layers import LoRAModel
from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.spec_decode.draft_model import DraftModel
from hpi_runtime.spec_decode.verify import num_accepted, rejection_sample
from hpi_runtime.worker.compiled_model import CompiledForward
from hpi_runtime.worker.cpu_decode import CpuDecodeStack, unsupported_reason
from hpi_runtime.worker.cuda_graphs import CudaGraphConfig, DecodeGraphs, graphs_unsafe_reason
from hpi_runtime.worker.input_batch import InputBatch, StepInputs
from hpi_runtime.worker.multimodal import MultimodalBatch
from hpi_runtime.worker.prompt_logprobs import compute_prompt_logprobs
from hpi_runtime.worker.sampler import Sampler, SamplingBatch, logprobs_of, mix_seed

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepLogits:
    """Logits of the rows sampled this step: request_ids[i] has 1 + num_drafts[i] consecutive rows (one when
    it verifies no drafts), in request order."""

    request_ids: tuple[str, ...]
    # [num_rows, vocab_size] float32; None on tensor-parallel ranks other than 0 and on pipeline stages but the last
    logits: torch.Tensor | None
    num_drafts: tuple[int, ...] = ()  # per request; () when no request verifies drafts
    partial_request_ids: tuple[str, ...] = ()  # scheduled, but their prefill chunk did not reach the end
    grammar_request_ids: tuple[str, ...] = ()  # sampled under a grammar: 1 + num_drafts rows each of the bitmask
    grammar_bitmask: torch.Tensor | None = None  # [rows of grammar_request_ids, ceil(vocab / 32)] int32
    prompt_logprobs: Mapping[str, tuple[int, tuple[TokenLogprobs, ...]]] = field(default_factory=dict)
    # A draft model's sampled requests: request id -> [num_drafts, V] float32, the q each draft was drawn from.
    draft_probs: Mapping[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class CompileConfig:
    """How the runner compiles its model step (see compiled_model.py)."""

    max_model_len: int = 2048  # warm-up requests stay within it
    freeze_weights: bool = False
    # After warm-up, run without evaluating Dynamo's guards (CompiledForward.seal); off only to check that
    # no step shape would need another graph (with guards skipped, none is ever compiled).
    seal_after_warmup: bool = True
    warmup_large_step_tokens: int = 256  # also runs a large step (CPU int8 layers dequantize there)

    def warmup_steps(self) -> tuple[tuple[int, ...], ...]:
        """Warm-up steps as the query lengths of their requests: one decode, decodes with a prefill chunk,
        and a large step of prefill chunks, so that no request meets a first-call cost."""
        chunk = min(self.max_model_len, 128)
        return (1,), (1, 1, min(self.max_model_len, 5)), (chunk,) * -(-self.warmup_large_step_tokens // chunk)


@dataclass(frozen=True)
class KVCacheSpec:
    num_blocks: int
    block_size: int
    dtype: torch.dtype


def allocate_kv_caches(model: DecoderForCausalLM, spec: KVCacheSpec, device: torch.device) -> int:
    """Allocate and bind each layer's k/v cache (for the KV heads this rank holds); returns the bytes allocated."""
    total_bytes = 0
    for attn in model.attention_layers():
        shape = (spec.num_blocks, spec.block_size, attn.num_kv_heads, attn.head_dim)
        attn.k_cache = torch.zeros(shape, dtype=spec.dtype, device=device)
        attn.v_cache = torch.zeros(shape, dtype=spec.dtype, device=device)
        total_bytes += 2 * attn.k_cache.numel() * attn.k_cache.element_size()
    return total_bytes


class ModelRunner:
    def __init__(
        self,
        model: DecoderForCausalLM,
        backend: AttentionBackend,
        block_size: int,
        eos_token_ids: frozenset[int],
        seed: int = 0,
        compile_config: CompileConfig | None = None,  # None: run the model eagerly
        drafter: DraftModel | None = None,  # draft-model speculation: it fills the scheduled draft slots
        lora: LoRAModel | None = None,  # the model's LoRA slots (lora/layers.py); None: no adapters
        graph_config: CudaGraphConfig | None = None,  # CUDA graphs for decode steps (cuda_graphs.py); None: none
        cpu_decode_rows: int = 0,  # CPU decode steps of up to this many tokens in one C++ call (cpu_decode.py)
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = next(model.parameters()).device
        self.sampler = Sampler(seed, self.device)
        self.input_batch = InputBatch(block_size, eos_token_ids)
        self.drafter = drafter
        self.lora = lora
        self.multimodal = MultimodalBatch(model, self.device) if model.config.vision is not None else None
        self._forward: Callable[..., torch.Tensor] = model
        self.graphs: DecodeGraphs | None = None  # before the compile's warm-up steps, which look for graphs
        self.cpu_decode: CpuDecodeStack | None = None  # likewise
        if compile_config is not None:
            self._compile(compile_config)
        if graph_config is not None:
            self._set_up_graphs(graph_config)
        if cpu_decode_rows:
            self._set_up_cpu_decode(cpu_decode_rows)

    @property
    def is_compiled(self) -> bool:
        return isinstance(self._forward, CompiledForward)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.sample(self.forward(scheduler_output))

    @torch.inference_mode()
    def forward(self, scheduler_output: SchedulerOutput) -> StepLogits:
        """Run the model over every scheduled token; logits for the requests whose chunk ends their tokens."""
        self.input_batch.update(scheduler_output)
        if self.drafter is not None:
            self.drafter.update(scheduler_output)
        if self.multimodal is not None:
            self.multimodal.update(scheduler_output)
        if not scheduler_output.num_scheduled_tokens:
            return StepLogits((), torch.empty(0, self.model.config.vocab_size, device=self.device))
        draft_probs = {}
        if self.drafter is not None and scheduler_output.spec_token_ids:
            draft_probs = self.drafter.propose(self.input_batch, list(scheduler_output.spec_token_ids)).draft_probs
        step = self.input_batch.prepare(scheduler_output.num_scheduled_tokens)
        hidden = self._run_model(step)
        if hidden is None:  # a pipeline stage before the last: its output went to the next stage
            return StepLogits((), None)
        ends = step.query_start_loc[1:].numpy().astype(np.int64)
        is_sampled = np.asarray(step.is_sampled, dtype=bool)
        num_drafts = np.asarray(step.num_drafts, dtype=np.int64)[is_sampled]
        if num_drafts.any():  # each request's last 1 + drafts rows, in order
            counts = num_drafts + 1
            first = np.repeat(ends[is_sampled] - counts, counts)  # [num_rows]: its request's first sampled row
            offsets = np.arange(counts.sum()) - np.repeat(counts.cumsum() - counts, counts)
            sampled_rows = torch.from_numpy(first + offsets)
        else:
            sampled_rows = torch.from_numpy(ends[is_sampled] - 1)
        logits = self.model.compute_logits(hidden.index_select(0, sampled_rows.to(self.device)))
        prompt_logprobs = {}
        if self.input_batch.prompt_logprob_ids and (chunks := self.input_batch.prompt_logprob_chunks(step)):
            prompt_logprobs = compute_prompt_logprobs(self.model.compute_logits, hidden, chunks)
        return StepLogits(
            request_ids=tuple(r for r, s in zip(step.request_ids, step.is_sampled, strict=True) if s),
            logits=logits,
            num_drafts=tuple(num_drafts.tolist()) if num_drafts.any() else (),
            partial_request_ids=tuple(r for r, s in zip(step.request_ids, step.is_sampled, strict=True) if not s),
            grammar_request_ids=scheduler_output.grammar_request_ids,
            grammar_bitmask=scheduler_output.grammar_bitmask,
            prompt_logprobs=prompt_logprobs,
            draft_probs=draft_probs,
        )

    def _run_model(self, step: StepInputs) -> torch.Tensor | None:
        """The step's final hidden states [num_tokens, H]: a captured decode graph's where the step qualifies,
        else one forward; None on a pipeline stage before the last (its output goes to the next stage)."""
        if self.graphs is not None and (hidden := self.graphs.run(step)) is not None:
            return hidden
        device = self.device
        common = AttentionMetadata(
            slot_mapping=step.slot_mapping.to(device),
            block_tables=step.block_tables.to(device),
            query_start_loc=step.query_start_loc.to(device),
            context_lens=step.context_lens.to(device),
            num_decode_reqs=step.num_decode_reqs,
            max_query_len=step.max_query_len,
            max_context_len=step.max_context_len,
            block_size=self.block_size,
        )
        metadata = self.backend.build_metadata(common)
        if self.lora is not None:
            self.lora.batch.set_step(step.token_lora_slots, device, len(step.input_ids))
        stage = self.model.stage
        forward = self._forward
        if self.cpu_decode is not None and self.cpu_decode.takes(len(step.input_ids), step.max_query_len,
                                                                 step.num_drafts):  # fmt: skip
            forward = self.cpu_decode
        if self.multimodal is not None:  # one stage only (engine_factory.check_pipeline_parallel)
            inputs_embeds, positions = self.multimodal.step_inputs(step)
            return self.model(step.input_ids.to(device), positions, metadata, inputs_embeds)
        if stage.size == 1:
            return forward(step.input_ids.to(device), step.positions.to(device), metadata)
        # A pipeline stage: the previous stage's output in, this one's out to the next (eager: no compile).
        received = None if stage.is_first else stage.link.recv(len(step.input_ids))
        hidden = forward(step.input_ids.to(device), step.positions.to(device), metadata, received)
        if not stage.is_last:
            stage.link.send(hidden)
            return None
        return hidden

    @torch.inference_mode()
    def sample(self, step: StepLogits) -> ModelRunnerOutput:
        """Sample one token per row of `step`, append it to the request's tokens, report it.

        Under tensor parallelism rank 0 (which holds the gathered logits) samples and broadcasts the token
        ids, so every rank's copy of the requests stays identical whatever the sampler does."""
        sampled: dict[str, tuple[int, ...]] = dict.fromkeys(step.partial_request_ids, ())
        if not step.request_ids:
            return ModelRunnerOutput(sampled_token_ids=sampled, prompt_logprobs=step.prompt_logprobs)
        rows = self.input_batch.rows_of(step.request_ids)
        probs = None
        if self.model.tp.size == 1:
            result = self.sampler(step.logits, self._sampling_batch(step, rows))
            token_ids, token_logprobs, probs = result.token_ids, result.logprobs, result.probs
        else:
            token_ids, token_logprobs = self._sample_on_first_rank(step, rows)
        if step.num_drafts:
            return self._verify(step, rows, (token_ids, token_logprobs, probs), sampled)
        if self.model.stage.size == 1:  # pipeline stages learn the tokens from the scheduler's next step instead
            self.input_batch.append_sampled(rows, token_ids)
        logprobs = {r: (lp,) for r, lp in zip(step.request_ids, token_logprobs, strict=True) if lp is not None}
        sampled.update((r, (t,)) for r, t in zip(step.request_ids, token_ids, strict=True))
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=step.prompt_logprobs)

    def _verify(
        self,
        step: StepLogits,
        rows: np.ndarray,  # [R] int64
        # One entry per sampled position (1 + num_drafts[i] for request i, in order): the sampler's tokens, their
        # logprobs, and the distributions they were drawn from ([num_rows, V]; None when all were greedy).
        samples_of_rows: tuple[list[int], list[TokenLogprobs | None], torch.Tensor | None],
        sampled: dict[str, tuple[int, ...]],
    ) -> ModelRunnerOutput:
        """Keep each request's drafts that match its samples, and the sample after them (a draft model's drafts
        of a sampled request: those that pass rejection sampling, then a recovered or the bonus token)."""
        token_ids, token_logprobs, probs = samples_of_rows
        logprobs = {}
        start = 0
        for request_id, row, num_drafts in zip(step.request_ids, rows.tolist(), step.num_drafts, strict=True):
            end = int(self.input_batch.num_tokens[row])
            draft_ids = self.input_batch.token_ids[row, end : end + num_drafts].tolist()
            samples = token_ids[start : start + num_drafts + 1]
            draft_probs = step.draft_probs.get(request_id)
            if draft_probs is not None and num_drafts:
                target_probs = probs[start : start + num_drafts + 1]
                emitted = rejection_sample(draft_ids, draft_probs, target_probs, samples[-1], self._generator(row))
            else:
                emitted = samples[: num_accepted(draft_ids, samples) + 1]
            kept = len(emitted)
            self.input_batch.append_tokens(row, emitted)
            sampled[request_id] = tuple(emitted)
            if token_logprobs[start] is not None:
                if emitted == samples[:kept]:
                    logprobs[request_id] = tuple(token_logprobs[start : start + kept])
                else:  # rejection sampling kept other tokens than the sampler drew
                    ids = torch.tensor(emitted, device=self.device)
                    n = self.input_batch.params[row].logprobs
                    logprobs[request_id] = tuple(logprobs_of(step.logits[start : start + kept], ids, (n,) * kept))
            if self.drafter is not None and num_drafts:
                self.drafter.settle(request_id, end, num_drafts, kept - 1)
            start += num_drafts + 1
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs, prompt_logprobs=step.prompt_logprobs)

    def _generator(self, row: int) -> torch.Generator:
        """The draws of a rejection test: a seeded request's own (seeded per output position), else the shared one."""
        seed = self.input_batch.params[row].seed
        if seed is None:
            return self.sampler.generator
        generator = torch.Generator(device=self.device)
        num_outputs = int(self.input_batch.num_tokens[row] - self.input_batch.num_prompt_tokens[row])
        generator.manual_seed(mix_seed(seed, num_outputs) ^ 0x2545F491)
        return generator

    def _sampling_batch(self, step: StepLogits, rows: np.ndarray) -> SamplingBatch:
        """The sampling settings of every logits row of `step` (`rows`: [R] int64, the requests' batch rows),
        plus the grammar bitmask of the constrained ones (if any)."""
        offsets = None
        first_row = np.arange(len(rows))  # each request's first logits row
        if step.num_drafts:
            counts = np.asarray(step.num_drafts, dtype=np.int64) + 1
            first_row = counts.cumsum() - counts
            offsets = np.arange(counts.sum()) - np.repeat(first_row, counts)
            rows = np.repeat(rows, counts)
        batch = self.input_batch.sampling_batch(rows, self.device, offsets)
        if step.grammar_bitmask is None:
            return batch
        # A constrained request's bitmask rows cover each of its sampled positions (1 + drafts), in order.
        counts = np.asarray(step.num_drafts, dtype=np.int64) + 1 if step.num_drafts else np.ones(len(rows), np.int64)
        position = {request_id: i for i, request_id in enumerate(step.request_ids)}
        grammar_rows = torch.from_numpy(np.concatenate([
            np.arange(first_row[i], first_row[i] + counts[i]) for i in (position[r] for r in step.grammar_request_ids)
        ]).astype(np.int64))  # fmt: skip
        return replace(batch, grammar_rows=grammar_rows, grammar_bitmask=step.grammar_bitmask)

    def _sample_on_first_rank(
        self, step: StepLogits, rows: np.ndarray
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        num_rows = len(rows) + sum(step.num_drafts)
        tokens = torch.full((num_rows,), -1, dtype=torch.int64, device=self.device)
        token_logprobs: list[TokenLogprobs | None] = [None] * num_rows
        try:
            if self.model.tp.is_first:
                result = self.sampler(step.logits, self._sampling_batch(step, rows))
                tokens.copy_(torch.tensor(result.token_ids, dtype=torch.int64))
                token_logprobs = list(result.logprobs)
        finally:  # the other ranks wait in this broadcast even when rank 0's sampler failed
            self.model.tp.broadcast_from_first(tokens)
        token_ids = tokens.tolist()
        if min(token_ids) < 0:
            raise RuntimeError("tensor-parallel rank 0 failed to sample this step")
        return token_ids, token_logprobs

    def _compile(self, config: CompileConfig) -> None:
        """Compile the model step now and run it over representative shapes, so no request pays for it."""
        if not getattr(self.backend, "supports_compile", False):
            logger.info("running the model eagerly: the %s attention backend is not compilable", self.backend.name)
            return
        if self.lora is not None and self.lora.batch.mode != "cpu":  # only the C++ kernel's delta is one graph
            logger.info("running the model eagerly: LoRA without the C++ CPU kernels")
            return
        start = time.perf_counter()
        lora_batch = None if self.lora is None else self.lora.batch
        self._forward = CompiledForward(self.model, config.freeze_weights, lora_batch)
        graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        for query_lens in config.warmup_steps():
            self.forward(_warmup_step(query_lens, self.block_size))
        self.input_batch.clear()
        if self.drafter is not None:
            self.drafter.num_computed.clear()  # the warm-up requests never finish
        if config.seal_after_warmup:
            self._forward.seal()
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
        logger.info("compiled the model step in %.1f s (%d graph%s, weights %sfrozen)",
                    time.perf_counter() - start, graphs, "" if graphs == 1 else "s",
                    "" if config.freeze_weights else "not ")  # fmt: skip

    def _set_up_graphs(self, config: CudaGraphConfig) -> None:
        """Capture the decode step for each batch size of `config`, unless this model cannot be graphed."""
        reason = graphs_unsafe_reason(self.model, self.backend, self.lora is not None, self.is_compiled)
        if reason is not None:
            logger.info("running the decode step without CUDA graphs: %s", reason)
            return
        self.graphs = DecodeGraphs(self.model, self.backend.build_metadata, config, self.block_size)
        self.capture_graphs()

    def _set_up_cpu_decode(self, max_rows: int) -> None:
        """Run decode steps of up to `max_rows` tokens through a DecodeStack, unless this model cannot."""
        probe = torch.empty(1, 1, self.model.config.head_dim, dtype=self.model.model.norm.weight.dtype)
        uses_kernel = getattr(self.backend, "uses_cpu_kernel", lambda q: False)(probe)
        reason = unsupported_reason(self.model, probe.dtype, uses_kernel)
        if reason is None and self.lora is not None and self.lora.batch.mode != "cpu":
            reason = "LoRA without the C++ CPU kernels"
        if reason is not None:
            logger.info("running decode steps through the model's own ops: %s", reason)
            return
        self.cpu_decode = CpuDecodeStack(self.model, max_rows, self.lora)
        self.capture_graphs()
        logger.info("decode steps of up to %d tokens run as one C++ call for the %d layers", max_rows,
                    len(self.model.model._own))  # fmt: skip

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """(Re)build the decode step's fast path over the current weights and KV cache (at start-up and after a
        wake): the CUDA graphs, or the CPU DecodeStack."""
        if self.graphs is not None:
            self.graphs.capture()
        if self.cpu_decode is not None:
            self.cpu_decode.build()

    def release_graphs(self) -> None:
        """Drop the decode graphs (and the CPU DecodeStack's hold on the weights and caches) before their weights
        or KV cache are freed (sleep); steps run through the model's own ops until capture_graphs."""
        if self.graphs is not None:
            self.graphs.release()
        if self.cpu_decode is not None:
            self.cpu_decode.release()


def _warmup_step(query_lens: tuple[int, ...], block_size: int) -> SchedulerOutput:
    """A step of dummy requests (token 0, every block id 0) with these query lengths, each its whole prompt.

    Its KV writes land in block 0, which holds nothing yet: warm-up runs before the first request."""
    new = tuple(
        NewRequestData(
            request_id=f"warmup-{i}",
            token_ids=(0,) * n,
            num_prompt_tokens=n,
            sampling_params=SamplingParams(temperature=0.0),
            block_ids=(0,) * -(-n // block_size),
            num_computed_tokens=0,
        )
        for i, n in enumerate(query_lens)
    )
    scheduled = {r.request_id: n for r, n in zip(new, query_lens, strict=True)}
    return SchedulerOutput(new, (), scheduled, sum(query_lens))
