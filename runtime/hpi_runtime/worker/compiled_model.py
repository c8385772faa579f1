"""The model step under torch.compile (Inductor): one graph over all layers for every step shape.

Attention is the opaque `hpi::paged_attention` op, so the graph has no breaks; the only size that
reaches guarded code is the token count, marked dynamic. A step of one token is padded to two because
Dynamo specialises a dynamic size seen as 1 (a second graph); the per-request attention tensors are
unbacked-dynamic (see PagedAttentionInputs). Whether Inductor freezes the weights (constants, prepacked
for oneDNN) is the caller's choice: see `ExecutorConfig.freeze_weights`.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

from hpi_runtime.model.attention_op import PagedAttentionInputs
from hpi_runtime.model.llama import LlamaForCausalLM

MIN_COMPILED_TOKENS = 2


class CompiledForward:
    """`model(input_ids, positions, metadata)`, compiled on first call (the runner's warm-up)."""

    def __init__(self, model: LlamaForCausalLM, freeze_weights: bool) -> None:
        # The model object itself stays eager (perplexity and tests call it directly).
        self._compiled = torch.compile(_own_code(model), fullgraph=True, options={"freezing": freeze_weights})

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        metadata: PagedAttentionInputs,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        num_tokens = input_ids.shape[0]
        if num_tokens < MIN_COMPILED_TOKENS:  # pad rows: token 0 at position 0, no KV slot, never sampled
            pad = MIN_COMPILED_TOKENS - num_tokens
            input_ids, positions = (torch.cat([t, t.new_zeros(pad)]) for t in (input_ids, positions))
        torch._dynamo.mark_dynamic(input_ids, 0)
        torch._dynamo.mark_dynamic(positions, 0)
        metadata.mark_step_dynamic()
        return self._compiled(input_ids, positions, metadata)[:num_tokens]


def _own_code(model: LlamaForCausalLM) -> Callable[..., torch.Tensor]:
    """`model`'s forward behind a function whose code object is this model's alone.

    Dynamo keeps compiled graphs per code object with a limit of 8 (then, with fullgraph, it fails): every
    model compiled through the shared `nn.Module.__call__` would count against one process-wide limit,
    which a process building several engines (tests, notebooks) exceeds. Graphs kept on a private code
    object count only this model's shapes and are freed with it.
    """

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, metadata: PagedAttentionInputs) -> torch.Tensor:
        return model(input_ids, positions, metadata)

    code = forward.__code__
    return types.FunctionType(code.replace(co_name=f"{code.co_name}_{id(model):x}"), forward.__globals__,
                              closure=forward.__closure__)  # fmt: skip
