"""Command line: run one scenario and write its figures as JSON (one file per run), or build the report.

    python -m bench.fleet_sim headline --control optimizer --seed 1      # also: kv --target 0.3, gpu-only
    python -m bench.fleet_sim sweep --seed 1 --scale 0.1                  # the baseline's target utilisation
    python -m bench.fleet_sim routing --seed 1                            # capacity-aware vs round-robin
    python -m bench.fleet_sim scale --seed 1                              # = headline optimizer, timed
    python -m bench.fleet_sim bound --levels 0.2,0.6,1                   # the cost floor: smallest fleet per rate
    python -m bench.fleet_sim report                                      # runs -> bench/results/fleet.{md,json}

Run with PYTHONPATH holding the repository root and the components (see bench/README.md).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from . import scenarios
from .engine import RunResult
from .metrics import summarize
from .report import machine, write_report

RUNS_DIR = Path("/tmp/fleet_sim_runs")


def record(name: str, result: RunResult, seed: int, extra: dict, duration_s: float, out: Path) -> dict:
    figures = {
        "name": name,
        "seed": seed,
        **extra,
        "summary": summarize(result.results, result.num_unserved, scenarios.SLO, result.cost_usd, duration_s),
        "cost_by_state": {k: round(v, 2) for k, v in result.cost_by_state.items()},
        "peak_replicas": result.peak_replicas,
        "num_events": result.num_events,
        "wall_s": round(result.wall_s, 1),
        "cpu_s": round(result.cpu_s, 1),
        "events_per_s": round(result.num_events / result.wall_s) if result.wall_s else None,
        "timeline": result.timeline,
        "machine": machine(),
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(figures, indent=1))
    s = figures["summary"]
    print(f"{name}: slo {s['slo_attainment']:.4f} cost ${s['cost_usd']:.2f} "
          f"${s['cost_per_million_output_tokens']}/M out, peak {result.peak_replicas} replicas, "
          f"{result.num_events} events in {result.wall_s:.0f} s", flush=True)  # fmt: skip
    return figures


def record_level(name: str, found, seed: int, out: Path) -> None:
    """One level of the cost floor (bound.py), in its own folder: the report reads them apart from the runs."""
    figures = {"name": name, "seed": seed, "rate_rps": found.rate_rps, "multiplier": round(found.multiplier, 4),
               "replicas": found.replicas, "cost_per_hour": round(found.cost_per_hour, 4),
               "slo_attainment": round(found.attainment, 4), "probes": found.probes, "machine": machine(),
               "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(figures, indent=1))
    print(f"{name}: {found.rate_rps:.1f} req/s -> {found.replicas} (x{found.multiplier:.3f} at full use), "
          f"${found.cost_per_hour:.2f}/h, attainment {found.attainment:.4f}, {found.probes} probes", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fleet_sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("scenario", choices=("headline", "sweep", "routing", "scale", "bound", "report"))
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--control", choices=("optimizer", "kv", "gpu-only", "oracle"), default="optimizer")
    parser.add_argument("--target", type=float, default=0.3, help="kv control: target KV utilisation")
    parser.add_argument("--target-waiting", type=int, default=None, help="kv control: targetWaitingRequests")
    parser.add_argument("--min-replicas", type=int, default=1, help="kv control: minReplicas (the floor)")
    parser.add_argument("--utilization", type=float, default=None, help="optimizer: planned share of capacity")
    parser.add_argument("--lead", type=float, default=None,
                        help="optimizer: leadTimeSeconds (default: the operator's)")
    parser.add_argument("--scale-down-window", type=float, default=None,
                        help="scaleDownStabilizationSeconds (default: the operator's: 300 s, the optimizer's "
                             "lead time)")
    parser.add_argument("--scale", type=float, default=None, help="fraction of the headline's demand and pools")
    parser.add_argument("--h200", choices=("assumed", "measured"), default="assumed",
                        help="headline: the H200 pool's figures (the roofline estimate, or the 2026-12-04 run)")
    parser.add_argument("--day-hours", type=float, default=scenarios.DURATION_S / 3600,
                        help="headline: the day's length in simulated hours (compressed into one by default)")
    parser.add_argument("--levels", default=",".join(f"{f:g}" for f in scenarios.BOUND_LEVELS),
                        help="bound: fractions of the peak rate to measure")
    parser.add_argument("--targets", default=",".join(f"{t:g}" for t in scenarios.SWEEP_TARGETS))
    parser.add_argument("--baseline", default=None, help="report: the full-scale KV run to compare against")
    parser.add_argument("--runs", type=Path, default=RUNS_DIR, help="where run JSON files go (report reads them)")
    args = parser.parse_args()
    day_s = args.day_hours * 3600
    if day_s <= 0:
        parser.error("--day-hours must be > 0")
    if args.scenario in ("headline", "scale"):
        scale = args.scale or 1.0
        tag = ("" if scale == 1.0 else f"@{scale:g}") + ("" if args.h200 == "assumed" else "-h200measured")
        tag += "" if day_s == scenarios.DURATION_S else f"-day{args.day_hours:g}h"
        down = args.scale_down_window
        if args.control == "kv":
            result = scenarios.headline_baseline(args.seed, args.target, scale, args.target_waiting,
                                                 args.min_replicas, down, args.h200, day_s)  # fmt: skip
            waiting = "" if args.target_waiting is None else f"-w{args.target_waiting}"
            floor = "" if args.min_replicas == 1 else f"-min{args.min_replicas}"
            name = f"headline-kv-{args.target:g}{waiting}{floor}{'' if down is None else f'-down{down:g}'}{tag}"
        else:
            util = args.utilization or scenarios.DEFAULT_UTILIZATION
            result = scenarios.headline_optimizer(args.seed, scale, args.control == "gpu-only", util, args.lead,
                                                 args.control == "oracle", down, args.h200, day_s)  # fmt: skip
            name = (f"headline-{args.control}{'' if args.utilization is None else f'-u{util:g}'}"
                    f"{'' if args.lead is None else f'-lead{args.lead:g}'}"
                    f"{'' if down is None else f'-down{down:g}'}{tag}")  # fmt: skip
        extra = {
            "scale": scale,
            "control": args.control,
            "target": args.target if args.control == "kv" else None,
            "target_waiting": args.target_waiting,
            "min_replicas": args.min_replicas if args.control == "kv" else None,
            "utilization": None if args.control == "kv" else args.utilization or scenarios.DEFAULT_UTILIZATION,
            "lead_s": None if args.control == "kv" else args.lead,  # None: the operator's default (start + 2 polls)
            "scale_down_s": args.scale_down_window,  # None: the operator's default (300 s; optimizer: the lead)
            "h200": args.h200,
            "day_s": day_s,
        }
        record(name, result, args.seed, extra, day_s, args.runs)
    elif args.scenario == "sweep":
        scale = args.scale or 0.1
        for target in (float(t) for t in args.targets.split(",")):
            result = scenarios.headline_baseline(args.seed, target, scale)
            record(f"sweep-kv-{target:g}@{scale:g}", result, args.seed,
                   {"scale": scale, "control": "kv", "target": target}, day_s, args.runs)  # fmt: skip
        result = scenarios.headline_optimizer(args.seed, scale)
        record(f"sweep-optimizer@{scale:g}", result, args.seed, {"scale": scale, "control": "optimizer"}, day_s,
               args.runs)  # fmt: skip
    elif args.scenario == "routing":
        for strategy in ("load", "round-robin"):
            result = scenarios.routing(args.seed, strategy)
            record(f"routing-{strategy}", result, args.seed, {"strategy": strategy,
                   "replicas": scenarios.ROUTING_REPLICAS, "rate_rps": scenarios.ROUTING_RPS},
                   scenarios.ROUTING_DURATION_S, args.runs)  # fmt: skip
    elif args.scenario == "bound":
        for fraction in (float(f) for f in args.levels.split(",")):
            found = scenarios.bound_level(args.seed, fraction, args.h200)
            tag = "" if args.h200 == "assumed" else "-h200measured"
            record_level(f"bound-{fraction:g}{tag}", found, args.seed, args.runs / f"bound{tag}")
    else:
        write_report(args.runs, args.baseline)


if __name__ == "__main__":
    main()
