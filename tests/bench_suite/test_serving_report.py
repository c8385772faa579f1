"""`make bench`'s serving ratios and report: transformers' baseline at its faster dtype, the median of rounds,
and the targets' verdicts, on hand-made results (the suite itself runs for minutes: `python -m bench --quick`)."""

from __future__ import annotations

import torch

from bench.report import render_markdown
from bench.serving import median_ratios, ratio_rows


def _closed(concurrency: int, tok_s: float, tpot_ms: float = 10.0) -> dict:
    latency = {"p50": 100.0, "p90": 150.0, "p99": 200.0}
    return {"concurrency": concurrency, "num_requests": 2 * concurrency, "requests_per_s": tok_s / 128,
            "output_tokens_per_s": tok_s, "total_tokens_per_s": 2 * tok_s, "ttft_ms": latency, "itl_ms": latency,
            "tpot_ms": {"p50": tpot_ms}, "e2e_ms": latency, "num_errors": 0}  # fmt: skip


def _static(batch_size: int, tok_s: float) -> dict:
    return {"batch_size": batch_size, "num_requests": batch_size, "requests_per_s": tok_s / 128,
            "output_tokens_per_s": tok_s, "ttft_ms": {"p50": 50.0}, "tpot_ms": {"p50": 1000 / tok_s},
            "e2e_ms": {"p50": 900.0}}  # fmt: skip


def _round(hpi_32: float, tf_bf16: dict[int, float], tf_fp32: dict[int, float], llama_32: float) -> dict:
    results = {
        "plan": {"prompt_len": 128, "output_len": 128, "num_threads": 2},
        "hpi": {"closed_loop": [_closed(1, 90.0), _closed(32, hpi_32)]},
        "llama.cpp": {"closed_loop": [_closed(1, 60.0, 15.0), _closed(32, llama_32)], "server": "llama-server F16"},
        "transformers": {"static_batches": [_static(b, t) for b, t in tf_bf16.items()], "dtype": "bfloat16"},
        "transformers-fp32": {"static_batches": [_static(b, t) for b, t in tf_fp32.items()], "dtype": "float32"},
    }
    results["ratios"] = ratio_rows(results)
    return results


def test_the_baseline_is_transformers_at_its_faster_dtype_per_concurrency():
    # bf16 is faster at batch 1, fp32 at batch 32: each N is judged against the faster one.
    rows = {r["concurrency"]: r for r in ratio_rows(_round(400.0, {1: 30.0, 32: 150.0}, {1: 20.0, 32: 200.0}, 100.0))}
    assert (rows[1]["tf_best_dtype"], rows[1]["tf_best_tok_s"]) == ("bfloat16", 30.0)
    assert rows[1]["hpi_over_tf_best"] == 90.0 / 30.0
    assert (rows[32]["tf_best_dtype"], rows[32]["tf_best_batch_size"]) == ("float32", 32)
    assert rows[32]["hpi_over_tf_best"] == 2.0
    assert rows[32]["hpi_over_tf"] == 400.0 / 150.0  # hpi's own dtype, kept beside it
    assert rows[32]["hpi_over_llama"] == 4.0


def test_rounds_give_median_ratios_and_keep_their_labels():
    rounds = [_round(hpi, {1: 30.0, 32: 150.0}, {1: 20.0, 32: 200.0}, 100.0) for hpi in (300.0, 500.0, 380.0)]
    merged = {r["concurrency"]: r for r in median_ratios(rounds)}
    assert merged[32]["rounds"] == 3
    assert merged[32]["hpi_tok_s"] == 380.0
    assert merged[32]["hpi_over_tf_best"] == 1.9
    assert (merged[32]["tf_best_dtype"], merged[32]["tf_best_batch_size"]) == ("float32", 32)


def test_the_report_judges_the_targets_on_the_median_against_the_best_dtype():
    rounds = [_round(hpi, {1: 30.0, 32: 150.0}, {1: 20.0, 32: 200.0}, 100.0) for hpi in (390.0, 420.0)]
    serving = {"plan": rounds[0]["plan"], "rounds": rounds, "ratios": median_ratios(rounds)}
    machine = {"date_utc": "2026-12-02 18:00 UTC", "git_commit": "abc1234", "cpu_model": "AMD EPYC", "num_cpus": 2,
               "cpu_flags": ["avx2", "fma", "avx512f", "avx512_bf16"], "memory_gib": 23.5, "torch_threads": 2,
               "python": "3.11", "torch": "2.13.0", "transformers": "5", "llama_cpp_python": None,
               "load_average_at_start": [0.1, 0.2, 0.3]}  # fmt: skip
    text = render_markdown({"machine": machine, "serving": serving})
    # Median hpi 405 tok/s at N=32 against transformers fp32's 200: 2.02x, met; against llama.cpp's 100: 4.05x.
    assert "405 vs 200 (float32, batch 32) at N=32: 2.02x | yes |" in text
    assert ">= 3x llama.cpp (llama-server F16) | 405 vs 100: 4.05x | yes |" in text
    assert "avx512_bf16" in text
    # Both rounds' rows, both transformers dtypes.
    assert "| 2 | hpi | 32 |" in text and "| 1 | hpi | 32 |" in text
    assert "transformers float32 (static batch)" in text and "transformers bfloat16 (static batch)" in text
    # One stream: hpi 1000 / 10 ms against llama.cpp's 1000 / 15 ms.
    assert "hpi 100.0 tok/s, llama.cpp 66.7 tok/s (hpi/llama.cpp 1.50x)" in text


def test_rounds_alternate_the_order_of_the_systems(monkeypatch, tmp_path):
    """Round 2 runs the systems in reverse (stand-ins for them record the order), and the ratios are the median."""
    import transformers

    from bench import serving

    calls: list[str] = []
    speeds = iter([400.0, 100.0, 200.0, 200.0, 100.0, 300.0])

    def system(name: str, key: str, make):
        def run(*args, **kwargs):
            calls.append(name)
            return {key: [make(next(speeds))], **({"dtype": "bfloat16"} if key == "static_batches" else {})}
        return run

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: None)
    monkeypatch.setattr(serving, "run_hpi", system("hpi", "closed_loop", lambda v: _closed(32, v)))
    monkeypatch.setattr(serving, "run_llamacpp", system("llama.cpp", "closed_loop", lambda v: _closed(32, v)))
    monkeypatch.setattr(serving, "run_transformers", system("transformers", "static_batches", lambda v: _static(32, v)))
    results = serving.run_rounds(serving.ServingPlan(), tmp_path, torch.bfloat16, tmp_path, lambda m: None,
                                 ("hpi", "llama.cpp", "transformers"), rounds=2)  # fmt: skip
    assert calls == ["hpi", "llama.cpp", "transformers", "transformers", "llama.cpp", "hpi"]
    assert [r["order"] for r in results["rounds"]] == [["hpi", "llama.cpp", "transformers"],
                                                       ["transformers", "llama.cpp", "hpi"]]  # fmt: skip
    [row] = results["ratios"]
    assert row["hpi_over_llama"] == (4.0 + 3.0) / 2 and row["hpi_over_tf_best"] == (2.0 + 1.5) / 2
