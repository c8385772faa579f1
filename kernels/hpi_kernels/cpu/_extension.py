"""Builds and loads the C++ CPU kernels: torch.utils.cpp_extension, compiled at first use and cached on disk.

The build targets the instruction set torch itself dispatches to on this CPU (`torch.backends.cpu.
get_cpu_capability()`: AVX512, AVX2 or DEFAULT; `ATEN_CPU_CAPABILITY` lowers it), with the flags torch
compiles its own kernels of that level with, so ATen's `Vectorized<float>` is as wide as torch's. Never
`-march=native`: a cached build must run on every CPU of the same capability. Each capability is its own
extension (and build directory), so one cache can serve machines of different kinds.

Build directory: `$TORCH_EXTENSIONS_DIR/<python+torch>/<name>` when that is set (torch's own variable; the
runtime's compile cache sets it, runtime/hpi_runtime/compile_cache.py), else `$HPI_CACHE_DIR/torch_extensions/...`,
else torch's default (~/.cache/torch_extensions). Needs a C++ compiler (`$CXX` or c++) and ninja.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import platform
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCES = tuple(
    Path(__file__).resolve().with_name(name)  # absolute: a relative PYTHONPATH entry and a later chdir
    for name in ("paged_attention.cpp", "paged_attention_amx.cpp", "packed_linear.cpp", "packed_linear_bf16.cpp",
                 "packed_linear_amx.cpp", "packed_linear_quant.cpp", "lora_delta.cpp", "decode_stack.cpp")
)  # fmt: skip

# torch's per-capability compiler flags (cmake/Codegen.cmake), plus F16C, which every AVX2 CPU has and
# at::vec's float16 conversions use.
_ISA_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


class CpuKernelBuildError(RuntimeError):
    """The C++ CPU kernels could not be built or loaded (no compiler, no ninja, a compile error)."""


def cpu_capability() -> str:
    """The instruction set the extension is built for: torch's own dispatch level on this CPU."""
    capability = torch.backends.cpu.get_cpu_capability()
    is_x86 = platform.machine().lower() in ("x86_64", "amd64")
    return capability if is_x86 and capability in _ISA_FLAGS else "DEFAULT"


def lower_capabilities(capability: str) -> list[str]:
    """The capabilities below `capability` whose builds this CPU also runs (torch dispatches to them when
    ATEN_CPU_CAPABILITY names them), highest first."""
    order = ("AVX512", "AVX2", "DEFAULT")
    return list(order[order.index(capability) + 1:]) if capability in order else []


def _ensure_ninja_on_path() -> None:
    # cpp_extension runs `ninja` through PATH; pip puts it next to the interpreter, which is not on PATH
    # when the virtualenv is used without being activated (.venv/bin/python ...).
    if shutil.which("ninja"):
        return
    scripts = sysconfig.get_path("scripts")
    if scripts and (Path(scripts) / "ninja").exists():
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
        return
    raise CpuKernelBuildError(
        "building the C++ CPU kernels needs ninja: `pip install ninja` (a dependency of hpi-kernels)"
    )


def _build_directory(name: str) -> str | None:
    """<root>/<python+torch>/<name> under $TORCH_EXTENSIONS_DIR, else under $HPI_CACHE_DIR/torch_extensions, or None
    (torch's default) when neither is set or writable."""
    tag = f"py{sys.version_info.major}{sys.version_info.minor}_torch{torch.__version__}"
    roots = [os.environ.get("TORCH_EXTENSIONS_DIR"), os.environ.get("HPI_CACHE_DIR")]
    candidates = [Path(roots[0])] if roots[0] else []
    candidates += [Path(roots[1]) / "torch_extensions"] if roots[1] else []
    for root in candidates:
        path = root / tag / name
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass
        if os.access(path, os.W_OK):
            return str(path)
        # e.g. a read-only image layer: ninja must write its log and lock there
        logger.warning("%s is not writable; building the CPU kernels elsewhere", path)
    return None


@contextlib.contextmanager
def _builder_lock(build_directory: str | None) -> Iterator[None]:
    """One builder at a time in `build_directory`, by an flock that the kernel releases when its holder dies.

    cpp_extension guards a build with a lock *file* it deletes when done; a process killed mid-build (a Ctrl-C, a
    test timeout, an OOM kill) leaves the file behind, and every later load of this extension then waits for it
    forever. Under this flock nobody else is building, so a lock file found here is such a leftover: removed."""
    if build_directory is None:  # torch's default directory: its own locking only
        yield
        return
    with open(Path(build_directory) / "hpi-builder.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = Path(build_directory) / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build that was killed (no builder holds the directory)", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def load_extension() -> str:
    """Build (the first time on a machine: ~15 s on 2 cores) and load the CPU kernels; returns the .so path.

    Registers the ops `torch.ops.hpi_kernels.*` (CPU and Meta kernels) in this process. Raises
    CpuKernelBuildError with the reason when the compiler or ninja is missing or the build fails.
    """
    from torch.utils import cpp_extension  # imports setuptools: only when a build is asked for

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise CpuKernelBuildError(f"building the C++ CPU kernels needs a C++ compiler; {compiler!r} is not on PATH")
    _ensure_ninja_on_path()
    capability = cpu_capability()
    name = f"hpi_cpu_kernels_{capability.lower()}"
    flags = ["-O3", "-fopenmp", *_ISA_FLAGS.get(capability, [])]
    if capability != "DEFAULT":
        flags += [f"-DCPU_CAPABILITY={capability}", f"-DCPU_CAPABILITY_{capability}"]
    start = time.perf_counter()
    build_directory = _build_directory(name)
    try:
        with _builder_lock(build_directory):
            path = cpp_extension.load(
                name=name,
                sources=[str(s) for s in _SOURCES],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],  # resolves to the libgomp torch already loaded (same soname)
                build_directory=build_directory,
                is_python_module=False,
            )
    except (RuntimeError, OSError) as error:  # compile errors, a missing toolchain piece, a bad .so
        raise CpuKernelBuildError(f"could not build the C++ CPU kernels ({name}): {error}") from error
    logger.info("loaded %s (%s) in %.1f s", name, path, time.perf_counter() - start)
    return str(path)


@functools.cache
def cpu_kernels_available() -> bool:
    """True when the C++ CPU kernels build and load here (the first call may build them); never raises."""
    try:
        load_extension()
    except CpuKernelBuildError as error:
        logger.warning("C++ CPU kernels unavailable (attention and packed linears fall back): %s", error)
        return False
    return True
