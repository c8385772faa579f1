"""Calibrate the fleet simulator against a real run: two local `hpi serve` backends behind `hpi-router`.

Issue "fleet optimizer" asks that the simulation of two local CPU backends, given their measured profiles,
predict a real run's throughput and p50/p90 TTFT and ITL within 15% on the same workload. Here:
1. profile: `hpi profile` on the embedded model, pinned to one core (`taskset`), one thread, as each backend runs
   (what the operator's profiling Job measures); and the same figures measured through HTTP on one pinned
   `hpi serve`, which includes the server's own per-token work;
2. real run: two `hpi serve` backends, each pinned to its own core, behind `hpi-router` (its default policy), an
   open-loop Poisson workload from bench/loadgen.py; every request's arrival, prompt and output tokens, TTFT, ITL
   and end-to-end time are kept;
3. simulation: the same requests (arrival times, token counts) replayed by bench.fleet_sim against two replicas
   with the measured profile and the real router policy; the same summary; the ratios side by side.
The router and the load generator share the two cores with the backends (there is no third core): that load is
part of what the simulator must predict, and the profile is measured without it, so this is a strict test.

    .venv/bin/python -m bench.fleet_calibration              # ~6 min on 2 cores -> bench/results/fleet_calibration.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.bench_router import router_command, wait_all_ready
from bench.fleet_sim.replay import backend, replay
from bench.fleet_sim.workloads import Request
from bench.loadgen import LengthDist, LoadConfig, WorkloadSpec, build_requests, run_load, summarize
from bench.systems import SERVED_MODEL_NAME, ServerCommand, ServerProcess, hpi_command, metric_value
from hpi_runtime.profiling import fit_itl

RESULTS = Path(__file__).resolve().parent / "results"
TOLERANCE = 0.15  # the bar: within 15% of the real run


@dataclass(frozen=True)
class Plan:
    num_requests: int = 160
    prompt_tokens: LengthDist = LengthDist(192, "uniform", 0.5)
    output_tokens: LengthDist = LengthDist(64, "uniform", 0.5)
    load: float = 0.6  # the open-loop rate as a fraction of the two replicas' capacity by the profile
    seed: int = 0
    cores: tuple[int, int] = (0, 1)
    max_num_seqs: int = 16


QUICK = Plan(num_requests=24, load=0.4)


def pinned(command: ServerCommand, core: int) -> ServerCommand:
    """The same server, pinned to one core with one thread (its engine-core child inherits the affinity)."""
    env = {**dict(command.env), "OMP_NUM_THREADS": "1"}
    return ServerCommand(command.name, ("taskset", "-c", str(core), *command.argv), command.ready_path,
                         command.port, tuple(env.items()))  # fmt: skip


def measure_profile(plan: Plan, core: int) -> dict:
    """`hpi profile` on one core, the way each backend serves (same max_num_seqs)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        argv = ["taskset", "-c", str(core), sys.executable, "-m", "hpi_runtime.cli", "profile",
                "--max-num-seqs", str(plan.max_num_seqs), "--batch-sizes", "1,2,4,8,16",
                "--prompt-lengths", "128,256", "--steps", "8", "--context-tokens", "512",
                "--output", str(out)]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


SERVED_BATCHES = (1, 2, 4, 8, 16)
SERVED_PREFILL_TOKENS = 256


def measure_served_profile(plan: Plan, core: int, tokenizer, log_dir: Path) -> dict:
    """The same four figures measured through a served replica (`hpi serve` pinned to `core`, streamed
    /v1/completions): what `hpi profile` cannot see, the server process's own per-token work (SSE, detokenizing)
    on the same core. Decode: at each batch b, b clients in a closed loop with 16-token prompts and 64 output
    tokens; the step is the median time per output token. Prefill: one client, 256-token prompts, 2 tokens out;
    the rate is the prompt over the median TTFT less one step at batch 1."""
    points = []
    with ServerProcess(pinned(hpi_command(1, "--max-num-seqs", str(plan.max_num_seqs)), core),
                       log_dir / "served-profile.log") as server:  # fmt: skip
        for batch in SERVED_BATCHES:
            spec = WorkloadSpec(3 * batch, LengthDist(16), LengthDist(64), seed=batch)
            run = asyncio.run(run_load(build_requests(tokenizer, spec),
                                       LoadConfig(server.base_url, SERVED_MODEL_NAME, concurrency=batch)))  # fmt: skip
            points.append((batch, summarize(run)["tpot_ms"]["p50"]))
        spec = WorkloadSpec(4, LengthDist(SERVED_PREFILL_TOKENS), LengthDist(2), seed=99)
        run = asyncio.run(run_load(build_requests(tokenizer, spec),
                                   LoadConfig(server.base_url, SERVED_MODEL_NAME, concurrency=1)))  # fmt: skip
        ttft_ms = summarize(run)["ttft_ms"]["p50"]
    alpha, beta = fit_itl(points)
    prefill_s = max(ttft_ms - (alpha + beta), 1.0) / 1000
    return {"itlAlphaMs": alpha, "itlBetaMs": beta, "prefillTokensPerSecond": SERVED_PREFILL_TOKENS / prefill_s,
            "maxNumSeqs": plan.max_num_seqs, "decodePoints": points, "prefillTtftMs": ttft_ms}  # fmt: skip


def capacity_rps(profile: dict, plan: Plan, num_replicas: int) -> float:
    """Requests/s the replicas sustain by the profile's decode line at max_num_seqs (ignoring queueing)."""
    batch = min(plan.max_num_seqs, profile["maxNumSeqs"])
    step_s = (profile["itlAlphaMs"] + profile["itlBetaMs"] * batch) / 1000
    prefill_s = plan.prompt_tokens.mean / profile["prefillTokensPerSecond"]
    per_replica = batch / (plan.output_tokens.mean * step_s + batch * prefill_s)
    return num_replicas * per_replica


def tokenizer():
    from transformers import AutoTokenizer

    from hpi_runtime.embedded import embedded_model_dir

    return AutoTokenizer.from_pretrained(embedded_model_dir())


def real_run(plan: Plan, rate_rps: float, log_dir: Path) -> dict:
    spec = WorkloadSpec(plan.num_requests, plan.prompt_tokens, plan.output_tokens, seed=plan.seed)
    requests = build_requests(tokenizer(), spec)
    with ExitStack() as stack:
        backends = [stack.enter_context(ServerProcess(
            pinned(hpi_command(1, "--max-num-seqs", str(plan.max_num_seqs)), core), log_dir / f"backend{core}.log"))
            for core in plan.cores]  # fmt: skip
        router = stack.enter_context(ServerProcess(router_command([b.base_url for b in backends]),
                                                   log_dir / "router.log"))  # fmt: skip
        wait_all_ready(router.base_url, len(backends))
        page = backends[0].metrics_text()
        blocks, block_size = (metric_value(page, name) for name in ("hpi:kv_cache_blocks",
                                                                     "hpi:kv_cache_block_size_tokens"))
        kv_tokens = int(blocks * block_size)
        config = LoadConfig(router.base_url, SERVED_MODEL_NAME, rate_rps=rate_rps, seed=plan.seed)
        run = asyncio.run(run_load(requests, config))
    summary = summarize(run)
    summary["kv_capacity_tokens"] = kv_tokens
    summary["requests"] = [
        {"arrival_s": round(r.start_s, 5), "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
         "ttft_s": r.ttft_s, "e2e_s": round(r.e2e_s, 5), "ok": r.ok}
        for r in run.results
    ]  # fmt: skip
    return summary


COMPARED = (("requests_per_s", None), ("output_tokens_per_s", None), ("ttft_ms", "p50"), ("ttft_ms", "p90"),
            ("tpot_ms", "p50"), ("tpot_ms", "p90"))  # fmt: skip


def simulate(plan: Plan, profile: dict, real: dict) -> dict:
    """The real run's requests (arrival times and token counts as served) replayed by the simulator."""
    requests = [Request(r["arrival_s"], r["prompt_tokens"], r["output_tokens"]) for r in real["requests"] if r["ok"]]
    replica = backend(profile["itlAlphaMs"] / 1000, profile["itlBetaMs"] / 1000, profile["prefillTokensPerSecond"],
                      real["kv_capacity_tokens"], max_num_seqs=plan.max_num_seqs)  # fmt: skip
    simulated = replay(requests, [replica] * len(plan.cores))
    simulated.pop("per_request")
    return simulated


def compare(real: dict, simulated: dict) -> list[dict]:
    """Each compared figure: real, simulated, and the simulation's error relative to the real run."""
    rows = []
    for key, q in COMPARED:
        r, s = (real[key], simulated[key]) if q is None else (real[key][q], simulated[key][q])
        rows.append({"figure": key if q is None else f"{key} {q}", "real": r, "simulated": s,
                     "error": (s - r) / r, "within": abs(s - r) <= TOLERANCE * r})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="toy sizes, results into bench/results/tmp/")
    parser.add_argument("--resimulate", action="store_true",
                        help="keep the saved profile and real run, simulate again (after a simulator change)")
    args = parser.parse_args()
    plan = QUICK if args.quick else Plan()
    out_dir = RESULTS / "tmp" if args.quick else RESULTS
    path = out_dir / "fleet_calibration.json"
    log_dir = RESULTS / "tmp" / "calibration-logs"
    if args.resimulate:
        saved = json.loads(path.read_text())
        profile, served, rate, real = saved["profile"], saved["served_profile"], saved["rate_rps"], saved["real"]
    else:
        profile = measure_profile(plan, plan.cores[0])
        served = measure_served_profile(plan, plan.cores[0], tokenizer(), log_dir)
        rate = plan.load * capacity_rps(profile, plan, len(plan.cores))
        print(f"profile {profile['itlAlphaMs']:.1f} + {profile['itlBetaMs']:.2f} x b ms, "
              f"{profile['prefillTokensPerSecond']:.0f} prefill tok/s; open loop at {rate:.2f} req/s")  # fmt: skip
        real = real_run(plan, rate, log_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"plan": asdict(plan), "profile": profile, "served_profile": served,
                                    "rate_rps": rate, "real": real}))  # fmt: skip
    result = {"plan": asdict(plan), "cpu": profile.get("cpu"), "profile": profile, "served_profile": served,
              "rate_rps": rate, "real": real}  # fmt: skip
    for name, figures in (("engine profile (hpi profile)", profile), ("served profile", served)):
        simulated = simulate(plan, figures, real)
        rows = compare(real, simulated)
        print(f"simulated with the {name}: {figures['itlAlphaMs']:.1f} + {figures['itlBetaMs']:.2f} x b ms, "
              f"{figures['prefillTokensPerSecond']:.0f} prefill tok/s")  # fmt: skip
        for row in rows:
            print(f"{row['figure']:>22}: real {row['real']:9.2f}  simulated {row['simulated']:9.2f}  "
                  f"error {row['error']:+.1%}{'' if row['within'] else '  (outside 15%)'}")  # fmt: skip
        result["served" if figures is served else "engine"] = {"comparison": rows, "simulated": simulated}
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
