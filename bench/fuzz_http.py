"""The front door's fuzz campaign (issue 39): schemathesis from each server's GET /openapi.json, 1,000+ cases
each, against a live `hpi serve` of the tiny random model (a 64-token context caps every generation, so the run
takes minutes) and against `hpi-router` with a tenants file in front of that same server. Any 5xx or an answer
slower than 30 s is a failure; afterwards both must still answer a greedy request with the same text.

    PYTHONPATH=contracts:kernels:runtime:router:tests:. python -m bench.fuzz_http --cases 1100
    # -> bench/results/front_door_fuzz.json (the figures for bench/results/front_door.md)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bench.report import machine_description
from hpi_testing.http_fuzz import fuzz_openapi
from hpi_testing.server import RuntimeServer, free_port, post_json
from hpi_testing.tiny_model import build_tiny_model

RESULTS = Path(__file__).resolve().parent / "results" / "front_door_fuzz.json"
KEY, POD_KEY = "sk-fuzz-bench-0123456789", "pod-key-0123456789abcdef"
GREEDY = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, "temperature": 0}


def _wait_ready(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if post_json(url, "/v1/chat/completions", GREEDY, {"Authorization": f"Bearer {KEY}"})[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer within {timeout_s} s")


def campaign(cases: int, seed_random: bool) -> dict:
    work = Path(tempfile.mkdtemp(prefix="fuzz-"))
    model = build_tiny_model(work / "tiny", "llama")
    results = {"machine": machine_description(), "cases_asked": cases}
    with RuntimeServer(model, work / "server.log", "--served-model-name", "tiny-llama", "--max-model-len", "64",
                       "--max-num-seqs", "8", "--kv-cache-memory", "8MiB", "--dtype", "float32", "--enforce-eager",
                       env={"HPI_API_KEY": POD_KEY}) as server:  # fmt: skip
        pod_auth = {"Authorization": f"Bearer {POD_KEY}"}
        reference = post_json(server.base_url, "/v1/chat/completions", GREEDY, pod_auth)[1]
        (work / "tenants.yaml").write_text(yaml.safe_dump({"tenants": [{"name": "fuzz", "keys": [KEY]}]}))
        port = free_port()
        router = subprocess.Popen([sys.executable, "-m", "hpi_router.cli", "--backend", server.base_url,
                                   "--port", str(port), "--tenants-file", str(work / "tenants.yaml")],
                                  env={**os.environ, "HPI_API_KEY": POD_KEY}, stdout=subprocess.DEVNULL,
                                  stderr=open(work / "router.log", "wb"))  # fmt: skip
        router_url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(router_url)
            for name, url, headers, exclude in (("runtime", server.base_url, pod_auth, ("/sleep",)),
                                                ("router", router_url, {"Authorization": f"Bearer {KEY}"}, ())):
                start = time.monotonic()
                # Both fuzz the one engine (the router forwards to it): its tokens tell work from a hang.
                report = fuzz_openapi(url, cases, exclude_paths=exclude, headers=headers,
                                      derandomize=not seed_random, progress=server.tokens_processed)  # fmt: skip
                again = post_json(url, "/v1/chat/completions", GREEDY, headers)[1]
                same = again["choices"][0]["message"] == reference["choices"][0]["message"]
                results[name] = {"cases": report.num_cases, "failures": report.failures,
                                 "statuses": {str(k): v for k, v in report.statuses.items()},
                                 "slowest_s": round(report.slowest_s, 2),
                                 "seconds": round(time.monotonic() - start, 1),
                                 "same_answer_after": same}
                print(f"{name}: {report.summary()}; same answer after: {results[name]['same_answer_after']}")
                for failure in report.failures:
                    print("  ", failure[:400])
        finally:
            router.terminate()
            router.wait(30)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=1100, help="cases per server (a few are deduplicated away)")
    parser.add_argument("--random", action="store_true", help="a random campaign instead of the reproducible one")
    args = parser.parse_args()
    results = campaign(args.cases, args.random)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
