"""The config tree is the one place an engine option is declared: each option appears in `hpi serve --help`,
in `LLM(...)`'s signature with its default and in the operator's flag contract (hpi_contracts.serve_flags,
whose generated file must be fresh); bad values are ValueErrors wherever they come in."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from hpi_contracts.serve_flags import SERVE_FLAGS
from hpi_runtime import serve_contract
from hpi_runtime.cli import build_parser
from hpi_runtime.config import (
    CacheConfig,
    EngineArgs,
    EngineConfig,
    LoadConfig,
    SchedulerConfig,
    engine_options,
    server_options,
)
from hpi_runtime.llm import LLM
from hpi_runtime.options import OptionSpec, add_flags, option, option_specs

ENGINE_OPTIONS = engine_options()
SERVER_OPTIONS = server_options()


def serve_help() -> str:
    serve_parser = build_parser()._subparsers._group_actions[0].choices["serve"]
    return serve_parser.format_help()


@pytest.fixture(scope="module")
def help_text() -> str:
    return serve_help()


@pytest.mark.parametrize("spec", ENGINE_OPTIONS, ids=lambda s: s.name)
def test_every_engine_option_is_a_flag_an_llm_argument_and_in_the_contract(spec: OptionSpec, help_text: str) -> None:
    assert spec.flag in help_text.split()
    parameter = inspect.signature(LLM).parameters[spec.name]
    assert parameter.default == spec.default
    flag = SERVE_FLAGS[spec.flag]
    assert (flag.field, flag.default, flag.choices) == (spec.name, spec.default, spec.info.choices or ())


@pytest.mark.parametrize("spec", SERVER_OPTIONS, ids=lambda s: s.name)
def test_every_server_option_is_a_flag_and_in_the_contract(spec: OptionSpec, help_text: str) -> None:
    assert spec.flag in help_text.split()
    assert SERVE_FLAGS[spec.flag].field == spec.name
    assert spec.name not in inspect.signature(LLM).parameters  # the HTTP edge is not the offline API's


def test_the_contract_has_no_flag_the_runtime_lacks() -> None:
    assert set(SERVE_FLAGS) == {s.flag for s in ENGINE_OPTIONS + SERVER_OPTIONS}


def test_the_generated_contract_is_fresh() -> None:
    """`make contracts` regenerates hpi_contracts/serve_flags.py; a config change without it fails here."""
    with open(serve_contract.default_path()) as file:
        assert file.read() == serve_contract.render(), "stale: run `make contracts`"


def test_a_new_option_is_a_flag_with_its_default_help_and_choices() -> None:
    @dataclasses.dataclass(frozen=True)
    class Speculative:  # the shape the sections to come take
        num_speculative_tokens: int = option(0, "draft tokens per step", choices=(0, 1, 2, 4))
        enable_x: bool = option(False, "turn x on")

    [tokens, switch] = option_specs(Speculative, "speculative")
    assert (tokens.flag, tokens.type, tokens.default) == ("--num-speculative-tokens", int, 0)
    parser = argparse.ArgumentParser()
    add_flags(parser, [tokens, switch])
    assert vars(parser.parse_args([])) == {"num_speculative_tokens": 0, "enable_x": False}
    assert vars(parser.parse_args(["--num-speculative-tokens", "4", "--enable-x"])) == {
        "num_speculative_tokens": 4, "enable_x": True}  # fmt: skip
    with pytest.raises(SystemExit):
        parser.parse_args(["--num-speculative-tokens", "3"])


def test_flags_parse_to_the_same_engine_args_as_keyword_arguments() -> None:
    args = build_parser().parse_args(["serve", "--block-size", "32", "--no-prefix-caching", "-tp", "2",
                                      "--kv-cache-memory", "2GiB", "--max-num-waiting", "7"])  # fmt: skip
    from_flags = EngineArgs.from_options(**{s.name: getattr(args, s.name) for s in ENGINE_OPTIONS})
    assert from_flags == EngineArgs.from_options(block_size=32, enable_prefix_caching=False, tensor_parallel_size=2,
                                                 kv_cache_memory_bytes=2 * 2**30, max_num_waiting=7)  # fmt: skip
    assert from_flags.options()["max_num_waiting"] == 7  # LLM gets every option, max_num_waiting included


def test_bad_options_are_value_errors_and_unknown_ones_type_errors() -> None:
    with pytest.raises(ValueError, match="block_size must be one of 8, 16, 32, 64, 128; got 12"):
        EngineArgs.from_options(block_size=12)
    with pytest.raises(ValueError, match="dtype must be one of"):
        LoadConfig(dtype="float64")
    with pytest.raises(ValueError, match="kv_admission_watermark must be in"):
        SchedulerConfig(kv_admission_watermark=1.0)
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(TypeError, match="unknown engine option 'block_sise'"):
        EngineArgs.from_options(block_sise=16)


def test_the_core_config_defaults_are_the_sections() -> None:
    config, cache, scheduler = EngineConfig(), CacheConfig(), SchedulerConfig()
    assert (config.block_size, config.enable_prefix_caching) == (cache.block_size, cache.enable_prefix_caching)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_num_waiting,
            config.kv_admission_watermark) == (scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
                                               scheduler.max_num_waiting, scheduler.kv_admission_watermark)  # fmt: skip


def test_the_int4_choices_are_the_quantizers() -> None:
    from hpi_runtime.quantization.policy import INT4_POLICIES
    from hpi_runtime.quantization.quantize import DEFAULT_INT4_GROUP_SIZE, INT4_FITS, INT4_GROUP_SIZES

    specs = {s.name: s for s in ENGINE_OPTIONS}
    assert specs["quantization_group_size"].info.choices == INT4_GROUP_SIZES
    assert specs["quantization_group_size"].default == DEFAULT_INT4_GROUP_SIZE
    assert specs["int4_fit"].info.choices == INT4_FITS
    assert set(specs["int4_policy"].info.choices) == set(INT4_POLICIES)


def test_the_config_tree_imports_no_torch_and_the_server_not_the_offline_api() -> None:
    """`hpi serve --help` and `make contracts` stay fast; the server assembles its engine without `LLM`."""
    import subprocess
    import sys

    code = ("import sys, hpi_runtime.cli, hpi_runtime.serve_contract; assert 'torch' not in sys.modules, 'torch'; "
            "import hpi_runtime.server.main, hpi_runtime.engine_factory; "
            "assert 'hpi_runtime.llm' not in sys.modules, 'llm'")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_pool_profile_takes_json_or_a_file_to_read_later() -> None:
    from hpi_runtime.config import ServerConfig

    assert ServerConfig(pool_profile="@/etc/hpi/pool-profile/profile.json").pool_profile_path == (
        "/etc/hpi/pool-profile/profile.json")  # not read now: the file may appear after the server starts
    literal = ServerConfig(pool_profile='{"itlAlphaMs": 1, "itlBetaMs": 0, "prefillTokensPerSecond": 9, '
                                        '"maxNumSeqs": 2}')
    assert literal.pool_profile_path is None
    with pytest.raises(ValueError, match="needs a path"):
        ServerConfig(pool_profile="@")
    with pytest.raises(ValueError, match="needs itlBetaMs"):
        ServerConfig(pool_profile='{"itlAlphaMs": 1}')
