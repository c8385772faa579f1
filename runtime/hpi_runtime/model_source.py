"""Where a model comes from: `None` is the embedded SmolLM2-135M-Instruct (converted once into the cache
directory), a path is a local Hugging Face directory, an `owner/name` id is fetched from the Hub."""

from __future__ import annotations

from pathlib import Path


def resolve_model_dir(model: str | Path | None) -> tuple[Path, str]:
    """(local directory, served model name) for `model`: None -> embedded, a directory, or a Hub id."""
    if model is None:
        from hpi_runtime.embedded import EMBEDDED_MODEL_NAME, ensure_embedded_model

        return ensure_embedded_model(), EMBEDDED_MODEL_NAME
    path = Path(model).expanduser()
    if path.is_dir():
        return path, path.name
    if isinstance(model, str) and model.count("/") == 1 and not model.startswith((".", "/", "~")):
        try:
            return download_from_hub(model), model
        except Exception as exc:  # offline, unknown id, gated: all mean "cannot get it"
            raise FileNotFoundError(f"{model!r} is not a local directory and could not be downloaded: {exc}") from exc
    if path.exists():
        raise FileNotFoundError(f"model {str(path)!r} is a file: give its directory (config.json, the weights and "
                                "the tokenizer)")  # fmt: skip
    raise FileNotFoundError(f"model directory {str(path)!r} does not exist")


def download_from_hub(model_id: str, local_dir: Path | None = None, revision: str = "main") -> Path:
    """Fetch a Hub model's configs and tokenizer, then only the weight files the loader will read, verified
    and resumable (hpi_runtime/download.py), into `local_dir` or `$HF_HOME/hpi-models/<id>/<revision>`.
    HF_TOKEN and HF_ENDPOINT are honoured."""
    from huggingface_hub import constants

    from hpi_runtime.download import download_model

    target = local_dir if local_dir is not None else Path(constants.HF_HOME) / "hpi-models" / model_id / revision
    return download_model(model_id, target, revision).local_dir
