"""Pipeline parallelism across two hosts: `hpi serve -pp 2 --nnodes 2`, the leader here and the worker host in a
network namespace behind a veth pair, each pinned to its own core (`taskset`), against one `hpi serve` process on
one core, run one after the other on the same machine with the same requests.

Reports output tokens per second at each client count (and the ratio to the one-process run), the bytes that
crossed the veth link per generated token (both directions, all traffic: hidden states, steps, samples, the
store), and each stage's busy fraction (time not waiting for a step or for the previous stage's hidden states),
read from the ranks' `stats/<m>` keys in the leader's store before and after each load. Needs root and iproute2.

    PYTHONPATH=tests:... .venv/bin/python -m bench.bench_multi_node               # embedded model, fp32, eager
Writes bench/results/multi_node.json and .md (--out to change).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

from bench.loadgen import LengthDist, LoadConfig, WorkloadSpec, build_requests, run_load, summarize
from bench.report import machine_description
from bench.systems import REPO_ROOT, SERVED_MODEL_NAME, free_port
from hpi_contracts.pipeline_split import PP_LAYER_PARTITION_ENV
from hpi_testing.netns import TwoHosts, namespaces_unavailable, two_hosts


def _start(argv: list[str], log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(argv, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip


def _wait_ready(url: str, process: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout_s} s")


def _stop(*processes: subprocess.Popen) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def _link_bytes(interface: str) -> int:
    stats = Path(f"/sys/class/net/{interface}/statistics")
    return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())


def _cpu_s(process: subprocess.Popen) -> float:
    """CPU seconds the process and its descendants have used (the host's ranks, engine and API server)."""
    import psutil

    total = 0.0
    root = psutil.Process(process.pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            times = p.cpu_times()
            total += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    return total


def _stage_stats(store, num_ranks: int) -> dict[int, dict]:
    return {m: json.loads(store.get(f"stats/{m}")) for m in range(num_ranks) if store.check([f"stats/{m}"])}


def _load(base_url: str, tokenizer, concurrency: int, args: argparse.Namespace) -> dict:
    spec = WorkloadSpec(max(2 * concurrency, 4), LengthDist(args.prompt_len), LengthDist(args.output_len),
                        seed=concurrency)  # fmt: skip
    run = asyncio.run(run_load(build_requests(tokenizer, spec),
                               LoadConfig(base_url, SERVED_MODEL_NAME, concurrency=concurrency)))  # fmt: skip
    return {k: v for k, v in summarize(run).items() if k != "samples"}


def _serve_args(args: argparse.Namespace, port: int) -> list[str]:
    return [sys.executable, "-m", "hpi_runtime.cli", "serve", "--port", str(port), "--log-level", "warning",
            "--served-model-name", SERVED_MODEL_NAME, "--dtype", args.dtype, "--enforce-eager",
            "--kv-cache-memory", args.kv_cache_memory, "--max-num-seqs", str(max(args.concurrency)),
            "--max-model-len", "1024", *(["--model", args.model] if args.model else [])]  # fmt: skip


def measure_single(args: argparse.Namespace, tokenizer, log_dir: Path) -> list[dict]:
    port = free_port()
    process = _start(["taskset", "-c", args.cores[0], *_serve_args(args, port)], log_dir / "single.log")
    try:
        _wait_ready(f"http://127.0.0.1:{port}/ready", process)
        _load(f"http://127.0.0.1:{port}", tokenizer, 2, argparse.Namespace(**{**vars(args), "output_len": 4}))
        runs = []
        for concurrency in args.concurrency:
            summary = {"setup": "one process, one core", **_load(f"http://127.0.0.1:{port}", tokenizer, concurrency,
                                                                   args)}  # fmt: skip
            print(f"single N={concurrency}: {summary['output_tokens_per_s']:.1f} tok/s", flush=True)
            runs.append(summary)
        return runs
    finally:
        _stop(process)


def measure_pipeline(
    args: argparse.Namespace, tokenizer, log_dir: Path, hosts: TwoHosts, partition: str | None
) -> list[dict]:
    """One group at each client count; `partition`: $VLLM_PP_LAYER_PARTITION on both hosts (None: the default)."""
    import torch.distributed as dist

    if partition is None:
        os.environ.pop(PP_LAYER_PARTITION_ENV, None)
    else:
        os.environ[PP_LAYER_PARTITION_ENV] = partition
    port, master_port, tag = free_port(), free_port(), (partition or "default").replace(",", "-")
    group = ["-pp", "2", "--nnodes", "2", "--master-addr", hosts.here_addr, "--master-port", str(master_port)]
    worker = _start([*hosts.prefix, "taskset", "-c", args.cores[1], *_serve_args(args, free_port()), *group,
                     "--node-rank", "1", "--host", hosts.there_addr], log_dir / f"pp-worker-{tag}.log")  # fmt: skip
    leader = _start(["taskset", "-c", args.cores[0], *_serve_args(args, port), *group, "--node-rank", "0"],
                    log_dir / f"pp-leader-{tag}.log")  # fmt: skip
    interface = subprocess.run(["ip", "-o", "-4", "addr", "show", "to", hosts.here_addr], capture_output=True,
                               text=True, check=True).stdout.split()[1]  # fmt: skip
    try:
        _wait_ready(f"http://127.0.0.1:{port}/ready", leader)
        store = dist.TCPStore(hosts.here_addr, master_port, None, False, timeout=timedelta(seconds=30))
        base = f"http://127.0.0.1:{port}"
        _load(base, tokenizer, 2, argparse.Namespace(**{**vars(args), "output_len": 4}))
        runs = []
        for concurrency in args.concurrency:
            time.sleep(1.5)  # the ranks publish their stats every second: take a fresh "before"
            before, link_before = _stage_stats(store, 2), _link_bytes(interface)
            cpu_before = _cpu_s(leader), _cpu_s(worker)
            summary = _load(base, tokenizer, concurrency, args)
            cpu_after = _cpu_s(leader), _cpu_s(worker)
            time.sleep(1.5)
            after, link_after = _stage_stats(store, 2), _link_bytes(interface)
            num_tokens = max(summary["mean_output_tokens"] * (summary["num_requests"] - summary["num_errors"]), 1)
            busy = {m: (after[m]["busy_s"] - before[m]["busy_s"]) / max(summary["duration_s"], 1e-9) for m in after}
            # The share of its core each host's processes used: the leader's core also runs the API server and
            # the scheduler, so stage 0 can be busy only for what they leave.
            host_cpu = [round((after_s - before_s) / max(summary["duration_s"], 1e-9), 3)
                        for after_s, before_s in zip(cpu_after, cpu_before, strict=True)]  # fmt: skip
            summary = {"setup": "2 stages, 2 hosts, a core each", "layer_partition": partition or "default",
                       **summary, "host_cpu_fraction": host_cpu,
                       "link_bytes_per_token": (link_after - link_before) / num_tokens,
                       "hidden_bytes_per_token": (after[0]["bytes_sent"] - before[0]["bytes_sent"]) / num_tokens,
                       "stage_busy_fraction": {str(m): round(f, 3) for m, f in sorted(busy.items())}}  # fmt: skip
            print(f"pipeline {partition or 'default'} N={concurrency}: {summary['output_tokens_per_s']:.1f} tok/s, "
                  f"host cpu {host_cpu}, "
                  f"{summary['link_bytes_per_token']:.0f} link bytes/token, busy {summary['stage_busy_fraction']}",
                  flush=True)  # fmt: skip
            runs.append(summary)
        return runs
    finally:
        _stop(leader, worker)


def markdown(results: dict) -> str:
    machine = ", ".join(f"{key}: {value}" for key, value in results["machine"].items())
    single = {r["concurrency"]: r for r in results["single"]}
    split = " + ".join(map(str, results["layer_partition"]))
    lines = [f"# Pipeline parallelism across two hosts ({results['dtype']}, eager)", "", machine, "",
             f"Default layers per stage: {split} (stage 1 also runs the LM head and the sampler).", "",
             "| setup | layers per stage | clients | output tok/s | vs one process | link bytes / token | "
             "hidden bytes / token | stage 0 busy | stage 1 busy | leader host CPU | worker host CPU | errors |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in results["single"]:
        lines.append(f"| {r['setup']} | | {r['concurrency']} | {r['output_tokens_per_s']:.1f} | 1.00x | | | | | | | "
                     f"{r['num_errors']} |")  # fmt: skip
    for r in results["pipeline"]:
        ratio = r["output_tokens_per_s"] / single[r["concurrency"]]["output_tokens_per_s"]
        busy, cpu = r["stage_busy_fraction"], r["host_cpu_fraction"]
        split = results["layer_partition"] if r["layer_partition"] == "default" else r["layer_partition"].split(",")
        lines.append(f"| {r['setup']} | {' + '.join(map(str, split))} | {r['concurrency']} | "
                     f"{r['output_tokens_per_s']:.1f} | {ratio:.2f}x | "
                     f"{r['link_bytes_per_token']:.0f} | {r['hidden_bytes_per_token']:.0f} | "
                     f"{busy.get('0', 0):.0%} | {busy.get('1', 0):.0%} | {cpu[0]:.0%} | {cpu[1]:.0%} | "
                     f"{r['num_errors']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    from transformers import AutoTokenizer

    from hpi_runtime.model_source import resolve_model_dir
    from hpi_runtime.models.config import load_model_config
    from hpi_runtime.models.parallel import pipeline_partition

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory; default: the embedded model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--cores", nargs=2, default=["0", "1"], help="the leader's and the worker's core")
    parser.add_argument("--kv-cache-memory", default="256MiB", help="per rank")
    parser.add_argument("--layer-partitions", nargs="+", default=["default"],
                        help="the pipeline's splits to measure, one group each: 'default' (the runtime's) or a "
                        f"${PP_LAYER_PARTITION_ENV} value such as 15,15")  # fmt: skip
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "bench" / "results")
    args = parser.parse_args()
    reason = namespaces_unavailable()
    if reason is not None:
        sys.exit(f"bench_multi_node: {reason}")
    machine = machine_description()  # before the runs: its load average is the other users', not ours
    model_dir = resolve_model_dir(args.model)[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    partition = pipeline_partition(load_model_config(model_dir), 2, {})
    log_dir = args.out / "logs"
    single = measure_single(args, tokenizer, log_dir)
    pipeline = []
    with two_hosts() as hosts:
        for value in args.layer_partitions:
            pipeline += measure_pipeline(args, tokenizer, log_dir, hosts, None if value == "default" else value)
    results = {"machine": {**machine, "load_average_at_end": list(os.getloadavg())}, "dtype": args.dtype,
               "prompt_len": args.prompt_len, "output_len": args.output_len, "layer_partition": list(partition),
               "single": single, "pipeline": pipeline}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "multi_node.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "multi_node.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
