"""Write a benchmark run as `latest.json`, `latest.md` and PNG plots; re-render from a saved JSON.

    .venv/bin/python -m bench.report bench/results/latest.json     # rewrite latest.md and the plots
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

SYSTEM_STYLE = {"hpi": ("tab:blue", "o"), "llama.cpp": ("tab:orange", "s"), "transformers": ("tab:green", "^")}
# Variables that lower the instruction set a run uses (torch's and hpi_kernels' dispatch, MKL's, oneDNN's).
ISA_LIMIT_VARS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "HPI_CPU_AVX_VNNI",
                  "HPI_CPU_AVX512_VBMI", "HPI_CPU_AVX512_BF16")


def machine_description(llama_python: Path | None = None) -> dict:
    import torch
    import transformers

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")),
                 platform.processor())
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    mem_kib = next((int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemTotal")), 0)
    llama_version = None
    if llama_python and llama_python.exists():
        out = subprocess.run([str(llama_python), "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                             capture_output=True, text=True, check=False)
        llama_version = out.stdout.strip() or None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False)
    return {
        "cpu_model": model,
        "num_cpus": os.cpu_count(),
        # The flags that choose a kernel path here (bf16 / int8 tiles, W4A8, AMX).
        "cpu_flags": [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512vbmi", "avx512_bf16", "avx512_fp16",
                                  "amx_tile", "amx_bf16", "amx_int8") if f in flags],  # fmt: skip
        "memory_gib": round(mem_kib / 2**20, 1),
        # An instruction set lowered for this run (torch's and hpi_kernels' dispatch, MKL's, oneDNN's): the code
        # paths of a smaller CPU measured on this one.
        "isa_limits": {k: os.environ[k] for k in ISA_LIMIT_VARS if k in os.environ},
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": list(os.getloadavg()),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llama_cpp_python": llama_version,
        "git_commit": commit.stdout.strip() or None,
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def ms_per_call(call, calls: int) -> float:
    """Milliseconds per call of `call`, over `calls` calls back to back (microbenchmarks time a few in turn)."""
    start = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - start) / calls * 1e3


def _ms(value) -> str:
    return "-" if value is None else (f"{value:.0f}" if value >= 10 else f"{value:.1f}")


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def serving_rounds(serving: dict) -> list[dict]:
    """The rounds of a serving section (one round's results when it ran once)."""
    return serving.get("rounds", [serving]) if serving else []


def _tf_label(tf: dict) -> str:
    return f"transformers {tf.get('dtype', '')} (static batch)".replace("  ", " ")


def _serving_rows(serving: dict) -> list[str]:
    lines = ["| round | system | N | requests | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) "
             "| ITL p50 / p90 / p99 (ms) | TPOT p50 (ms) | e2e p50 / p99 (ms) | errors |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for index, results in enumerate(serving_rounds(serving), start=1):
        for system in ("hpi", "llama.cpp"):
            for run in (results.get(system) or {}).get("closed_loop", []):
                t, i, e = run["ttft_ms"], run["itl_ms"], run["e2e_ms"]
                lines.append(
                    f"| {index} | {system} | {run['concurrency']} | {run['num_requests']} "
                    f"| {run['requests_per_s']:.2f} | {run['output_tokens_per_s']:.1f} "
                    f"| {_ms(t['p50'])} / {_ms(t['p90'])} / {_ms(t['p99'])} "
                    f"| {_ms(i['p50'])} / {_ms(i['p90'])} / {_ms(i['p99'])} | {_ms(run['tpot_ms']['p50'])} "
                    f"| {_ms(e['p50'])} / {_ms(e['p99'])} | {run['num_errors']} |")
        for key in ("transformers", "transformers-fp32"):
            tf = results.get(key) or {}
            for run in tf.get("static_batches", []):
                lines.append(
                    f"| {index} | {_tf_label(tf)} | {run['batch_size']} | {run['num_requests']} "
                    f"| {run['requests_per_s']:.2f} | {run['output_tokens_per_s']:.1f} "
                    f"| {_ms(run['ttft_ms']['p50'])} (batch) | - | {_ms(run['tpot_ms']['p50'])} "
                    f"| {_ms(run['e2e_ms']['p50'])} | 0 |")
    return lines


def _llama_name(serving: dict) -> str:
    server = next((r["llama.cpp"].get("server") for r in serving_rounds(serving) if r.get("llama.cpp")), None)
    return server or "llama-cpp-python's server"


def _targets(results: dict) -> list[str]:
    serving, rows = results.get("serving") or {}, (results.get("serving") or {}).get("ratios", [])
    lines = ["| target | measured | met |", "|---|---|:-:|"]
    high = [r for r in rows if r["concurrency"] >= 32]
    if high:
        best = max(high, key=lambda r: r["hpi_tok_s"])
        if best.get("hpi_over_tf_best") is not None:
            lines.append(f"| output tok/s at N>=32 >= 2x transformers' best static batch <= N, at its faster dtype | "
                         f"{best['hpi_tok_s']:.0f} vs {best['tf_best_tok_s']:.0f} ({best['tf_best_dtype']}, batch "
                         f"{best['tf_best_batch_size']}) at N={best['concurrency']}: {_x(best['hpi_over_tf_best'])} "
                         f"| {'yes' if best['hpi_over_tf_best'] >= 2 else 'no'} |")
        if best["hpi_over_llama"] is not None:
            lines.append(f"| output tok/s at N>=32 >= 3x llama.cpp ({_llama_name(serving)}) | {best['hpi_tok_s']:.0f}"
                         f" vs {best['llama_tok_s']:.0f}: {_x(best['hpi_over_llama'])} "
                         f"| {'yes' if best['hpi_over_llama'] >= 3 else 'no'} |")
    roofline = results.get("roofline")
    if roofline and roofline.get("hpi_fraction_of_peak") is not None:
        lines.append(f"| achieved FLOP/s as a fraction of this machine's measured {roofline['hpi_dtype']} matmul peak "
                     f"| {roofline['hpi_achieved_gflops']:.1f} / {roofline['peak_gflops']:.1f} GFLOP/s = "
                     f"{100 * roofline['hpi_fraction_of_peak']:.0f}% | (reported) |")
    single = _single_request(serving)
    if single:
        lines.append(f"| single-request decode beside llama.cpp | {single} | (reported) |")
    prefix = results.get("prefix_cache")
    if prefix:
        lines.append(f"| prefix caching cuts TTFT >= 2x (shared system prompt) "
                     f"| p50 {_ms(prefix['off']['ttft_ms']['p50'])} -> {_ms(prefix['on']['ttft_ms']['p50'])} ms: "
                     f"{_x(prefix['ttft_p50_speedup'])} "
                     f"| {'yes' if prefix['ttft_p50_speedup'] >= 2 else 'no'} |")
    return lines


def _single_request(serving: dict) -> str | None:
    """One stream's decode speed (1000 / TPOT p50 at N=1), the median over the rounds, per system."""
    def tok_s(results: dict, system: str) -> float | None:
        if system == "transformers":
            run = next((r for r in (results.get(system) or {}).get("static_batches", []) if r["batch_size"] == 1),
                       None)  # fmt: skip
        else:
            run = next((r for r in (results.get(system) or {}).get("closed_loop", []) if r["concurrency"] == 1), None)
        return run and 1000 / run["tpot_ms"]["p50"]

    def median(system: str) -> float | None:
        values = sorted(v for v in (tok_s(r, system) for r in serving_rounds(serving)) if v)
        return values[len(values) // 2] if values else None

    hpi, llama, tf = median("hpi"), median("llama.cpp"), median("transformers")
    if hpi is None:
        return None
    parts = [f"hpi {hpi:.1f} tok/s"]
    if llama:
        parts.append(f"llama.cpp {llama:.1f} tok/s (hpi/llama.cpp {hpi / llama:.2f}x)")
    if tf:
        parts.append(f"transformers {tf:.1f} tok/s")
    return ", ".join(parts) + " (1000 / TPOT p50, median of the rounds)"


def render_markdown(results: dict) -> str:
    m, serving = results["machine"], results.get("serving") or {}
    plan = serving.get("plan", {})
    lines = [
        "# Benchmark results",
        "",
        f"Generated by `make bench` on {m['date_utc']} at commit `{m['git_commit']}`. "
        "How to run and what each number means: [bench/README.md](../README.md).",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
        f"| CPU | {m['cpu_model']}, {m['num_cpus']} cores, flags: {', '.join(m['cpu_flags'])} |",
        f"| memory | {m['memory_gib']} GiB |",
        f"| threads | torch {m['torch_threads']}; llama.cpp {plan.get('num_threads', '-')} |",
        f"| software | Python {m['python']}, torch {m['torch']}, transformers {m['transformers']}, "
        f"llama.cpp: {_llama_name(serving)}"
        f"{'' if not m['llama_cpp_python'] else ' (llama-cpp-python ' + m['llama_cpp_python'] + ' tree)'} |",
        f"| load average at start | {', '.join(f'{x:.2f}' for x in m['load_average_at_start'])} |",
        "",
        "## Targets",
        "",
        *_targets(results),
    ]
    if serving:
        rounds = serving_rounds(serving)
        tf_dtypes = " and ".join(r[k]["dtype"] for k in ("transformers", "transformers-fp32") for r in rounds[:1]
                                 if r.get(k))  # fmt: skip
        lines += [
            "",
            f"## Serving: closed loop, {plan['prompt_len']}-token prompts, {plan['output_len']}-token outputs",
            "",
            f"{len(rounds)} round(s), the systems in alternating order (round 2 runs them in reverse). "
            f"N = concurrent clients (transformers: static batch size; offline, dtype {tf_dtypes or '-'}). "
            "TTFT = time to first token, ITL = gap between streamed tokens, TPOT = (e2e - TTFT) / (tokens - 1).",
            "",
            *_serving_rows(serving),
            "",
            "### Ratios (output tokens/s, median of the rounds)",
            "",
            "transformers' baseline is its best static batch <= N at its faster dtype on this machine (both shown).",
            "",
            "| N | hpi | transformers best (dtype, batch) | transformers in hpi's dtype | transformers fp32 "
            "| llama.cpp | hpi offline (LLM.generate) | hpi / transformers best | hpi / llama.cpp | served / offline |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in serving.get("ratios", []):
            best = "-" if r.get("tf_best_tok_s") is None else (
                f"{r['tf_best_tok_s']:.1f} ({r['tf_best_dtype']}, {r['tf_best_batch_size']})")
            tf = "-" if r["tf_tok_s"] is None else f"{r['tf_tok_s']:.1f}"
            tf32 = "-" if r.get("tf_fp32_tok_s") is None else f"{r['tf_fp32_tok_s']:.1f}"
            llama = "-" if r["llama_tok_s"] is None else f"{r['llama_tok_s']:.1f} (N={r['llama_concurrency']})"
            offline = "-" if r.get("offline_tok_s") is None else f"{r['offline_tok_s']:.1f}"
            lines.append(f"| {r['concurrency']} | {r['hpi_tok_s']:.1f} | {best} | {tf} | {tf32} | {llama} | {offline} "
                         f"| {_x(r.get('hpi_over_tf_best'))} | {_x(r['hpi_over_llama'])} "
                         f"| {_x(r.get('hpi_over_offline'))} |")
        open_loop = (rounds[0].get("hpi") or {}).get("open_loop")
        if open_loop:
            t, e = open_loop["ttft_ms"], open_loop["e2e_ms"]
            lines += ["", "### Open loop (hpi, Poisson arrivals)", "",
                      "| rate (req/s) | requests | achieved req/s | output tok/s | TTFT p50 / p90 / p99 (ms) "
                      "| TPOT p50 (ms) | e2e p50 / p99 (ms) | errors |", "|---:|---:|---:|---:|---:|---:|---:|---:|",
                      f"| {open_loop['rate_rps']:.2f} | {open_loop['num_requests']} "
                      f"| {open_loop['requests_per_s']:.2f} "
                      f"| {open_loop['output_tokens_per_s']:.1f} | {_ms(t['p50'])} / {_ms(t['p90'])} / {_ms(t['p99'])} "
                      f"| {_ms(open_loop['tpot_ms']['p50'])} | {_ms(e['p50'])} / {_ms(e['p99'])} "
                      f"| {open_loop['num_errors']} |"]
        lines += ["", "Plots: the first round.", "", "![throughput](throughput.png)", "",
                  "![latency CDFs](latency_cdf.png)"]
    roofline = results.get("roofline")
    if roofline:
        lines += ["", "## Roofline", "",
                  f"Model: {roofline['linear_flops_per_token'] / 1e9:.3f} GFLOP per token in its linears and LM "
                  f"head (+{roofline['attention_flops_per_token_per_context_token']} FLOP per token of context in "
                  "attention, left out). Peak = best torch matmul on the model's GEMM shapes, M = 64..256, this run.",
                  "", "| dtype | matmul peak (GFLOP/s) | token bound at that peak (tokens/s) |", "|---|---:|---:|"]
        for dtype, peak in roofline["peaks"].items():
            lines.append(f"| {dtype} | {peak['peak_gflops']:.1f} "
                         f"| {peak['peak_gflops'] * 1e9 / roofline['linear_flops_per_token']:.0f} |")
        if roofline.get("hpi_achieved_gflops") is not None:
            lines += ["", f"hpi at N={roofline['hpi_concurrency']} ({roofline['hpi_dtype']}): "
                      f"{roofline['hpi_total_tokens_per_s']:.0f} tokens/s (prompt + output) = "
                      f"{roofline['hpi_achieved_gflops']:.1f} GFLOP/s = {100 * roofline['hpi_fraction_of_peak']:.0f}% "
                      "of the measured peak."]
    prefix = results.get("prefix_cache")
    if prefix:
        p = prefix["plan"]
        lines += ["", "## Prefix cache (hpi, shared system prompt)", "",
                  f"{p['num_requests']} requests, closed loop N={p['concurrency']}: a {p['shared_len']}-token system "
                  f"prompt shared by all + {p['unique_len']} unique tokens, {p['output_len']} output tokens.", "",
                  "| prefix caching | TTFT p50 / p90 (ms) | e2e p50 (ms) | output tok/s | req/s | cache hit rate |",
                  "|---|---:|---:|---:|---:|---:|"]
        for key in ("on", "off"):
            r = prefix[key]
            lines.append(f"| {key} | {_ms(r['ttft_ms']['p50'])} / {_ms(r['ttft_ms']['p90'])} "
                         f"| {_ms(r['e2e_ms']['p50'])} "
                         f"| {r['output_tokens_per_s']:.1f} | {r['requests_per_s']:.2f} "
                         f"| {100 * r['prefix_cache_hit_rate']:.0f}% |")
        lines += ["", f"TTFT p50 {_x(prefix['ttft_p50_speedup'])} lower with caching (p90 "
                  f"{_x(prefix['ttft_p90_speedup'])}); throughput {_x(prefix['throughput_speedup'])}."]
    engine = results.get("engine_core")
    if engine:
        lines += ["", "## Engine core (bench/bench_engine_core.py: fake executor, no model)", "",
                  "| running requests | us/step (token ids only) | us/request | us/step (+ detokenize) | us/request |",
                  "|---:|---:|---:|---:|---:|"]
        for row in engine["step_cost"]:
            n = row["num_running"]
            lines.append(f"| {n} | {row['us_per_step']:.0f} | {row['us_per_step'] / n:.1f} "
                         f"| {row['us_per_step_detok']:.0f} | {row['us_per_step_detok'] / n:.1f} |")
        kv = engine["kv"]
        lines += ["", "| KV memory (mixed workload: prompt 16-1023, output 16-511 tokens) | |", "|---|---:|",
                  f"| KV budget | {kv['budget_tokens']} tokens |",
                  f"| waste, mean over steps (allocated but unfilled slots) | {100 * kv['waste']:.2f}% |",
                  f"| concurrent requests, paged | {kv['paged_running']:.1f} |",
                  f"| concurrent requests, contiguous max_model_len={kv['max_model_len']} "
                  f"| {kv['contiguous_running']} |",
                  f"| capacity ratio | {kv['paged_running'] / kv['contiguous_running']:.1f}x |",
                  f"| preemptions | {kv['preemptions']} |"]
    for section in ("skipped",):
        for name, reason in (results.get(section) or {}).items():
            lines += ["", f"_{name} skipped: {reason}_"]
    return "\n".join(lines) + "\n"


def _cdf(ax, values, label, color) -> None:
    ordered = sorted(values)
    if ordered:
        ax.step([ordered[0], *ordered], [0.0, *((i + 1) / len(ordered) for i in range(len(ordered)))], where="post",
                label=label, color=color)


def render_plots(results: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    serving = results.get("serving") or {}
    plan = serving.get("plan")
    serving = serving_rounds(serving)[0] if serving else {}
    if "hpi" not in serving:
        return []
    paths = []
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=90)
    for system in ("hpi", "llama.cpp"):
        runs = (serving.get(system) or {}).get("closed_loop", [])
        if runs:
            color, marker = SYSTEM_STYLE[system]
            ax.plot([r["concurrency"] for r in runs], [r["output_tokens_per_s"] for r in runs], marker=marker,
                    color=color, label=f"{system} (server, closed loop)")
    tf_runs = []
    for key, linestyle in (("transformers", "--"), ("transformers-fp32", "-.")):
        tf = serving.get(key) or {}
        runs = [{**r, "dtype": tf.get("dtype")} for r in tf.get("static_batches", [])]
        if runs:
            color, marker = SYSTEM_STYLE["transformers"]
            ax.plot([r["batch_size"] for r in runs], [r["output_tokens_per_s"] for r in runs], marker=marker,
                    color=color, linestyle=linestyle, label=f"transformers generate {tf.get('dtype')} (offline, static"
                    " batch)")  # fmt: skip
        tf_runs += runs
    roofline = results.get("roofline")
    if roofline and roofline.get("hpi_dtype") in roofline["peaks"]:
        peak = roofline["peaks"][roofline["hpi_dtype"]]["peak_gflops"] * 1e9
        output_share = plan["output_len"] / (plan["prompt_len"] + plan["output_len"])
        bound = peak / roofline["linear_flops_per_token"] * output_share
        ax.axhline(bound, color="grey", linestyle=":", label=f"compute bound at measured {roofline['hpi_dtype']} peak")
    ax.set_xscale("log", base=2)
    ticks = sorted({r["concurrency"] for r in serving["hpi"]["closed_loop"]} | {r["batch_size"] for r in tf_runs})
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("concurrent requests (transformers: batch size)")
    ax.set_ylabel("output tokens/s")
    cores = results["machine"]["num_cpus"]
    ax.set_title(f"Throughput, {plan['prompt_len']}+{plan['output_len']} tokens, {cores} CPU cores", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths.append(out_dir / "throughput.png")
    fig.savefig(paths[-1])
    plt.close(fig)

    target_n = max((r["concurrency"] for r in serving["hpi"]["closed_loop"] if r["concurrency"] <= 32), default=None)
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2), dpi=80)
    for system in ("hpi", "llama.cpp", "transformers"):
        if system == "transformers":
            run = best_tf = None
            fitting = [r for r in tf_runs if target_n and r["batch_size"] <= target_n]
            best_tf = max(fitting, key=lambda r: r["output_tokens_per_s"], default=None)
            run = best_tf
            label = f"transformers {best_tf['dtype']} (batch {best_tf['batch_size']})" if best_tf else ""
        else:
            runs = (serving.get(system) or {}).get("closed_loop", [])
            run = max((r for r in runs if r["concurrency"] <= (target_n or 0)), key=lambda r: r["concurrency"],
                      default=None)
            label = f"{system} (N={run['concurrency']})" if run else ""
        if not run:
            continue
        color = SYSTEM_STYLE[system][0]
        for ax, key, scale in zip(axes, ("ttft_s", "tpot_s", "e2e_s"), (1000, 1000, 1), strict=True):
            _cdf(ax, [v * scale for v in run["samples"][key]], label, color)
    for ax, title in zip(axes, ("TTFT (ms)", "time per output token (ms)", "end-to-end latency (s)"), strict=True):
        ax.set_xscale("log")
        lo, hi = ax.get_xlim()
        ax.xaxis.set_major_locator(LogLocator(subs=(1,) if hi / lo > 100 else (1, 2, 5)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_title(title, fontsize=9)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests")
    axes[0].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Latency CDFs at {target_n} concurrent requests", fontsize=10)
    fig.tight_layout()
    paths.append(out_dir / "latency_cdf.png")
    fig.savefig(paths[-1])
    plt.close(fig)
    return paths


def write_report(results: dict, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "latest.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "latest.md").write_text(render_markdown(results))
    return [out_dir / "latest.json", out_dir / "latest.md", *render_plots(results, out_dir)]


if __name__ == "__main__":
    source = Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results/latest.json")
    data = json.loads(source.read_text())
    for path in write_report(data, source.parent):
        print(path)
