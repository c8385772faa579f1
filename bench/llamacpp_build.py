"""Build llama.cpp's own C++ server and quantizer, and the GGUFs of the checkpoint hpi serves, for side-by-side
benchmarks (bench/bench_quant_llamacpp.py).

llama.cpp is built from the source tree that llama-cpp-python's source distribution on PyPI vendors (the only
place these machines can reach it): `pip download --no-binary`, then CMake for the `llama-server` and
`llama-quantize` targets, native to this CPU (GGML_NATIVE). The GGUFs are made from the same Hugging Face
directory hpi loads (the embedded SmolLM2-135M-Instruct), with llama.cpp's own converter (F16) and quantizer
(Q8_0, Q4_0), so both systems run the same weights. Everything lands in $HPI_CACHE_DIR/llama.cpp/ and is built
once; a failed step says which and leaves its log there.

    .venv/bin/python -m bench.llamacpp_build          # `make llama-cpp` runs this
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from bench.systems import SERVED_MODEL_NAME, ServerCommand, cache_dir, free_port

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # Makefile's LLAMA_CPP_VERSION: the same llama.cpp tree as the Python server
QUANT_TYPES = ("F16", "Q8_0", "Q4_0")


def root() -> Path:
    return cache_dir() / "llama.cpp"


# The build the benchmarks run, and its CMake options: "build" (GGML_NATIVE: every instruction this CPU reports);
# "build-no-amx" (the same without AMX tiles): on the 2026-12-04 Xeon, ggml's AMX kernels for Q8_0 / Q4_0 died of
# SIGILL at their first `tilezero` (no tile config loaded on the thread running them), so its quantized GGUFs served
# nothing there; without AMX they run its AVX512-VNNI kernels; "build-avx2" (AVX2 + FMA + F16C + BMI2, no AVX512,
# no AMX: llama.cpp's build for an AVX2-only CPU, side by side with hpi's AVX2 build, `ATEN_CPU_CAPABILITY=avx2`,
# on a CPU that has more); "build-avxvnni" (build-avx2 plus AVX-VNNI: ggml's AVX2 dot products on vpdpbusd, as on
# CPUs with AVX2 and AVX-VNNI but no AVX512, side by side with hpi's AVX2 build taking its AVX-VNNI tiles);
# "build-cascadelake" (below).
BUILD_ENV = "HPI_LLAMA_CPP_BUILD"
_NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
BUILDS = {
    "build": ("-DGGML_NATIVE=ON",),
    "build-no-amx": ("-DGGML_NATIVE=ON", f"-DCMAKE_C_FLAGS={_NO_AMX}", f"-DCMAKE_CXX_FLAGS={_NO_AMX}"),
    "build-avx2": ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
                   "-DGGML_BMI2=ON", "-DGGML_AVX512=OFF"),
}
BUILDS["build-avxvnni"] = (*BUILDS["build-avx2"], "-DGGML_AVX_VNNI=ON")
# "build-cascadelake": AVX512 (F, BW, DQ, VL) with AVX512-VNNI and no VBMI, BF16 or AMX, as on Cascade Lake Xeons:
# ggml's AVX512 and VNNI dot products, side by side with hpi's AVX512 build under HPI_CPU_AVX512_VBMI=0 and fp32.
BUILDS["build-cascadelake"] = ("-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                               "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON",
                               "-DGGML_AVX512_VBMI=OFF", "-DGGML_AVX512_BF16=OFF")  # fmt: skip


def build_variant() -> str:
    variant = os.environ.get(BUILD_ENV, "build")
    if variant not in BUILDS:
        raise ValueError(f"{BUILD_ENV} must be one of {sorted(BUILDS)}, got {variant!r}")
    return variant


def server_binary() -> Path:
    return root() / build_variant() / "bin" / "llama-server"


def gguf_path(quant_type: str) -> Path:
    """The GGUFs of the embedded checkpoint as this version converts it (a new conversion gets new GGUFs)."""
    from hpi_runtime.embedded import FORMAT

    version = FORMAT.split(":")[0]
    return root() / "gguf" / f"embedded-v{version}" / f"smollm2-135m-instruct-{quant_type.lower()}.gguf"


def built(quant_type: str) -> bool:
    """Whether `make llama-cpp` has built the server and this GGUF."""
    return server_binary().is_file() and gguf_path(quant_type).is_file()


def server_command(quant_type: str, parallel: int, tokens_per_request: int, threads: int) -> ServerCommand:
    """llama-server on this GGUF with `parallel` slots (its continuous batching; the context is split among the
    slots, so `-c` is `parallel` times one request's), `threads` for decode and prompt batches."""
    if not built(quant_type):
        raise FileNotFoundError(f"{server_binary()} or {gguf_path(quant_type)} missing: run `make llama-cpp`")
    port = free_port()
    argv = (str(server_binary()), "-m", str(gguf_path(quant_type)), "--alias", SERVED_MODEL_NAME, "--host",
            "127.0.0.1", "--port", str(port), "-t", str(threads), "-tb", str(threads), "--parallel", str(parallel),
            "-c", str(parallel * tokens_per_request), "--no-webui")  # fmt: skip
    return ServerCommand(f"llama.cpp {quant_type}", argv, "/health", port)


def _run(argv: list[str], log: Path, **kwargs) -> None:
    with open(log, "ab") as out:
        out.write(f"$ {' '.join(argv)}\n".encode())
        out.flush()
        result = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, check=False, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed with {result.returncode}; see {log}")


def source_tree(version: str, log: Path) -> Path:
    """llama.cpp's tree from the llama-cpp-python sdist (downloaded and unpacked once)."""
    src = root() / "src"
    if (src / "CMakeLists.txt").is_file():
        return src
    download = root() / "sdist"
    download.mkdir(parents=True, exist_ok=True)
    _run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(download),
          f"llama-cpp-python=={version}"], log)  # fmt: skip
    [archive] = download.glob(f"llama_cpp_python-{version}.tar.gz")
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        for member in members:
            member.name = member.name[len(prefix):]
        tar.extractall(src, members=[m for m in members if m.name], filter="data")
    return src


def build(src: Path, log: Path, jobs: int) -> None:
    if server_binary().is_file() and (server_binary().parent / "llama-quantize").is_file():
        return
    build_dir = root() / build_variant()
    _run(["cmake", "-S", str(src), "-B", str(build_dir), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
          "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
          "-DLLAMA_BUILD_SERVER=ON", *BUILDS[build_variant()]], log)  # fmt: skip
    _run(["cmake", "--build", str(build_dir), "--target", "llama-server", "llama-quantize", "-j", str(jobs)], log)


def convert(src: Path, model_dir: Path, log: Path) -> None:
    """F16 GGUF with llama.cpp's converter (its gguf-py, and sentencepiece, which its Llama path imports, kept in
    the cache, out of the project's venv), then Q8_0 and Q4_0 with its quantizer."""
    gguf_path("F16").parent.mkdir(parents=True, exist_ok=True)
    if not gguf_path("F16").is_file():
        extra = root() / "python"
        if not (extra / "sentencepiece").is_dir():
            _run([sys.executable, "-m", "pip", "install", "-q", "--target", str(extra), "sentencepiece"], log)
        env = {"PYTHONPATH": f"{src / 'gguf-py'}:{extra}", "PATH": "/usr/bin:/bin"}
        _run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", "f16", "--outfile",
              str(gguf_path("F16"))], log, env=env)  # fmt: skip
    quantize = server_binary().parent / "llama-quantize"
    for quant_type in QUANT_TYPES[1:]:
        if not gguf_path(quant_type).is_file():
            _run([str(quantize), str(gguf_path("F16")), str(gguf_path(quant_type)), quant_type], log)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION, help="llama-cpp-python sdist to take from")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--variant", choices=sorted(BUILDS), default=None,
                        help=f"which build to make (default: ${BUILD_ENV}, else build); benchmarks pick one with "
                        f"{BUILD_ENV}=<variant>")  # fmt: skip
    args = parser.parse_args()
    if args.variant:
        os.environ[BUILD_ENV] = args.variant
    from hpi_runtime.embedded import ensure_embedded_model

    root().mkdir(parents=True, exist_ok=True)
    log = root() / "build.log"
    try:
        src = source_tree(args.version, log)
        build(src, log, args.jobs)
        convert(src, ensure_embedded_model(), log)
    except (RuntimeError, ValueError, OSError) as e:
        print(f"llama.cpp build failed: {e}", file=sys.stderr)
        return 1
    print(f"llama-server: {server_binary()}")
    for quant_type in QUANT_TYPES:
        print(f"{quant_type}: {gguf_path(quant_type)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
