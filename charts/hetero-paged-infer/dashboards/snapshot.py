"""Draws the dashboard's panels from a Prometheus query API with matplotlib (Grafana is not needed).

Used for docs/images/dashboard-local.png: a Prometheus scraping local `hpi serve` processes under load, with
the labels the chart's PodMonitor would add set as target labels, e.g. in prometheus.yml:

    scrape_configs:
      - job_name: hpi
        scrape_interval: 2s
        static_configs:
          - targets: ["127.0.0.1:8001"]
            labels: {namespace: local, inference_deployment: smollm2, pool: cpu-a}
          - targets: ["127.0.0.1:8002"]
            labels: {namespace: local, inference_deployment: smollm2, pool: cpu-b}

    python charts/hetero-paged-infer/dashboards/snapshot.py --prometheus http://127.0.0.1:9090 \\
        --start 1700000000 --end 1700000600 --out docs/images/dashboard-local.png

Each panel's queries are those of generate.py with every dashboard variable set to "all" and
$__rate_interval set to --rate-interval.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from generate import build  # the generator beside this file

VARIABLES = {"$namespace": ".*", "$inference_deployment": ".*", "$pool": ".*"}


def query_range(base: str, expr: str, start: float, end: float, step_s: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step_s})
    with urllib.request.urlopen(f"{base.rstrip('/')}/api/v1/query_range?{params}", timeout=30) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", required=True)
    parser.add_argument("--start", type=float, required=True)
    parser.add_argument("--end", type=float, required=True)
    parser.add_argument("--step", type=float, default=5.0)
    parser.add_argument("--rate-interval", default="30s")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in build()["panels"] if p["type"] == "timeseries"]
    columns = 3
    rows = -(-len(panels) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 3.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        plotted = 0
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", args.rate_interval)
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            for series in query_range(args.prometheus, expr, args.start, args.end, args.step):
                times = [float(t) - args.start for t, _ in series["values"]]
                values = [float(v) for _, v in series["values"]]
                ax.plot(times, values, label=legend(target.get("legendFormat", ""), series["metric"]), linewidth=1.2)
                plotted += 1
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("seconds", fontsize=8)
        ax.set_ylabel(panel["fieldConfig"]["defaults"].get("unit", ""), fontsize=8)
        ax.tick_params(labelsize=7)
        if plotted:
            ax.legend(fontsize=6, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data in this run", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    figure.suptitle("hetero-paged-infer dashboard: local run (2 CPU replicas of the embedded model under load)")
    figure.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=80)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
