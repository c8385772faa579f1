"""Pipeline parallelism on one host (real rank processes, gloo over loopback): the group's layout and flags, and
greedy tokens identical to the single-process engine in fp32 for a dense and a MoE family, under concurrent
requests with chunked prefill and preemption. The group across separate hosts (network namespaces: qwen2 at
2 stages x 2 tensor-parallel ranks) and its failure handling are tests/runtime/server/test_multi_node_server.py's.
"""

from __future__ import annotations

import multiprocessing
import socket
from pathlib import Path

import msgspec
import pytest
import torch.distributed as dist

from hpi_runtime.config import ParallelConfig
from hpi_runtime.core.engine_io import EngineStats
from hpi_runtime.llm import LLM
from hpi_runtime.models.config import load_model_config
from hpi_runtime.models.parallel import Span, pipeline_partition, stage_layers
from hpi_runtime.sampling_params import SamplingParams
from hpi_runtime.server.metrics import ServingMetrics
from hpi_runtime.worker import pp_executor
from hpi_runtime.worker.pp_executor import PipelineExecutor
from hpi_runtime.worker.pp_layout import GroupLayout, interface_towards, resolve_layout
from hpi_runtime.worker.pp_worker import report_failure

PROMPTS = [
    "The quick brown fox jumps over the lazy dog",
    "hello",
    "Paged attention keeps the keys and values of every request in fixed-size blocks " * 2,  # chunked
    "Kubernetes operators reconcile",
    "one two three four five six seven eight nine ten",
    "pipeline stages",
]
# 4 layers: two per stage. 10 KV blocks in all (each rank's budget is its share of the bytes) hold fewer tokens
# than the requests need at once, so requests are preempted; 16 tokens per step chunk the long prompt.
LAYERS = 4
KV_BYTES = 160 << 10  # 10 blocks of 16 tokens over 4 layers, 2 KV heads of 16 dims in fp32
SETTINGS = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=16, enforce_eager=True,
                kv_admission_watermark=0.0)  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_layout_comes_from_the_flags_else_leaderworkerset() -> None:
    lws = {"LWS_LEADER_ADDRESS": "leader.svc", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"}
    layout = resolve_layout(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2), lws)
    assert (layout.nnodes, layout.node_rank, layout.master_addr, layout.master_port) == (2, 1, "leader.svc", 29500)
    assert list(layout.node_model_ranks(1)) == [2, 3] and layout.stage_of(3) == 1 and layout.tp_rank_of(3) == 1
    flags = ParallelConfig(pipeline_parallel_size=4, nnodes=4, node_rank=0, master_addr="10.0.0.1", master_port=1234)
    layout = resolve_layout(flags, lws)  # flags win over the environment
    assert (layout.nnodes, layout.node_rank, layout.master_addr, layout.is_leader) == (4, 0, "10.0.0.1", True)
    single = resolve_layout(ParallelConfig(), {})
    assert not single.is_distributed and single.master_addr == "127.0.0.1"


@pytest.mark.parametrize(
    ("parallel", "message"),
    [
        (dict(tensor_parallel_size=2, pipeline_parallel_size=3, nnodes=2), "tensor parallelism stays inside a host"),
        (dict(pipeline_parallel_size=3, nnodes=2), "cannot be spread evenly over 2 hosts"),
        (dict(pipeline_parallel_size=2, nnodes=2, node_rank=2), "node_rank 2 is outside a group of 2 hosts"),
    ],
)
def test_a_layout_that_does_not_divide_is_refused(parallel: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve_layout(ParallelConfig(**parallel), {})


def test_bad_leaderworkerset_environment_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"\$LWS_GROUP_SIZE must be an integer, got 'two'"):
        resolve_layout(ParallelConfig(pipeline_parallel_size=2), {"LWS_GROUP_SIZE": "two"})


def test_stages_split_layers_consecutively_by_cost_as_the_operator_sizes_them(embedded_model_dir: Path) -> None:
    from hpi_operator.sizing import KNOWN_SHAPES, stage_partition  # the test environment has every component

    config = load_model_config(embedded_model_dir)
    assert config.num_layer_parameters == 2 * 576 * (9 + 3) * 64 + 3 * 576 * 1536  # SmolLM2-135M's layer
    # The head (49152 x 576) is 8 layers' work on the last stage: 19 | 11 + 8, where the operator sized them.
    partition = pipeline_partition(config, 2, {})
    assert partition == (19, 11) == stage_partition(KNOWN_SHAPES["smollm2-135m-instruct"], 2)
    assert [stage_layers(partition, s) for s in (0, 1)] == [Span(0, 19), Span(19, 11)]
    assert pipeline_partition(config, 2, {"VLLM_PP_LAYER_PARTITION": "15,15"}) == (15, 15)
    with pytest.raises(ValueError, match="exceeds the model's 30 layers"):
        pipeline_partition(config, 31, {})
    with pytest.raises(ValueError, match="pipeline stage 2 of 2 does not exist"):
        stage_layers(partition, 2)


def test_stage_busy_seconds_are_a_counter_per_stage_on_metrics() -> None:
    metrics = ServingMetrics("m")
    idle = EngineStats(0, 0, 0.0, 0, 0, 0, 0, 0)
    for busy_s in ((1.5, 2.0), (2.5, 2.25)):  # cumulative, as the engine reports them
        metrics.refresh(msgspec.structs.replace(idle, pipeline_stage_busy_s=busy_s))
    rendered = metrics.render().decode()
    assert 'hpi:pipeline_stage_busy_seconds_total{model_name="m",stage="0"} 2.5' in rendered
    assert 'hpi:pipeline_stage_busy_seconds_total{model_name="m",stage="1"} 2.25' in rendered
    metrics.refresh(idle)  # one stage: no series
    assert 'stage="2"' not in metrics.render().decode()


def test_the_interface_towards_the_leader_is_the_routed_one() -> None:
    assert interface_towards("127.0.0.1", 29500) == "lo"
    assert GroupLayout(1, 2, 2, 0, "127.0.0.1", 29500, 30.0).heartbeat_timeout_s == 5.0


def _leader_reading(store_port: int) -> PipelineExecutor:
    """The leader's failure reading alone, over a real store (no ranks): 2 stages on 2 hosts, tensor-parallel 2,
    so host 1 holds model ranks 2 and 3."""
    executor = PipelineExecutor.__new__(PipelineExecutor)  # the reading needs only these three
    executor.layout = GroupLayout(2, 2, 2, 0, "127.0.0.1", store_port, 30.0)
    executor._store = dist.TCPStore("127.0.0.1", store_port, None, True, wait_for_workers=False)
    executor._ranks = {}
    return executor


def test_a_killed_rank_is_named_before_the_broken_connections_it_caused(monkeypatch) -> None:
    """When rank 2 is killed, rank 3 (its tensor-parallel sibling) sees its connection reset and reports that; its
    report can reach the store before host 1's watcher reports the kill. The leader waits for the host's word and
    names the kill first (the race test_multi_node_server.py's kill test once lost)."""
    executor = _leader_reading(_free_port())
    report_failure(executor._store, "3", "pipeline rank 3 (stage 1, host 1): RuntimeError: Connection reset by peer")
    checks: list[bool] = []
    read = executor._hosts_reported

    def host_reports_while_the_leader_waits() -> bool:
        done = read()
        if not checks:  # the host's watcher reports the kill after the leader's first look
            report_failure(executor._store, "host1", "pipeline rank 2 (stage 1, host 1) was killed by signal 9")
        checks.append(done)
        return done

    monkeypatch.setattr(executor, "_hosts_reported", host_reports_while_the_leader_waits)
    reason = executor._settled(executor._failure())
    assert checks[0] is False and checks[-1] is True  # it waited for host 1, and no longer
    assert reason.startswith("pipeline rank 2 (stage 1, host 1) was killed by signal 9; pipeline rank 3"), reason

    # A rank on the leader's host sees its link to the killed rank's host close: it waits for a worker host's word
    # too (the race test_multi_node_server.py's kill test lost under load, rank 0 reporting first).
    leader_side = _leader_reading(_free_port())
    report_failure(leader_side._store, "0", "pipeline rank 0 (stage 0, host 0): RuntimeError: Connection closed by "
                   "peer [10.246.146.2]:21663")  # fmt: skip
    assert leader_side._hosts_reported() is False
    report_failure(leader_side._store, "host1", "pipeline rank 2 (stage 1, host 1) was killed by signal 9")
    assert leader_side._hosts_reported() is True
    assert leader_side._failure().startswith("pipeline rank 2 (stage 1, host 1) was killed by signal 9; pipeline "
                                             "rank 0")  # fmt: skip

    # A host that never reports (a rank that reported and hangs instead of exiting) costs the grace, then the
    # rank's own report is the reason.
    monkeypatch.setattr(pp_executor, "HOST_REPORT_GRACE_S", 0.2)
    silent = _leader_reading(_free_port())
    report_failure(silent._store, "2", "pipeline rank 2 (stage 1, host 1): ValueError: bad step")
    assert silent._settled(silent._failure()) == "pipeline rank 2 (stage 1, host 1): ValueError: bad step"


def _generate(llm: LLM) -> list[tuple[int, ...]]:
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    return [o.output_token_ids for o in llm.generate(PROMPTS, greedy)]


# Experts split by the stage that owns the layer; layer 1 dense, a shared expert.
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64,
           mlp_only_layers=[1])  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "overrides"), [("llama", {}), ("qwen2_moe", MOE)], ids=["llama", "qwen2_moe"])
def test_pipeline_matches_one_process(tiny_model_factory, arch: str, overrides: dict) -> None:
    model_dir: Path = tiny_model_factory(arch, num_layers=LAYERS, **overrides)
    with LLM(model_dir, kv_cache_memory_bytes=KV_BYTES, **SETTINGS) as llm:
        expected = _generate(llm)
    with LLM(model_dir, pipeline_parallel_size=2, master_port=_free_port(), kv_cache_memory_bytes=KV_BYTES // 2,
             **SETTINGS) as llm:  # fmt: skip
        assert llm.bundle.footprint.num_kv_blocks == 10
        assert llm.engine.executor.max_concurrent_batches == 3  # on CPU, one more batch than stages
        got = _generate(llm)
        stats = llm.engine.get_stats()
        busy = llm.engine.executor.stage_stats()
    assert got == expected
    assert len({tokens for tokens in expected}) > 1  # the prompts lead different ways
    assert stats.num_preemptions > 0  # the small KV budget preempted (and recomputed) requests
    assert set(busy) == {0, 1} and all(s["num_steps"] > 0 for s in busy.values())
    assert len(stats.pipeline_stage_busy_s) == 2  # what /metrics exports as hpi:pipeline_stage_busy_seconds
    assert multiprocessing.active_children() == []  # every rank stopped with the engine


@pytest.mark.slow
def test_start_up_names_the_ranks_that_never_joined(tiny_model_dir: Path) -> None:
    """A leader whose worker host never comes: a clear error naming the missing rank and host, nothing left running."""
    with pytest.raises(RuntimeError, match=r"ranks \[1\] \(on hosts \[1\], node_rank\) did not join the leader"):
        LLM(tiny_model_dir, pipeline_parallel_size=2, nnodes=2, node_rank=0, master_port=_free_port(),
            distributed_timeout_seconds=2, dtype="float32", max_model_len=128, enforce_eager=True)  # fmt: skip
    assert multiprocessing.active_children() == []
