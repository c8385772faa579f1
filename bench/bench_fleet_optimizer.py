"""The fleet optimizer's solve time (hpi_operator.fleet.optimizer), and the MILP back end it uses against the
other candidate: HiGHS through scipy.optimize.milp, and highspy's own API (when installed), on the same seeded
fleets of 3, 10 and 100 pools with up to 200 replicas per pool (1,000+ replicas at 10 pools). Prints a
markdown table; the target is a decision in under 50 ms at 10 pools.

    .venv/bin/python -m bench.bench_fleet_optimizer [--runs 30]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable

import numpy as np

from hpi_operator.fleet.optimizer import PoolOffer, optimize
from hpi_operator.fleet.performance import Demand, PoolPerformance, Slo

SLO = Slo(ttft_p90_s=1.0, itl_p90_s=0.1)


def fleet(num_pools: int, seed: int) -> tuple[Demand, list[PoolOffer]]:
    rng = random.Random(seed)
    offers = []
    for i in range(num_pools):
        perf = PoolPerformance(itl_alpha_s=rng.uniform(0.008, 0.04), itl_beta_s=rng.uniform(0.0001, 0.002),
                               prefill_tokens_per_s=rng.uniform(2_000, 30_000),
                               max_num_seqs=rng.randint(16, 256))  # fmt: skip
        cost, cap = rng.uniform(0.2, 10.0), rng.randint(5, 200)
        offers.append(PoolOffer(f"pool-{i}", perf, cost_per_hour=cost, max_replicas=cap))
    demand = Demand(request_rate=rng.uniform(20, 60) * num_pools, mean_prompt_tokens=rng.uniform(200, 2000),
                    mean_output_tokens=rng.uniform(50, 500))  # fmt: skip
    return demand, offers


def highspy_solve(demand: Demand, offers: list[PoolOffer]) -> None:
    """The same MILP through highspy's own model API (the candidate scipy's wrapper was measured against)."""
    import highspy

    from hpi_operator.fleet.performance import replica_capacity

    rates = [replica_capacity(o.performance, demand, SLO).request_rate for o in offers]
    n = len(offers)
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n, 1
    lp.col_cost_ = np.array([o.cost_per_hour for o in offers])
    lp.col_lower_, lp.col_upper_ = np.zeros(n), np.array([float(o.max_replicas) for o in offers])
    lp.row_lower_, lp.row_upper_ = np.array([demand.request_rate / 0.85]), np.array([highspy.kHighsInf])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = np.arange(n + 1, dtype=np.int32)
    lp.a_matrix_.index_ = np.zeros(n, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(rates)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * n
    solver = highspy.Highs()
    solver.setOptionValue("output_flag", False)
    solver.passModel(lp)
    solver.run()


def timed(solve: Callable[[Demand, list[PoolOffer]], object], num_pools: int, runs: int) -> list[float]:
    times = []
    for seed in range(runs):
        demand, offers = fleet(num_pools, seed)
        start = time.perf_counter()
        solve(demand, offers)
        times.append(time.perf_counter() - start)
    return sorted(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    solvers: dict[str, Callable[[Demand, list[PoolOffer]], object]] = {
        "hpi optimize (scipy milp)": lambda d, o: optimize(d, SLO, o)}
    try:
        import highspy  # noqa: F401

        solvers["highspy API"] = highspy_solve
    except ImportError:
        pass
    print(f"machine: {platform.processor() or platform.machine()}, runs {args.runs}, seeds 0..{args.runs - 1}\n")
    print("| pools | replicas (max) | solver | median ms | p95 ms |\n|---|---|---|---|---|")
    for num_pools in (3, 10, 100):
        max_replicas = statistics.mean(sum(o.max_replicas for o in fleet(num_pools, s)[1]) for s in range(args.runs))
        for name, solve in solvers.items():
            times = timed(solve, num_pools, args.runs)
            p95 = times[min(len(times) - 1, int(0.95 * len(times)))]
            median_ms = statistics.median(times) * 1e3
            print(f"| {num_pools} | {max_replicas:.0f} | {name} | {median_ms:.1f} | {p95 * 1e3:.1f} |")


if __name__ == "__main__":
    main()
