"""The model step under torch.compile (Inductor): one graph over all layers for every step shape.

Attention is one opaque op per layer (attention/op.py), so the graph has no breaks. Every size that
changes per step is unbacked-dynamic: the token count and the per-request attention tensors (see
PagedAttentionInputs). So no guard reads them, one graph serves every step, and a one-token step is not
specialised (a backed size seen as 1 is) nor padded to two rows: a one-row matmul runs MKL's GEMV, 1.4x
faster than a two-row GEMM over the same weights (bench/results/hot_path.md). The one row-count choice
in the model (CPU int8 layers dequantize for large steps) is a `torch.cond`. Whether Inductor freezes
the weights (constants, prepacked for oneDNN) is the caller's choice: see `ExecutorConfig.freeze_weights`;
`freezing` is read while Dynamo traces, so it is patched around the call, not passed as an option.
So is `cpp.dynamic_threads`: Inductor's C++ kernels then leave the thread count of each parallel loop to
OpenMP at run time instead of a fixed `num_threads`; measured on 2 cores, alternating step by step, the
fp32 decode step ran 2-4% faster (22.1 -> 21.4 ms at batch 1, 53.8 -> 51.4 at 32, 92.9 -> 91.3 at 64).
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

from hpi_runtime.attention.op import PagedAttentionInputs
from hpi_runtime.lora.layers import LoRABatch
from hpi_runtime.models.decoder import DecoderForCausalLM


class CompiledForward:
    """`model(input_ids, positions, metadata)`, compiled on first call (the runner's warm-up)."""

    def __init__(self, model: DecoderForCausalLM, freeze_weights: bool, lora: LoRABatch | None = None) -> None:
        # The model object itself stays eager (perplexity and tests call it directly).
        self._compiled = torch.compile(_own_code(model), fullgraph=True)
        self._freeze_weights = freeze_weights
        # With LoRA, each token's adapter slot is a graph input too (lora/layers.py, LoRABatch, mode "cpu").
        self._lora = lora
        self._sealed = False

    def seal(self) -> None:
        """After warm-up: run the compiled graph without evaluating Dynamo's guards (~0.9 ms a step for
        SmolLM2's ~300 parameter tensors, 3% of a one-request step). Sound because every size that changes per
        step is unbacked, so warm-up compiles the only graph any step needs (tests/runtime/worker/
        test_compiled_model.py checks that no step shape recompiles); nothing else the guards watch (the
        model's parameters, dtypes, grad mode) changes while an engine serves."""
        self._sealed = True

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        metadata: PagedAttentionInputs,
    ) -> torch.Tensor:  # [num_tokens, hidden_size]
        torch._dynamo.decorators.mark_unbacked(input_ids, 0)
        torch._dynamo.decorators.mark_unbacked(positions, 0)
        metadata.mark_step_dynamic()
        if self._lora is not None:
            torch._dynamo.decorators.mark_unbacked(self._lora.token_slots, 0)
        if self._sealed:
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return self._compiled(input_ids, positions, metadata)
        with torch._inductor.config.patch({"freezing": self._freeze_weights, "cpp.dynamic_threads": True}):
            return self._compiled(input_ids, positions, metadata)


def _own_code(model: DecoderForCausalLM) -> Callable[..., torch.Tensor]:
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
