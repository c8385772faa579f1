"""The compile cache (`--compile-cache-dir`): keyed directories, the engine's wiring, and a second process that
compiles nothing because the first one's output is in the directory."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hpi_runtime import compile_cache
from hpi_runtime.config import EngineArgs
from hpi_runtime.engine_factory import resolve_engine

COMPILER_ENV = ("TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", compile_cache.ENV)
KEY = compile_cache.ModelKey(model_name="org/My Model", config_json=b'{"hidden_size": 8}', device="cpu",
                             dtype="torch.float32", quantization="none", tensor_parallel_size=1,
                             attention_backend="torch", max_model_len=128)  # fmt: skip


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """The compilers' variables unset here and restored after: the engine sets them in this process, and
    monkeypatch alone would leave behind a variable it found unset (later tests would compile into tmp_path)."""
    saved = {name: os.environ.pop(name, None) for name in COMPILER_ENV}
    yield monkeypatch
    for name, value in saved.items():
        os.environ.pop(name, None)
        if value is not None:
            os.environ[name] = value


def test_models_and_profiles_get_their_own_directories() -> None:
    name = KEY.directory_name()
    assert name.startswith("org_My_Model-") and "/" not in name
    assert KEY.directory_name() == name  # stable: the next process finds the same directory
    others = [replace(KEY, dtype="torch.bfloat16"), replace(KEY, quantization="int8"),
              replace(KEY, config_json=b'{"hidden_size": 16}'), replace(KEY, tensor_parallel_size=2),
              replace(KEY, max_model_len=256), replace(KEY, attention_backend="triton")]  # fmt: skip
    assert len({name, *(k.directory_name() for k in others)}) == 1 + len(others)


def test_platform_key_names_torch_python_and_the_instruction_set() -> None:
    key = compile_cache.platform_key(torch.device("cpu"))
    assert key.startswith(f"torch{torch.__version__}-py{sys.version_info.major}{sys.version_info.minor}-")
    assert torch.backends.cpu.get_cpu_capability().lower() in key.split("-")
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    if "avx512_bf16" in flags:  # Inductor emits bf16 dot products here: code a plain AVX512 node cannot run
        assert "avx512_bf16" in key.split("-")


def test_engine_points_every_compiler_below_the_directory(tiny_model_dir: Path, tmp_path: Path,
                                                           clean_env: pytest.MonkeyPatch) -> None:  # fmt: skip
    resolve_engine(EngineArgs.from_options(model=str(tiny_model_dir), dtype="float32",
                                           compile_cache_dir=str(tmp_path)))  # fmt: skip
    platform_dir = tmp_path / compile_cache.platform_key(torch.device("cpu"))
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(platform_dir / "torch_extensions")
    inductor = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert inductor.parent.parent == platform_dir and inductor.name == "inductor"
    assert Path(os.environ["TRITON_CACHE_DIR"]) == inductor.parent / "triton"

    # Another profile of the same model (here the dtype), asked for through the environment: its own directory.
    clean_env.setenv(compile_cache.ENV, str(tmp_path))
    resolve_engine(EngineArgs.from_options(model=str(tiny_model_dir), dtype="bfloat16"))
    other = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert other.parent.parent == platform_dir and other != inductor


def test_a_directory_that_cannot_be_made_changes_nothing(tmp_path: Path, clean_env: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert compile_cache.use_for_kernels(str(blocker / "cache"), torch.device("cpu")) is None
    assert "TORCH_EXTENSIONS_DIR" not in os.environ and "cannot be created" in caplog.text


def _cache_counts() -> dict[str, int]:
    counters = torch._dynamo.utils.counters
    return {"misses": counters["inductor"]["fxgraph_cache_miss"],
            "hits": counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"]}


@pytest.mark.slow
def test_a_later_compile_is_served_from_the_directory(tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    """What a second pod on the same volume finds: the compiled step on disk, not compiled again. In this process,
    with Dynamo's in-memory state reset in between, as a new process starts without it (two real processes cost
    a minute on 2 cores; bench/compile_cache.py times real pods' starts: the compile phase 4.6x shorter)."""
    model_dir = compile_cache.use_for_model(compile_cache.use_for_kernels(str(tmp_path), torch.device("cpu")), KEY)
    x, w = torch.arange(24.0).view(3, 8), torch.eye(8)

    def step(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w  # an extern matmul alone: Inductor generates no C++ to compile, only its Python wrapper

    before = _cache_counts()
    first = torch.compile(step, fullgraph=True)(x, w)
    after_first = _cache_counts()
    assert after_first["misses"] > before["misses"]  # an empty directory: compiled
    assert any((model_dir / "inductor").rglob("*.py"))  # Inductor's output went below the model's directory
    torch._dynamo.reset()
    second = torch.compile(step, fullgraph=True)(x, w)
    after_second = _cache_counts()
    assert after_second["misses"] == after_first["misses"] and after_second["hits"] > after_first["hits"]
    torch.testing.assert_close(second, first)
