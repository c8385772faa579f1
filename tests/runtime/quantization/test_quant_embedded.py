"""The embedded SmolLM2-135M-Instruct quantized at load time, in fp32 and bf16: it still answers, and
perplexity stays bounded.

Perplexity bounds come from measurements on the fixed text in data/ppl_text.txt (443 tokens, CPU; see
docs/quantization.md): fp32 none 26.15, int8 26.07 (x0.997), int4 g32 (MSE fit, mixed policy) 26.10; bf16
none 26.23, int8 26.06, int4 26.10. The embedded checkpoint was converted from a Q4_1 GGUF (a group-32 int4
grid), which is why int4 g32 costs almost nothing here; the int4 bound (x1.10) leaves room for that luck to
run out with a differently converted checkpoint, and int8's (x1.02) for summation-order noise, while both
still catch a broken scale, a wrong nibble order or a mis-packed group (each sends perplexity into the
hundreds or more).

Issue 17's regression: the bare "What is the capital of France?" in bf16 with int4 answered "L'Étoile, la
Marseillaise, ...". The float model itself nearly ties there (first token "The" against "L": 0.08 nats in
fp32, 0.14 in bf16, where logits come out of the bf16 LM head at a resolution of 0.125 and an exact tie goes
to "L", the lower token id); min/max int4 made it a tie, the MSE fit and the mixed policy give "The" a lead
of 0.125-0.27 (docs/quantization.md). This asserts the answer the way the issue asked it, in both dtypes,
and the one-word variant (a 1.5-nat lead) as the margin-safe check.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpi_runtime.attention.factory import get_attention_backend
from hpi_runtime.config import EngineArgs
from hpi_runtime.engine_factory import create_engine
from hpi_runtime.evaluation.perplexity import perplexity
from hpi_runtime.llm import LLM
from hpi_runtime.models.config import load_model_config
from hpi_runtime.models.loader import load_model
from hpi_runtime.sampling_params import SamplingParams

TEXT = (Path(__file__).parent / "data" / "ppl_text.txt").read_text()
MAX_PPL_RATIO = {"int8": 1.02, "int4": 1.10}  # quantized / unquantized perplexity, see the module docstring
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference_perplexity(embedded_model_dir: Path) -> dict[str, float]:
    """The unquantized model's perplexity per activation dtype (bf16 runs emulated on CPUs without it)."""
    ids = _text_ids(embedded_model_dir)
    values = {}
    for name, dtype in DTYPES.items():
        backend = get_attention_backend("torch", dtype, torch.device("cpu"))
        model = load_model(load_model_config(embedded_model_dir), dtype, torch.device("cpu"), backend)
        values[name] = perplexity(model, backend, ids)
    return values


def _text_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model_dir).encode(TEXT)
    assert len(ids) > 400
    return ids


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_embedded_model_answers_paris_and_keeps_perplexity(
    method: str, dtype: str, reference_perplexity: dict[str, float], embedded_model_dir: Path
) -> None:
    llm = LLM(None, dtype=dtype, quantization=method, kv_cache_memory_bytes=16 << 20, max_model_len=256,
              enforce_eager=True)  # fmt: skip
    assert llm.bundle.resolved.quantization == method and llm.bundle.resolved.dtype == dtype
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    for question in ("What is the capital of France?", "What is the capital of France? Answer in one word."):
        answer = llm.chat([{"role": "user", "content": question}], greedy)[0].text
        assert "Paris" in answer, f"{dtype} {method}: {question!r} -> {answer!r}"
    # Last: perplexity() gives the model a private KV cache, so the engine is done with it from here on.
    executor = llm.engine.executor
    reference = reference_perplexity[dtype]
    assert 10 < reference < 50  # the float model reads plain English fluently
    ratio = perplexity(executor.model, executor.runner.backend, _text_ids(embedded_model_dir)) / reference
    bound = MAX_PPL_RATIO[method]
    assert ratio < bound, f"{dtype} {method}: perplexity x{ratio:.3f} of unquantized, bound x{bound}"
    llm.shutdown()


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
        create_engine(EngineArgs.from_options(model=str(embedded_model_dir), quantization="fp8"))
    with pytest.raises(ValueError, match="does not divide"):  # hidden 576 is not a multiple of 128
        create_engine(
            EngineArgs.from_options(model=str(embedded_model_dir), quantization="int4", quantization_group_size=128)
        )
