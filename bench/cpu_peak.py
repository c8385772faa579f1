"""The CPU's multiply-add ceiling per instruction kind: what the int8 and bf16 tiles could reach at most here.

Each kind runs 12 independent accumulator chains of one instruction from registers (no memory traffic), on 1
thread and on every core, and reports instructions per second per thread and multiply-adds per second in all:
- vpdpbusd (AVX512-VNNI): 64 int8 x uint8 products per zmm instruction (the W4A8 tile's);
- vdpbf16ps (AVX512-BF16): 32 bf16 products (the packed bf16 and int8 tiles');
- vfmadd231ps: 16 fp32 products (AVX512) or 8 (AVX2 + FMA; the fp32 tiles', attention's);
- vpmaddubsw + vpmaddwd + vpaddd: 32 int8 x uint8 products per sequence of three ymm instructions (the AVX2
  W4A8 tile's, on CPUs without AVX-VNNI); its row counts sequences, not instructions.
A kind the CPU lacks is skipped. The source is compiled here with the system C compiler (the one the C++
kernels build with) and `-fopenmp`. The chains start from distinct values so that the compiler cannot merge them
(checked: the timed loop holds 12 of the instruction).

    .venv/bin/python -m bench.cpu_peak [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import string
import subprocess
import tempfile
from pathlib import Path

from hpi_runtime.cpu_features import cpu_flags

# The timed function; each kind fills in the accumulator type, its initialiser, the operands, the instruction and
# the final sum.
_KERNEL = string.Template("""
$prelude
__attribute__((noinline)) double run(long iters) {
  $acc a[12];
  for (int i = 0; i < 12; ++i) a[i] = $init(i + 1);
  $operand x = $x, y = $y;
  for (long n = 0; n < iters; ++n) {
    __asm__ volatile("" : "+v"(x), "+v"(y));
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = $op(a[i], x, y);
  }
  double sink = 0;
  for (int i = 0; i < 12; ++i) sink += $sum(a[i]);
  return sink;
}
""")
KINDS = {  # name: (required cpu flags, compiler flags, multiply-adds per instruction, substitutions)
    "vpdpbusd": (("avx512_vnni",), "-mavx512f -mavx512vnni", 64, {
        "acc": "__m512i", "init": "_mm512_set1_epi32", "operand": "__m512i", "x": "_mm512_set1_epi32(0x01010101)",
        "y": "_mm512_set1_epi32(0x02020202)", "op": "_mm512_dpbusd_epi32", "sum": "_mm512_reduce_add_epi32"}),
    "vdpbf16ps": (("avx512_bf16",), "-mavx512f -mavx512bf16", 32, {
        "acc": "__m512", "init": "_mm512_set1_ps", "operand": "__m512bh",
        "x": "(__m512bh)_mm512_set1_epi32(0x3f803f80)", "y": "(__m512bh)_mm512_setzero_si512()",
        "op": "_mm512_dpbf16_ps", "sum": "_mm512_reduce_add_ps"}),
    "vfmadd231ps zmm": (("avx512f",), "-mavx512f", 16, {
        "acc": "__m512", "init": "_mm512_set1_ps", "operand": "__m512", "x": "_mm512_set1_ps(1.0f)",
        "y": "_mm512_setzero_ps()", "op": "_mm512_fmadd_ps", "sum": "_mm512_reduce_add_ps"}),
    "vfmadd231ps ymm": (("avx2", "fma"), "-mavx2 -mfma", 8, {
        "acc": "__m256", "init": "_mm256_set1_ps", "operand": "__m256", "x": "_mm256_set1_ps(1.0f)",
        "y": "_mm256_setzero_ps()", "op": "_mm256_fmadd_ps", "sum": "hsum256"}),
    "vpmaddubsw+vpmaddwd ymm": (("avx2",), "-mavx2", 32, {
        "prelude": "static inline __m256i maddubs_pair(__m256i a, __m256i x, __m256i y) {\n"
                   "  (void)y;  /* a feeds the multiply, so that the 12 chains cannot share one product */\n"
                   "  const __m256i pairs = _mm256_maddubs_epi16(a, x);\n"
                   "  return _mm256_add_epi32(a, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));\n"
                   "}\n"
                   "static inline double hsum256i(__m256i v) {\n"
                   "  int f[8];\n  _mm256_storeu_si256((__m256i*)f, v);\n"
                   "  return (double)f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7];\n}",
        "acc": "__m256i", "init": "_mm256_set1_epi32", "operand": "__m256i", "x": "_mm256_set1_epi8(1)",
        "y": "_mm256_set1_epi8(2)", "op": "maddubs_pair", "sum": "hsum256i"}),
}
_MAIN = """
#include <immintrin.h>
#include <stdlib.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }
static inline float hsum256(__m256 v) {
  float f[8];
  _mm256_storeu_ps(f, v);
  return f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7];
}
KERNEL
int main(int argc, char** argv) {
  const long iters = 20000000L;
  const int threads = atoi(argv[1]);
  double best = 1e30, sink = 0;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += run(iters);
    const double dt = now() - t0;
    if (dt < best) best = dt;
  }
  printf("%.6f %g\\n", best, sink);
  return 0;
}
"""


def measure(name: str, threads: int, build_dir: Path) -> float:
    """Seconds for 20M iterations of 12 instructions on each of `threads` threads (best of 3)."""
    _, cflags, _, subs = KINDS[name]
    ident = name.replace(" ", "_")
    c_file, binary = build_dir / f"{ident}.c", build_dir / ident
    if not binary.exists():
        c_file.write_text(_MAIN.replace("KERNEL", _KERNEL.substitute({"prelude": "", **subs})))
        subprocess.run(["cc", "-O2", "-fopenmp", *cflags.split(), str(c_file), "-o", str(binary)], check=True)
    out = subprocess.run([str(binary), str(threads)], check=True, capture_output=True, text=True).stdout
    return float(out.split()[0])


def run() -> dict:
    flags = set(cpu_flags())
    threads = os.cpu_count() or 1
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (needs, _, macs, _) in KINDS.items():
            if not set(needs) <= flags:
                continue
            for n in sorted({1, threads}):
                seconds = measure(name, n, Path(tmp))
                instructions = 20_000_000 * 12
                rows[f"{name}, {n} thread{'s' if n > 1 else ''}"] = {
                    "g_instructions_per_s_per_thread": instructions / seconds / 1e9,
                    "gmac_per_s": instructions * n * macs / seconds / 1e9,
                }
    return {"threads": threads, "flags": sorted(flags & {f for k in KINDS.values() for f in k[0]}), "peaks": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    result = run()
    print(f"flags: {' '.join(result['flags'])}; {result['threads']} threads")
    print("| instruction | G instructions/s per thread | G multiply-adds/s |")
    print("| --- | --- | --- |")
    for name, row in result["peaks"].items():
        print(f"| {name} | {row['g_instructions_per_s_per_thread']:.2f} | {row['gmac_per_s']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
