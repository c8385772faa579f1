"""CUDA graphs of the decode step (worker/cuda_graphs.py), on CPU: the batch-size ladder, padding, which steps and
models qualify, static buffers reused step after step, eager fallback, sleep/wake.

No GPU here, so graph capture and replay are replaced by the eager call on the static buffers (`run_eagerly`, or
a recording variant of it): everything around the graph (buffers filled in place, padding rows, metadata built
once per size, the choice of size) runs for real, with the `triton` attention backend under TRITON_INTERPRET=1.
That a real capture works and replays the eager numbers is the `gpu` tests' job, at the end of this file."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hpi_runtime.attention.factory import get_attention_backend
from hpi_runtime.config import CacheConfig
from hpi_runtime.models.config import load_model_config
from hpi_runtime.models.loader import load_model
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.worker import executor as executor_module
from hpi_runtime.worker.cuda_graphs import (
    MAX_CAPTURE_SIZE,
    CudaGraphCapture,
    CudaGraphConfig,
    capture_sizes,
    graph_batch_size,
    graphs_unsafe_reason,
    padded_size,
    run_eagerly,
)
from hpi_runtime.worker.executor import ExecutorConfig, graph_config
from hpi_runtime.worker.input_batch import StepInputs
from hpi_runtime.worker.model_runner import KVCacheSpec, ModelRunner, allocate_kv_caches
from hpi_runtime.worker.sleep import ModelSleeper

from ..models.conftest import HandScheduler

BLOCK_SIZE, NUM_BLOCKS, MAX_MODEL_LEN = 8, 48, 64
GREEDY_TOP2 = SamplingParams(temperature=0.0, max_tokens=64, logprobs=2)

# -- the ladder and padding ---------------------------------------------------------------------------------


def test_capture_sizes_follow_vllms_ladder() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(10_000)[-1] == MAX_CAPTURE_SIZE
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


@given(st.integers(1, 2 * MAX_CAPTURE_SIZE), st.integers(1, 2 * MAX_CAPTURE_SIZE))
def test_every_batch_pads_to_the_smallest_captured_size_that_holds_it(max_num_seqs: int, num_reqs: int) -> None:
    sizes = capture_sizes(max_num_seqs)
    assert sizes[0] == 1 and list(sizes) == sorted(set(sizes)) and sizes[-1] == min(max_num_seqs, MAX_CAPTURE_SIZE)
    size = padded_size(num_reqs, sizes)
    if num_reqs > sizes[-1]:
        assert size is None
    else:
        assert size in sizes and size >= num_reqs
        assert all(s < num_reqs for s in sizes if s < size)
        assert size - num_reqs < max(8, num_reqs)  # the ladder never pads past the next rung of 8 (or a doubling)


def _step(query_lens: list[int], num_drafts: list[int] | None = None, lora: bool = False, width: int = 2) -> StepInputs:
    num_tokens = sum(query_lens)
    return StepInputs(
        request_ids=tuple(f"r{i}" for i in range(len(query_lens))),
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        positions=torch.zeros(num_tokens, dtype=torch.int64),
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
        block_tables=torch.zeros(len(query_lens), width, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32),
        context_lens=torch.ones(len(query_lens), dtype=torch.int32),
        is_sampled=(True,) * len(query_lens),
        num_drafts=tuple(num_drafts or [0] * len(query_lens)),
        num_decode_reqs=sum(n == 1 for n in query_lens),
        max_query_len=max(query_lens),
        max_context_len=1,
        token_lora_slots=np.zeros(num_tokens, dtype=np.int64) if lora else None,
    )


def test_only_pure_decode_steps_within_the_ladder_take_a_graph() -> None:
    sizes = (1, 2, 4, 8)
    assert graph_batch_size(_step([1]), sizes, 8) == 1
    assert graph_batch_size(_step([1] * 3), sizes, 8) == 4
    assert graph_batch_size(_step([1] * 5), sizes, 8) == 8
    assert graph_batch_size(_step([1] * 9), sizes, 8) is None  # above the largest size
    assert graph_batch_size(_step([1, 1, 5]), sizes, 8) is None  # a prefill chunk beside the decodes
    assert graph_batch_size(_step([3, 1]), sizes, 8) is None  # a request verifying two drafts
    assert graph_batch_size(_step([1, 1], num_drafts=[0, 1]), sizes, 8) is None
    assert graph_batch_size(_step([1, 1], lora=True), sizes, 8) is None
    assert graph_batch_size(_step([1, 1], width=9), sizes, 8) is None  # wider than the static block tables


def _model_facts(vision=None, moe=None, stage_size=1, tp_size=1) -> SimpleNamespace:
    """What graphs_unsafe_reason reads from a model."""
    config = SimpleNamespace(vision=vision, moe=moe)
    return SimpleNamespace(config=config, stage=SimpleNamespace(size=stage_size), tp=SimpleNamespace(size=tp_size))


def test_models_that_cannot_be_captured_say_why() -> None:
    triton = SimpleNamespace(name="triton", supports_cuda_graphs=True)
    assert graphs_unsafe_reason(_model_facts(), triton, uses_lora=False, is_compiled=False) is None
    cases = {
        "attention backend": (_model_facts(), SimpleNamespace(name="torch"), False, False),
        "compile": (_model_facts(), triton, False, True),
        "LoRA": (_model_facts(), triton, True, False),
        "vision": (_model_facts(vision=object()), triton, False, False),
        "Mixture-of-Experts": (_model_facts(moe=object()), triton, False, False),
        "pipeline": (_model_facts(stage_size=2), triton, False, False),
        "tensor parallelism": (_model_facts(tp_size=2), triton, False, False),
    }
    for words, (model, backend, uses_lora, is_compiled) in cases.items():
        assert words in graphs_unsafe_reason(model, backend, uses_lora, is_compiled)


def test_graphs_are_on_for_cuda_unless_enforce_eager() -> None:
    config = ExecutorConfig(model_config=None, dtype=torch.float16, device=torch.device("cuda"), max_model_len=4096,
                            max_num_seqs=20)  # fmt: skip
    assert graph_config(config, torch.device("cuda")) == CudaGraphConfig((1, 2, 4, 8, 16, 20), 4096)
    assert graph_config(config, torch.device("cpu")) is None
    eager = ExecutorConfig(model_config=None, dtype=torch.float16, device=torch.device("cuda"), max_model_len=4096,
                           enforce_eager=True)  # fmt: skip
    assert graph_config(eager, torch.device("cuda")) is None


def test_capture_sizes_are_checked() -> None:
    for sizes in ((), (2, 1), (1, 1), (0, 1)):
        with pytest.raises(ValueError, match="capture sizes"):
            CudaGraphConfig(sizes, 64)


# -- the runner, end to end ---------------------------------------------------------------------------------


class RecordingCapture:
    """Stands in for CUDA graph capture: a "replay" is the eager call on the static buffers, recorded by size."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replayed: list[int] = []

    def __call__(self, size: int, run):
        self.captured.append(size)

        def replay() -> None:
            self.replayed.append(size)
            run()

        return replay


def _graphs(capture, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> CudaGraphConfig:
    return CudaGraphConfig(sizes, MAX_MODEL_LEN, capture)


def _runner(model_dir: Path, graphs: CudaGraphConfig | None = None, device: str = "cpu") -> ModelRunner:
    """fp32 with the triton backend (interpreted on CPU); decode graphs when `graphs` is given."""
    config = load_model_config(model_dir)
    device = torch.device(device)
    backend = get_attention_backend("triton", torch.float32, device)
    model = load_model(config, torch.float32, device, backend)
    allocate_kv_caches(model, KVCacheSpec(NUM_BLOCKS, BLOCK_SIZE, torch.float32), device)
    return ModelRunner(model, backend, BLOCK_SIZE, config.eos_token_ids, 0, graph_config=graphs)


def _generate(runner: ModelRunner, prompt_lens: list[int], num_steps: int, finish_after: dict[int, list[str]],
              on_step=None) -> tuple[dict[str, list[int]], dict[str, list]]:  # fmt: skip
    """Greedy tokens and logprobs per request; `finish_after[step]`: requests finished after that step."""
    scheduler = HandScheduler(NUM_BLOCKS, BLOCK_SIZE, chunk_size=6)
    generator = torch.Generator().manual_seed(0)
    for i, n in enumerate(prompt_lens):
        prompt = torch.randint(3, runner.model.config.vocab_size, (n,), generator=generator).tolist()
        scheduler.add(f"r{i}", prompt, GREEDY_TOP2)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list] = {}
    for step in range(num_steps):
        output = runner.execute_model(scheduler.schedule())
        for request_id, sampled in output.sampled_token_ids.items():
            for token in sampled:
                scheduler.append(request_id, token)
                tokens.setdefault(request_id, []).append(token)
            logprobs.setdefault(request_id, []).extend(output.logprobs.get(request_id, ()))
        for request_id in finish_after.get(step, ()):
            scheduler.finish(request_id)
        if on_step is not None:
            on_step(step)
    return tokens, logprobs


def _assert_same_generation(got: tuple[dict, dict], expected: tuple[dict, dict]) -> None:
    """The same tokens, and logprobs (of the chosen and the runner-up token) within fp32 rounding.

    Not bit for bit: a padded batch gives the linears more rows, and MKL picks its fp32 kernel by shape, so a
    request's row can differ in the last bit between a 3-row and a 4-row matmul (seen here: 1e-6 nats)."""
    (tokens, logprobs), (expected_tokens, expected_logprobs) = got, expected
    assert tokens == expected_tokens
    assert logprobs.keys() == expected_logprobs.keys()
    for request_id, expected_row in expected_logprobs.items():
        for a, b in zip(logprobs[request_id], expected_row, strict=True):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [lp for _, lp in a.top] == pytest.approx([lp for _, lp in b.top], abs=1e-5)


# Five requests (prompts of 3..9 tokens, chunked by 6): steps 0-1 prefill (mixed with decodes), then 5 decodes
# a step (padded to 8); after step 4 two finish, leaving 3 (padded to 4).
PROMPT_LENS = [3, 9, 4, 7, 5]
FINISH = {4: ["r1", "r3"]}
NUM_STEPS = 7


@pytest.fixture(scope="module")
def eager_run(tiny_model_dir: Path):
    return _generate(_runner(tiny_model_dir), PROMPT_LENS, NUM_STEPS, FINISH)


def test_padded_decode_graphs_give_the_eager_tokens_and_logprobs(tiny_model_dir: Path, eager_run) -> None:
    capture = RecordingCapture()
    runner = _runner(tiny_model_dir, _graphs(capture))
    assert capture.captured == [8, 4, 2, 1]  # largest first
    buffers = runner.graphs.buffers()
    pointers = [b.data_ptr() for b in buffers]
    tokens, logprobs = _generate(runner, PROMPT_LENS, NUM_STEPS, FINISH)
    _assert_same_generation((tokens, logprobs), eager_run)
    # Steps 0-1 mix prefill chunks and decodes (eager); 2-4 decode five requests, 5-6 three.
    assert capture.replayed == [8, 8, 8, 4, 4]
    assert [b.data_ptr() for b in runner.graphs.buffers()] == pointers
    assert all(a is b for a, b in zip(runner.graphs.buffers(), buffers, strict=True))


def test_batches_above_the_largest_size_run_eagerly(tiny_model_dir: Path, eager_run) -> None:
    capture = RecordingCapture()
    runner = _runner(tiny_model_dir, _graphs(capture, sizes=(1, 2, 4)))
    _assert_same_generation(_generate(runner, PROMPT_LENS, NUM_STEPS, FINISH), eager_run)
    assert capture.replayed == [4, 4]  # five decodes do not fit 4: only the three-request steps replay


def test_sleep_drops_the_graphs_and_wake_recaptures_them(tiny_model_dir: Path, eager_run) -> None:
    """As LocalExecutor.sleep / wake_up do around the sleeper (whose storages come back at new addresses)."""
    capture = RecordingCapture()
    runner = _runner(tiny_model_dir, _graphs(capture))

    def sleep_and_wake(step: int) -> None:
        if step == 2:
            runner.release_graphs()
            assert not runner.graphs.is_captured
        if step == 3:
            runner.capture_graphs()

    _assert_same_generation(_generate(runner, PROMPT_LENS, NUM_STEPS, FINISH, on_step=sleep_and_wake), eager_run)
    assert capture.captured == [8, 4, 2, 1] * 2
    assert capture.replayed == [8, 8, 4, 4]  # step 3 ran eagerly, without graphs


def test_the_executor_drops_graphs_for_sleep_and_recaptures_on_wake(tiny_model_dir: Path, monkeypatch) -> None:
    """LocalExecutor wiring, on CPU: graph_config (CUDA only) replaced by the recording stand-in."""
    capture = RecordingCapture()
    monkeypatch.setattr(executor_module, "graph_config", lambda config, device: _graphs(capture, sizes=(1, 2)))
    config = ExecutorConfig(model_config=load_model_config(tiny_model_dir), dtype=torch.float32,
                            device=torch.device("cpu"), max_model_len=MAX_MODEL_LEN, attention_backend="triton",
                            cache=CacheConfig(block_size=BLOCK_SIZE, kv_cache_memory_bytes=1 << 20))  # fmt: skip
    executor = executor_module.LocalExecutor(config)
    assert capture.captured == [2, 1] and executor.runner.graphs.is_captured
    executor.sleep(1)
    assert not executor.runner.graphs.is_captured
    executor.wake_up()
    assert capture.captured == [2, 1, 2, 1] and executor.runner.graphs.is_captured

def test_models_that_cannot_be_captured_run_eagerly(tiny_model_dir: Path) -> None:
    config = load_model_config(tiny_model_dir)
    cpu = torch.device("cpu")
    backend = get_attention_backend("torch", torch.float32, cpu)
    model = load_model(config, torch.float32, cpu, backend)
    allocate_kv_caches(model, KVCacheSpec(NUM_BLOCKS, BLOCK_SIZE, torch.float32), cpu)
    runner = ModelRunner(model, backend, BLOCK_SIZE, config.eos_token_ids, 0,
                         graph_config=CudaGraphConfig((1, 2), MAX_MODEL_LEN, run_eagerly))  # fmt: skip
    assert runner.graphs is None


# -- on a GPU: real capture and replay ------------------------------------------------------------------------


class RecordingCudaCapture(RecordingCapture):
    """Real CUDA graphs (CudaGraphCapture), with the sizes captured and replayed recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.cuda = CudaGraphCapture(torch.device("cuda"))

    def __call__(self, size: int, run):
        self.captured.append(size)
        graph_replay = self.cuda(size, run)

        def replay() -> None:
            self.replayed.append(size)
            graph_replay()

        return replay


@pytest.mark.gpu
def test_cuda_graphs_replay_the_eager_step_at_padded_sizes(tiny_model_dir: Path) -> None:
    """Captured graphs of sizes 8, 4, 2, 1 give the eager run's tokens, and its logprobs up to float rounding
    (on a GPU padding changes both the linears' row count and the decode kernel's split count)."""
    eager = _generate(_runner(tiny_model_dir, device="cuda"), PROMPT_LENS, NUM_STEPS, FINISH)
    capture = RecordingCudaCapture()
    runner = _runner(tiny_model_dir, _graphs(capture), device="cuda")
    assert capture.captured == [8, 4, 2, 1]
    _assert_same_generation(_generate(runner, PROMPT_LENS, NUM_STEPS, FINISH), eager)
    assert capture.replayed == [8, 8, 8, 4, 4]


@pytest.mark.gpu
def test_cuda_graphs_recaptured_after_sleep_and_wake(tiny_model_dir: Path) -> None:
    """Sleep level 1 moves the weights to host memory and frees the KV cache; after the wake (new storages) the
    recaptured graphs still give the eager tokens. Captured by the default CUDA capture, as the executor does."""
    eager = _generate(_runner(tiny_model_dir, device="cuda"), PROMPT_LENS, NUM_STEPS, FINISH)
    runner = _runner(tiny_model_dir, _graphs(None), device="cuda")  # None: a fresh CudaGraphCapture per capture
    sleeper = ModelSleeper(runner.model, rebuild=lambda: None)  # level 1 on a GPU keeps a host copy: no rebuild
    runner.release_graphs()
    sleeper.sleep(1)
    sleeper.wake_up()
    runner.capture_graphs()
    assert runner.graphs.is_captured
    _assert_same_generation(_generate(runner, PROMPT_LENS, NUM_STEPS, FINISH), eager)
