"""The GPU check's measurement parts (bench/gpu: step, kernels, serve, kv_tier) in their dry runs, on CPU.

GPU time is scarce and a GPU machine starts bare, so a part that broke since it last ran would waste a lent GPU:
each part's dry run must run here, through `run_part` as the kit runs it, list what needs CUDA as skipped with a
reason, and measure what it can with positive numbers. The GPU plans are pure functions, checked for the sizes
the kit promises. The model is the embedded SmolLM2 shape cut to 2 layers (random weights, the real tokenizer):
the same code paths at a fraction of the compute. The serve part's dry run runs once, through the script, in
test_gpu_check.py; here only its failure handling.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from bench.gpu import kernels, kv_tier, serve, step
from bench.gpu import weights as gpu_weights
from bench.gpu.part import PartContext, run_part
from hpi_runtime.embedded import ensure_embedded_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_embedded(tmp_path_factory) -> Path:
    shape = {**gpu_weights.EMBEDDED_SHAPE, "num_hidden_layers": 2}
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(gpu_weights.SHAPES, "tiny-embedded", shape)
        return gpu_weights.build_random_model(
            "tiny-embedded", tmp_path_factory.mktemp("models") / "embedded", ensure_embedded_model(),
            torch.device("cpu"),
        )  # fmt: skip


def dry_run(name: str, fn, tmp_path: Path, models: dict, budget_s: float = 60.0):
    ctx = PartContext(tmp_path / "out", True, torch.device("cpu"), models, budget_s=budget_s)
    record = run_part(name, fn, ctx)
    assert record.status == "ran", record.error
    written = json.loads((tmp_path / "out" / "parts.json").read_text())[name]
    assert written["status"] == "ran" and written["part"] == name
    return record


def positive(values: dict, *keys: str) -> None:
    for key in keys:
        assert isinstance(values[key], float) and values[key] > 0, (key, values)


def test_step_dry_run_times_eager_decode_and_skips_graphs(tmp_path, tiny_embedded) -> None:
    # A model that fails (here: no such directory) is recorded as such and keeps the other's numbers.
    record = dry_run("step", step.run, tmp_path, {"1b": tmp_path / "missing", "embedded": tiny_embedded})
    assert "CUDA" in record.skipped["graphs"]
    assert record.skipped["1b eager"].startswith("failed: ") and "error" in record.results["models"]["1b"]["eager"]
    versions = record.results["versions"]
    assert versions["torch"] == torch.__version__ and versions["device_name"]
    eager = record.results["models"]["embedded"]["eager"]
    assert set(eager["batches"]) == {"1", "8"}
    for measured in eager["batches"].values():
        positive(measured, "step_ms", "decode_tok_s")
    assert eager["graphs"]["captured"] is False
    assert record.results["models"]["embedded"]["graphs_speedup"] == {}


def test_kernels_dry_run_checks_references_and_skips_triton_timings(tmp_path) -> None:
    record = dry_run("kernels", kernels.run, tmp_path, {})
    assert "CUDA" in record.skipped["triton timings"]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # the suite sets it without a GPU (tests/conftest.py)
    results = record.results
    for group in ("decode", "prefill"):
        assert results[group]
        for measured in results[group].values():
            positive(measured, "reference_ms", "sdpa_dense_ms")
            assert "triton_ms" not in measured
            if interpreted:  # fp32 in the dry run: the kernels match the references closely
                assert measured["max_abs_err"] < 1e-4
    rows = results["matmul"]["toy"]["rows"]
    assert set(rows) == {"1", "16"}
    for row in rows.values():
        positive(row, "torch_matmul_ms")
        if interpreted:
            assert row["int8_rel_err"] < 1e-4 and row["int4_rel_err"] < 1e-4


def test_a_kernel_size_that_fails_keeps_the_other_sizes(tmp_path, monkeypatch) -> None:
    measure = kernels.decode_attention

    def overflow_at_80(plan, context, device):
        if context == 80:
            raise IndexError("an index overflow at 80 tokens")
        return measure(plan, context, device)

    monkeypatch.setattr(kernels, "decode_attention", overflow_at_80)
    record = dry_run("kernels", kernels.run, tmp_path, {})
    assert record.skipped["decode context 80"] == "failed: an index overflow at 80 tokens"
    assert "IndexError" in record.results["decode"]["80"]["error"]
    positive(record.results["decode"]["32"], "reference_ms")
    assert record.results["prefill"] and record.results["matmul"]


def test_kv_tier_dry_run_copies_between_cpu_tensors(tmp_path) -> None:
    record = dry_run("kv_tier", kv_tier.run, tmp_path, {})
    assert "CUDA" in record.skipped["pinned DMA"]
    assert record.results["pinned"] is False and record.results["dry_run"] is True
    transfers = record.results["transfers"]
    assert set(transfers) == {"4", "16"}
    for measured in transfers.values():
        positive(measured, "d2h_issue_ms", "d2h_ms", "d2h_gb_s", "h2d_ms", "h2d_gb_s", "raw_d2h_gb_s", "raw_h2d_gb_s")


def test_a_serve_part_whose_every_model_failed_is_failed(tmp_path) -> None:
    ctx = PartContext(tmp_path / "out", True, torch.device("cpu"), {"embedded": tmp_path / "missing"})
    record = run_part("serve", serve.run, ctx)
    assert record.status == "failed" and "missing" in record.error


def test_a_part_past_its_budget_lists_what_it_cut(tmp_path) -> None:
    record = dry_run("kv_tier", kv_tier.run, tmp_path, {}, budget_s=0.0)
    assert record.results["transfers"] == {}
    assert set(record.skipped) >= {"4 blocks", "16 blocks"}
    assert all("budget" in why for what, why in record.skipped.items() if "blocks" in what)


def test_gpu_plans_have_the_promised_sizes(tmp_path) -> None:
    ctx = PartContext(tmp_path, False, torch.device("cuda"))
    step_plan = step.plan_for(ctx)
    assert step_plan.batch_sizes == (1, 8, 32, 128) and step_plan.modes == ("eager", "graphs")
    assert step_plan.dtype == torch.bfloat16 and step_plan.context_tokens >= 200
    kernel_plan = kernels.plan_for(ctx)
    assert kernel_plan.decode_contexts == (512, 2048, 8192, 32768) and kernel_plan.decode_batch == 32
    assert kernel_plan.matmul_rows == (1, 16, 128, 1024) and kernel_plan.time_triton
    assert {name for name, _, _ in kernel_plan.gemms} == {"qkv", "o", "gate_up", "down"}
    serve_plan = serve.plan_for(ctx)
    args = serve_plan.server_args
    assert serve_plan.clients == (1, 32, 128) and serve_plan.dtype == "bfloat16"
    assert args[args.index("--device") + 1] == "cuda" and int(args[args.index("--max-num-seqs") + 1]) >= 128
    assert "--enforce-eager" not in args
    tier_plan = kv_tier.plan_for(ctx)
    assert tier_plan.block_bytes == 512 * 1024 and max(tier_plan.transfer_blocks) * tier_plan.block_bytes == 1 << 30
