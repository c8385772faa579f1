"""The kit folder that travels with the checkout to the GPU machine: wheels its image lacks, and the embedded
model's tokenizer (`make gpu-kit` -> .gpu_kit/, ignored by git, named in the device tool's `carry`).

The GPU machine has its own torch, triton, transformers, aiohttp, safetensors, tokenizers, pytest and more
(MACHINE_PACKAGES, as the device tool's KINDS.md listed them on 2026-11-17) and no package index, so what the
runtime imports beyond those travels as wheels for its Python (3.12, manylinux x86_64), each at the version this
checkout's own environment was tested with. Everything that travels (the working tree and this folder) must fit
the device tool's 64 MiB; `build` refuses a kit that does not.

    python -m bench.gpu.kit [--dir .gpu_kit]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
TRAVEL_LIMIT_BYTES = 64 << 20

# What the runtime (and the GPU tests' pytest) import that the GPU machine's image does not have, with what those
# need in turn (their Requires-Dist, minus what the image has). Pinned to the versions this checkout tests with.
KIT_WHEELS = (
    "msgspec==0.23.0",  # the engine core's step messages (core/engine_io.py)
    "xgrammar==0.2.8",  # structured outputs (the runtime pins it)
    "apache-tvm-ffi==0.1.15.post2",  # xgrammar's
    "pydantic==2.14.4",  # xgrammar's
    "pydantic-core==2.50.5",  # pydantic's
    "annotated-types==0.8.0",  # pydantic's
    "typing-inspection==0.4.5",  # pydantic's
    "typing-extensions==4.16.0",  # pydantic's needs >= 4.16, newer than the image may hold
    "pytest-asyncio==1.5.0",  # pytest.ini's asyncio_mode: the async GPU tests need it
)
PLATFORM_ARGS = (
    "--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:",
    *(arg for tag in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                      "manylinux2014_x86_64", "manylinux1_x86_64") for arg in ("--platform", tag)),
)  # fmt: skip

# The GPU machine's Python packages (distribution names, normalised), from the device tool's KINDS.md (read
# 2026-11-17). tests/bench/test_gpu_kit.py checks that every third-party import of the runtime, the kernels and the
# kit is here or in KIT_WHEELS, so a new dependency cannot silently break the GPU run.
MACHINE_PACKAGES = frozenset("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl
zipp
""".split())


def tokenizer_source() -> Path:
    """The embedded model's converted directory (tokenizer, chat template, generation config)."""
    from hpi_runtime.embedded import ensure_embedded_model

    return ensure_embedded_model()


def travelling_bytes(kit_dir: Path) -> int:
    """What the device tool sends: tracked files, untracked files git does not ignore, and the kit folder."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            check=True, capture_output=True).stdout.split(b"\0")  # fmt: skip
    tree = sum((REPO_ROOT / name.decode()).stat().st_size for name in listed if name and
               (REPO_ROOT / name.decode()).is_file())  # fmt: skip
    return tree + sum(path.stat().st_size for path in kit_dir.rglob("*") if path.is_file())


def build(kit_dir: Path) -> int:
    """Fill `kit_dir` (wheels/, tokenizer/) and return the bytes that travel; raises when over the limit."""
    wheels = kit_dir / "wheels"
    shutil.rmtree(wheels, ignore_errors=True)
    wheels.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", *PLATFORM_ARGS, "-d", str(wheels),
                    *KIT_WHEELS], check=True)  # fmt: skip
    tokenizer = kit_dir / "tokenizer"
    tokenizer.mkdir(exist_ok=True)
    from bench.gpu.weights import TOKENIZER_FILES

    source = tokenizer_source()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, tokenizer / name)
    total = travelling_bytes(kit_dir)
    if total > TRAVEL_LIMIT_BYTES:
        raise SystemExit(f"the checkout and {kit_dir} come to {total / 2**20:.1f} MiB, over the device tool's "
                         f"{TRAVEL_LIMIT_BYTES >> 20} MiB: move what does not need to travel out of the tree")
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=REPO_ROOT / ".gpu_kit")
    args = parser.parse_args()
    total = build(args.dir)
    kit = sum(path.stat().st_size for path in args.dir.rglob("*") if path.is_file())
    print(f"{args.dir}: {kit / 2**20:.1f} MiB ({len(list((args.dir / 'wheels').glob('*.whl')))} wheels + tokenizer); "
          f"with the checkout {total / 2**20:.1f} MiB of the device tool's {TRAVEL_LIMIT_BYTES >> 20} MiB")


if __name__ == "__main__":
    main()
