"""The compile cache: what start-up compiles, kept in one directory that outlives the process (`--compile-cache-dir`,
env HPI_COMPILE_CACHE_DIR), so the next start of the same model and profile skips compiling.

Start-up compiles two things: the C++ CPU kernels (hpi_kernels.cpu, torch cpp_extension; model-independent) and
the model step (torch.compile: Inductor's FX-graph and AOTAutograd caches, its generated C++ and Triton kernels).
Each is pointed below the directory through torch's own variables (TORCH_EXTENSIONS_DIR, TORCHINDUCTOR_CACHE_DIR,
TRITON_CACHE_DIR) before anything compiles; child processes (the engine core, tensor-parallel workers) inherit them.

Layout: `<dir>/<platform>/torch_extensions/` and `<dir>/<platform>/<model>/{inductor,triton}/`. The platform key
holds what makes compiled code unportable: torch and Python versions and the instruction set the code was built
for (torch's CPU dispatch level plus the flags Inductor specialises on: AVX512-BF16/FP16, AMX; the GPU's compute
capability on cuda), so one volume can serve nodes of several kinds and never hands a node code it cannot run.
The model key (its name plus a hash of its config.json and the profile: device, dtype, quantization, tensor
parallelism, attention backend, context length) keeps each model's graphs apart. Concurrent pods sharing the
directory are safe: Inductor and Triton write each entry to a temporary file and rename it into place, and the
C++ kernels build under an flock (hpi_kernels/cpu/_extension.py). A directory that cannot be written is
logged and left alone: the process then compiles in torch's default places, as without this option.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from hpi_runtime import cpu_features

ENV = "HPI_COMPILE_CACHE_DIR"
# The CPU flags beyond torch's dispatch level that change the code Inductor generates (cpu_vec_isa.py).
_INDUCTOR_CPU_FLAGS = ("avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelKey:
    """What a compiled model step depends on besides the platform: the model and the profile it runs under."""

    model_name: str
    config_json: bytes  # the model directory's config.json, as read
    device: str
    dtype: str
    quantization: str  # the scheme, e.g. "none", "int4-g32-mse-mixed"
    tensor_parallel_size: int
    attention_backend: str
    max_model_len: int

    def directory_name(self) -> str:
        profile = json.dumps([self.device, self.dtype, self.quantization, self.tensor_parallel_size,
                              self.attention_backend, self.max_model_len])  # fmt: skip
        digest = hashlib.sha256(self.config_json + profile.encode()).hexdigest()[:16]
        return f"{_safe(self.model_name)}-{digest}"


def requested_dir(flag_value: str | None) -> str | None:
    """The compile cache directory asked for: the flag, else the environment; None: off."""
    return flag_value or os.environ.get(ENV) or None


def platform_key(device: torch.device) -> str:
    """torch, Python and the instruction set compiled code is built for, as one directory name."""
    isa = torch.backends.cpu.get_cpu_capability().lower()
    extra = [flag for flag in _INDUCTOR_CPU_FLAGS if flag in cpu_features.cpu_flags()]
    parts = [f"torch{torch.__version__}", f"py{sys.version_info.major}{sys.version_info.minor}", isa, *extra]
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        parts.append(f"sm{major}{minor}")
    return _safe("-".join(parts))


def use_for_kernels(root: str, device: torch.device) -> Path | None:
    """Point the C++ kernels' builds at `<root>/<platform>/torch_extensions`; returns the platform directory, or
    None (with a warning) when it cannot be written. Call before the first kernel build."""
    platform_dir = _writable(Path(root) / platform_key(device))
    if platform_dir is not None:
        os.environ["TORCH_EXTENSIONS_DIR"] = str(platform_dir / "torch_extensions")
    return platform_dir


def use_for_model(platform_dir: Path, key: ModelKey) -> Path | None:
    """Point Inductor's and Triton's caches at `<platform_dir>/<model>/`; returns that directory, or None when it
    cannot be written. Call before the model step compiles (the engine core and its workers inherit it)."""
    model_dir = _writable(platform_dir / key.directory_name())
    if model_dir is None:
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(model_dir / "inductor")
    os.environ["TRITON_CACHE_DIR"] = str(model_dir / "triton")
    logger.info("compile cache: %s", model_dir)
    return model_dir


def _writable(path: Path) -> Path | None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        logger.warning("compile cache %s cannot be created (%s): compiling in torch's default places", path, error)
        return None
    if not os.access(path, os.W_OK | os.X_OK):
        logger.warning("compile cache %s is not writable: compiling in torch's default places", path)
        return None
    return path


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("_") or "model"
