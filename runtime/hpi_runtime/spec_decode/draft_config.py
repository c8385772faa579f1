"""The draft model of draft-model speculation, resolved and checked at start, before any weight is read.

A draft proposes token ids that the target verifies, so both must mean the same thing by every id: the same
vocabulary size and the same tokenizer vocabulary, special tokens included. It must also cover every
position the target serves (max_model_len). Its KV lives in blocks the target's scheduler hands out, so it
runs only where those blocks stay for a request's whole life (no sliding-window freeing) and on one rank.
"""

from __future__ import annotations

from typing import Any

from hpi_runtime.model_source import resolve_model_dir
from hpi_runtime.models.config import ModelConfig, load_model_config


def resolve_draft_model(
    draft: str, target: ModelConfig, target_tokenizer: Any, max_model_len: int, tensor_parallel_size: int,
    kv_sliding_window: int | None,
) -> ModelConfig:  # fmt: skip
    """The draft's ModelConfig; ValueError with the reason when it cannot draft for `target`."""
    from transformers import AutoTokenizer

    prefix = f"speculative config: draft model {draft!r}"
    if tensor_parallel_size != 1:
        raise ValueError(f"{prefix}: draft-model speculation runs at tensor_parallel_size 1 only")
    if kv_sliding_window is not None:
        raise ValueError(f"{prefix}: the target frees KV blocks behind its sliding window "
                         f"({kv_sliding_window} tokens), which the draft's cache shares; use method 'ngram' "
                         "or 'suffix' with this model")  # fmt: skip
    try:
        draft_dir, _ = resolve_model_dir(draft)
    except FileNotFoundError as exc:
        raise ValueError(f"{prefix}: {exc}") from None
    config = load_model_config(draft_dir)
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"{prefix} has a vocabulary of {config.vocab_size} tokens, the target {target.vocab_size}: "
                         "a draft must share the target's tokenizer")  # fmt: skip
    draft_vocab = AutoTokenizer.from_pretrained(draft_dir).get_vocab()
    target_vocab = target_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=lambda item: item[1])[:3]
        raise ValueError(f"{prefix} has another tokenizer vocabulary than the target ({len(draft_vocab)} vs "
                         f"{len(target_vocab)} entries; e.g. {differing}): a draft must share the target's "
                         "tokenizer")  # fmt: skip
    if config.max_position_embeddings < max_model_len:
        raise ValueError(f"{prefix} covers {config.max_position_embeddings} positions, fewer than max_model_len "
                         f"{max_model_len}: lower --max-model-len or use a draft with a longer context")  # fmt: skip
    return config.for_max_model_len(max_model_len)
