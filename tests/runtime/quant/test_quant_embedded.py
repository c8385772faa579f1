"""The embedded SmolLM2-135M-Instruct quantized at load time: it still answers, and perplexity stays bounded.

Perplexity bounds come from measurements on the fixed text in data/ppl_text.txt (443 tokens, fp32
activations, CPU; see docs/quantization.md): none 26.15, int8 26.07 (x0.997), int4 g32 (the default)
26.23 (x1.003), int4 g64 37.65 (x1.44). The embedded checkpoint was converted from a Q4_1 GGUF (a group-32
int4 grid), which is why int4 g32 costs almost nothing here; the int4 bound (x1.10) therefore leaves room
for that luck to run out with a differently converted checkpoint, and int8's (x1.02) for summation-order
noise, while both still catch a broken scale, a wrong nibble order or a mis-packed group (each sends
perplexity into the hundreds or more).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpi_runtime.llm import LLM, LoadConfig, create_engine
from hpi_runtime.model.attention import get_attention_backend
from hpi_runtime.model.config import load_model_config
from hpi_runtime.model.loader import load_model
from hpi_runtime.model.perplexity import perplexity
from hpi_runtime.sampling_params import SamplingParams

TEXT = (Path(__file__).parent / "data" / "ppl_text.txt").read_text()
MAX_PPL_RATIO = {"int8": 1.02, "int4": 1.10}  # quantized / unquantized perplexity, see the module docstring

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference_perplexity(embedded_model_dir: Path) -> float:
    backend = get_attention_backend("torch", torch.float32)
    model = load_model(load_model_config(embedded_model_dir), torch.float32, torch.device("cpu"), backend)
    return perplexity(model, backend, _text_ids(embedded_model_dir))


def _text_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).encode(TEXT)
    assert len(ids) > 400
    return ids


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_embedded_model_answers_paris_and_keeps_perplexity(
    method: str, reference_perplexity: float, embedded_model_dir: Path
) -> None:
    llm = LLM(None, dtype="float32", quantization=method, kv_cache_memory_bytes=16 << 20, max_model_len=256)
    assert llm.bundle.quantization == method
    # "Answer in one word." because the bare question's first token is a near-tie ("The" against "L'": 0.08 nats
    # apart unquantized, 0.001 in int4, whose bf16 matmul rounds activations): any change of summation order,
    # such as the C++ attention kernel's, flips int4's answer to "L'Étoile, ..." (issue 17 is int4 quality).
    # Here the first token leads by 1.5 nats and the answer is Paris with either attention path.
    chat = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    answer = llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=16))[0].text
    assert "Paris" in answer
    # Last: perplexity() gives the model a private KV cache, so the engine is done with it from here on.
    executor = llm.engine.executor
    assert 10 < reference_perplexity < 50  # the float model reads plain English fluently
    ratio = perplexity(executor.model, executor.runner.backend, _text_ids(embedded_model_dir)) / reference_perplexity
    bound = MAX_PPL_RATIO[method]
    assert ratio < bound, f"{method}: perplexity x{ratio:.3f} of unquantized, bound x{bound}"


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_embedded_model_on_cuda_answers_paris_and_keeps_perplexity(
    method: str, embedded_model_dir: Path
) -> None:
    """The whole GPU path: Triton quantized matmuls inside the model, bf16 activations, Triton attention.
    The reference is the same model unquantized on the same GPU and dtype, so bf16 noise cancels out."""
    options = {"device": "cuda", "dtype": "bfloat16", "kv_cache_memory_bytes": 64 << 20, "max_model_len": 512}
    ids = _text_ids(embedded_model_dir)
    with LLM(None, **options) as float_llm:
        executor = float_llm.engine.executor
        float_perplexity = perplexity(executor.model, executor.runner.backend, ids)
    with LLM(None, quantization=method, **options) as llm:
        chat = [{"role": "user", "content": "What is the capital of France?"}]
        assert "Paris" in llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=16))[0].text
        executor = llm.engine.executor
        assert executor.runner.backend.name == "triton"
        ratio = perplexity(executor.model, executor.runner.backend, ids) / float_perplexity
    assert ratio < MAX_PPL_RATIO[method], f"{method} on CUDA: perplexity x{ratio:.3f} of unquantized"


def test_create_engine_rejects_bad_quantization_settings(embedded_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        create_engine(embedded_model_dir, load=LoadConfig(quantization="fp8"))
    with pytest.raises(ValueError, match="does not divide"):  # hidden 576 is not a multiple of 128
        create_engine(embedded_model_dir, load=LoadConfig(quantization="int4", quantization_group_size=128))
