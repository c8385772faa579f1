"""`python -m hpi_kernels.cpu.prebuild [--lower]`: compile the C++ CPU kernels ahead of their first use.

A first use compiles them (_extension.py), which costs a minute or more of both cores of a small machine. `make
test` starts this in the background once torch is installed, while the rest installs and the model converts, so the
suite finds this CPU's build ready and, with `--lower`, the AVX2 and generic builds too, which the kernel tests re-run
in child processes whose torch dispatches to a lower instruction set (tests/kernels/test_cpu_lower_capability.py). Each
build runs in its own process (the capability is fixed when torch is imported), all at once, and under the same
flock as any other build of its directory: a test that needs one while it is compiling waits for it, then loads it.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from hpi_kernels.cpu._extension import cpu_capability, lower_capabilities

_BUILD = "from hpi_kernels.cpu._extension import load_extension; print(load_extension())"


def _build(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _BUILD], env=env, capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpi_kernels.cpu.prebuild", description=__doc__.split("\n")[0])
    parser.add_argument("--lower", action="store_true",
                        help="also build the lower capabilities' kernels (AVX2, generic) this CPU runs")  # fmt: skip
    args = parser.parse_args(argv)
    capability = cpu_capability()
    capabilities = [capability, *(lower_capabilities(capability) if args.lower else [])]
    # Concurrent builds share the cores: ninja's default (cores + 2 jobs each) would run a dozen compilers at once.
    jobs = os.environ.get("MAX_JOBS", str(max(1, (os.cpu_count() or 1) // len(capabilities))))
    envs = {name: {**os.environ, "MAX_JOBS": jobs} for name in capabilities}
    for name in capabilities[1:]:
        envs[name]["ATEN_CPU_CAPABILITY"] = name.lower()
    with ThreadPoolExecutor(len(capabilities)) as pool:
        results = dict(zip(capabilities, pool.map(_build, envs.values()), strict=True))
    for name, done in results.items():
        if done.returncode == 0:  # the library's path, the last line the build prints (its log goes to stderr)
            print(f"{name}: {done.stdout.strip().splitlines()[-1]}")
        else:
            print(f"{name}: build failed (exit {done.returncode}):\n{done.stdout}{done.stderr}", file=sys.stderr)
    return 1 if any(done.returncode for done in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
