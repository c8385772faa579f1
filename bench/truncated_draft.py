"""A self-speculative draft for the embedded model: its first N decoder layers, its own final norm and (tied)
LM head, written as a normal checkpoint directory that shares the tokenizer files byte for byte.

    .venv/bin/python -m bench.truncated_draft --layers 8 --out /tmp/smollm2-draft-8

Then `--speculative-config '{"model": "/tmp/smollm2-draft-8", "num_speculative_tokens": 4}'`. No training:
the early layers' hidden state read through the final norm and LM head (what LayerSkip trains a model to
make good), so the drafts are only as good as that untrained early exit.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from hpi_runtime.embedded import ensure_embedded_model

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def write_truncated_draft(model_dir: Path, num_layers: int, out_dir: Path) -> Path:
    """Copy `model_dir` to `out_dir` keeping decoder layers [0, num_layers) and everything else."""
    config = json.loads((model_dir / "config.json").read_text())
    if not 1 <= num_layers < config["num_hidden_layers"]:
        raise ValueError(f"--layers must be in [1, {config['num_hidden_layers']}), got {num_layers}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            match = _LAYER.match(name)
            if match is None or int(match.group(1)) < num_layers:
                tensors[name] = tensor
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2))
    for path in model_dir.iterdir():
        if path.suffix != ".safetensors" and path.name != "config.json" and path.is_file():
            shutil.copy(path, out_dir / path.name)
    return out_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="decoder layers kept (of 30)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    print(write_truncated_draft(ensure_embedded_model(), args.layers, Path(args.out)))


if __name__ == "__main__":
    main()
