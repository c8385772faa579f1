"""Which llama.cpp build the benchmarks run: the native one by default, the one without AMX tiles when
HPI_LLAMA_CPP_BUILD says so (ggml's AMX kernels died of SIGILL on an AMX Xeon), the AVX2-only one, and nothing
else."""

from __future__ import annotations

import pytest

from bench import llamacpp_build


def test_the_build_variant_picks_the_server_binary(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HPI_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(llamacpp_build.BUILD_ENV, raising=False)
    assert llamacpp_build.server_binary() == tmp_path / "llama.cpp" / "build" / "bin" / "llama-server"
    monkeypatch.setenv(llamacpp_build.BUILD_ENV, "build-no-amx")
    assert llamacpp_build.server_binary().parent.parent.name == "build-no-amx"
    assert any("-mno-amx-int8" in option for option in llamacpp_build.BUILDS["build-no-amx"])
    monkeypatch.setenv(llamacpp_build.BUILD_ENV, "build-avx2")
    assert llamacpp_build.server_binary().parent.parent.name == "build-avx2"
    assert "-DGGML_AVX512=OFF" in llamacpp_build.BUILDS["build-avx2"]
    monkeypatch.setenv(llamacpp_build.BUILD_ENV, "build-avx9")
    with pytest.raises(ValueError, match="HPI_LLAMA_CPP_BUILD must be one of"):
        llamacpp_build.server_binary()
