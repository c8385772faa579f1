"""The architecture registry: the one list of architectures, each resolving to its family's class and rules,
and cheap to import (the CLI lists the architectures without importing torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.models.family import FamilyRules
from hpi_runtime.models.registry import SUPPORTED_ARCHITECTURES, family_rules, model_class


def test_every_architecture_resolves_to_a_decoder_and_its_rules() -> None:
    for architecture in SUPPORTED_ARCHITECTURES:
        assert issubclass(model_class(architecture), DecoderForCausalLM)
        assert isinstance(family_rules(architecture), FamilyRules)
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        model_class("GPT2LMHeadModel")


def test_families_that_read_config_json_alike_share_rules() -> None:
    assert type(family_rules("MistralForCausalLM")) is FamilyRules  # Llama's reading
    assert family_rules("Qwen2ForCausalLM") is not family_rules("LlamaForCausalLM")


def test_listing_the_architectures_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "import hpi_runtime.cli\n"
        "from hpi_runtime.models.registry import SUPPORTED_ARCHITECTURES\n"
        "assert 'LlamaForCausalLM' in SUPPORTED_ARCHITECTURES\n"
        "assert 'torch' not in sys.modules, 'the registry or the CLI imported torch'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
