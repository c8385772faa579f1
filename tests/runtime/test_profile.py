"""`hpi profile`: the engine measures its own decode line, prefill rate and KV-bound batch, in the shape the
operator's fleet optimizer reads (spec.placement.pools[].performance)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpi_contracts.pool_profile import profile_from_json
from hpi_runtime.config import EngineArgs
from hpi_runtime.engine_factory import create_engine
from hpi_runtime.profiling import compact_json, fit_itl, kv_bound_num_seqs, measure

PERFORMANCE_FIELDS = ("itlAlphaMs", "itlBetaMs", "prefillTokensPerSecond", "maxNumSeqs")


def test_the_itl_line_is_a_least_squares_fit_with_no_negative_term() -> None:
    assert fit_itl([(1, 12.0), (2, 14.0), (4, 18.0), (8, 26.0)]) == pytest.approx((10.0, 2.0))
    assert fit_itl([(4, 9.0)]) == (9.0, 0.0)  # one batch size: a flat line
    assert fit_itl([(1, 10.0), (8, 9.0)]) == (9.5, 0.0)  # noise that slopes down is no speed-up: a flat mean
    # A free intercept below zero (-2): the slope through the origin (1 x 1 + 2 x 4) / (1 + 4), not the free 3.
    assert fit_itl([(1, 1.0), (2, 4.0)]) == pytest.approx((0.0, 1.8))
    with pytest.raises(ValueError):
        fit_itl([])


def test_kv_bound_batch_counts_whole_blocks() -> None:
    assert kv_bound_num_seqs(num_kv_blocks=100, block_size=16, context_tokens=1024, max_num_seqs=64) == 1
    assert kv_bound_num_seqs(num_kv_blocks=1000, block_size=16, context_tokens=1000, max_num_seqs=64) == 15
    assert kv_bound_num_seqs(num_kv_blocks=10_000, block_size=16, context_tokens=100, max_num_seqs=64) == 64
    assert kv_bound_num_seqs(num_kv_blocks=3, block_size=16, context_tokens=1000, max_num_seqs=64) == 1


def test_compact_json_fits_the_termination_message_dropping_the_points_first() -> None:
    payload = {"itlAlphaMs": 1.5, "itlBetaMs": 0.25, "prefillTokensPerSecond": 900.0, "maxNumSeqs": 8,
               "decodePoints": [[b, 1.5 + 0.25 * b] for b in range(1, 400)], "prefillPoints": [[128, 900.0]]}
    assert json.loads(compact_json(payload, limit_bytes=100_000)) == payload
    short = compact_json(payload, limit_bytes=4096)
    assert len(short.encode()) <= 4096 and json.loads(short) == {k: payload[k] for k in list(payload)[:4]}
    with pytest.raises(ValueError, match="over the 40-byte limit"):
        compact_json(payload, limit_bytes=40)


def test_measure_times_each_batch_and_prompt_and_leaves_the_engine_idle(tiny_model_dir: Path) -> None:
    bundle = create_engine(EngineArgs.from_options(model=str(tiny_model_dir), dtype="float32", enforce_eager=True,
                                                   max_model_len=64, max_num_seqs=8))  # fmt: skip
    try:
        result = measure(bundle, context_tokens=48, batch_sizes=[1, 2, 4], prompt_lengths=[8, 32], steps=2)
        assert [b for b, _ in result.decode_points] == [1, 2, 4] and all(ms > 0 for _, ms in result.decode_points)
        assert [n for n, _ in result.prefill_points] == [8, 32]
        assert result.prefill_tokens_per_s == max(tps for _, tps in result.prefill_points) > 0
        assert result.itl_alpha_ms >= 0 and result.itl_beta_ms >= 0
        footprint = bundle.footprint
        assert result.max_num_seqs == kv_bound_num_seqs(footprint.num_kv_blocks, footprint.block_size, 48, 8)
        assert not bundle.engine.has_unfinished_requests()
        assert bundle.engine.get_stats().kv_cache_usage == 0  # every block the measurement took is back
        with pytest.raises(ValueError, match="max_num_seqs"):
            measure(bundle, context_tokens=48, batch_sizes=[16], prompt_lengths=[8])
        block_bytes = bundle.footprint.kv_cache_bytes // bundle.footprint.num_kv_blocks
    finally:
        bundle.engine.shutdown()
    # A KV cache of 8 blocks holds two sequences of 48 tokens (3 blocks each): batch 4 is not timed, and says so.
    bundle = create_engine(EngineArgs.from_options(model=str(tiny_model_dir), dtype="float32", enforce_eager=True,
                                                   max_model_len=64, max_num_seqs=8,
                                                   kv_cache_memory_bytes=8 * block_bytes))  # fmt: skip
    try:
        assert bundle.footprint.num_kv_blocks == 8
        result = measure(bundle, context_tokens=48, batch_sizes=[1, 2, 4], prompt_lengths=[8], steps=2)
        assert [b for b, _ in result.decode_points] == [1, 2] and result.decode_batches_skipped == (4,)
        assert result.max_num_seqs == 2 and result.as_json()["decodeBatchesSkipped"] == [4]
        assert bundle.engine.get_stats().kv_cache_usage == 0
        with pytest.raises(ValueError, match="max_model_len"):
            measure(bundle, context_tokens=48, batch_sizes=[1], prompt_lengths=[64])
    finally:
        bundle.engine.shutdown()


def test_hpi_profile_prints_what_the_operator_reads(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The CLI end to end; its first four fields parse as spec.placement.pools[].performance in the operator."""
    fleet_settings = pytest.importorskip("hpi_operator.fleet.settings", reason="the operator package is not installed")
    out = tmp_path / "profile.json"
    command = [sys.executable, "-m", "hpi_runtime.cli", "profile", "--model", str(tiny_model_dir), "--dtype", "float32",
               "--enforce-eager", "--max-model-len", "64", "--max-num-seqs", "4", "--batch-sizes", "1,2",
               "--prompt-lengths", "8", "--steps", "2", "--context-tokens", "32", "--compact",
               "--output", str(out)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed == json.loads(out.read_text())
    assert len(done.stdout.strip().splitlines()) == 1 and ", " not in done.stdout  # --compact: one line
    assert profile_from_json(printed).source == "measured"  # as the operator reads the profiling Job's message
    assert list(printed)[:4] == list(PERFORMANCE_FIELDS) and printed["device"] == "cpu"
    (pool,) = fleet_settings.parse_pools([{"name": "cpu", "costPerHour": 0.1,
                                          "performance": {k: printed[k] for k in PERFORMANCE_FIELDS}}])  # fmt: skip
    assert pool.performance.source == "override"
    assert pool.performance.itl_s(2) == pytest.approx((printed["itlAlphaMs"] + 2 * printed["itlBetaMs"]) / 1e3)
    bad = subprocess.run([*command[:-2], "--batch-sizes", "1,8"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "max_num_seqs" in bad.stderr
