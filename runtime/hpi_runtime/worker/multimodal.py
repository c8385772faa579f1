"""The runner's side of images: the encoder cache's embeddings, each request's images and M-RoPE positions, and
a step's input embeddings with image rows merged in at their placeholder tokens.

The scheduler decides (core/encoder_cache_manager.py): which images to encode this step, and which cached
embeddings to drop. Here they are computed (the model's vision tower, one pass for the step's images) and kept
under the image's content hash, so a later request with the same image, or a later prefill chunk of the same
request, reads the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hpi_runtime.core.interface import SchedulerOutput
from hpi_runtime.models.decoder import DecoderForCausalLM
from hpi_runtime.multimodal.inputs import MultiModalInput
from hpi_runtime.worker.input_batch import StepInputs


@dataclass(frozen=True)
class RequestImages:
    mm_inputs: tuple[MultiModalInput, ...]
    prompt_positions: np.ndarray | None  # [3, num_prompt_tokens] int64 M-RoPE positions; None: one per token
    delta: int  # a token past the prompt sits at its index + delta on every axis


class MultimodalBatch:
    def __init__(self, model: DecoderForCausalLM, device: torch.device) -> None:
        self.model, self.device = model, device
        self.uses_mrope = hasattr(model, "mrope_positions")  # Qwen2-VL; else one position per token (LLaVA)
        self.encoder_cache: dict[str, torch.Tensor] = {}  # image hash -> [placeholders, hidden_size]
        self.requests: dict[str, RequestImages] = {}  # requests with images, by id
        self.num_images_encoded = 0  # cumulative (tests and benchmarks read it)

    def update(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the step's deltas: forget dropped requests and evicted embeddings, then encode what is due."""
        for request_id in scheduler_output.finished_request_ids | scheduler_output.preempted_request_ids:
            self.requests.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.requests.pop(new.request_id, None)
            if new.mm_inputs:
                positions, delta = (None, 0)
                if self.uses_mrope:
                    positions, delta = self.model.mrope_positions(new.num_prompt_tokens, new.mm_inputs)
                self.requests[new.request_id] = RequestImages(new.mm_inputs, positions, delta)
        for mm_hash in scheduler_output.free_encoder_hashes:
            self.encoder_cache.pop(mm_hash, None)
        due = {}  # hash -> image: the step's images to encode, each once
        for request_id, indices in scheduler_output.scheduled_encoder_inputs.items():
            for i in indices:
                mm = self.requests[request_id].mm_inputs[i]
                if mm.mm_hash not in self.encoder_cache:
                    due[mm.mm_hash] = mm
        if due:  # one pass of the vision tower for all of them
            images = list(due.values())
            for mm, rows in zip(images, self.model.embed_images(images), strict=True):
                if rows.shape[0] != mm.length:
                    raise ValueError(f"image {mm.mm_hash[:12]}: the encoder made {rows.shape[0]} rows for "
                                     f"{mm.length} placeholders")  # fmt: skip
                self.encoder_cache[mm.mm_hash] = rows
            self.num_images_encoded += len(images)

    def step_inputs(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(input embeddings [T, hidden_size] with image rows in place, positions: [3, T] int64 with M-RoPE,
        else the step's own [T]) of a step."""
        embeds = self.model.model.embed(step.input_ids.to(self.device))
        token_index = step.positions.numpy()  # [T]: each token's index in its request
        positions = np.broadcast_to(token_index, (3, len(token_index))).copy() if self.uses_mrope else token_index
        starts = step.query_start_loc.tolist()
        for i, request_id in enumerate(step.request_ids):
            images = self.requests.get(request_id)
            if images is None:  # text only: the same position on every axis
                continue
            first, last = starts[i], starts[i + 1]
            index = token_index[first:last]
            if images.prompt_positions is not None:
                num_prompt = images.prompt_positions.shape[1]
                positions[:, first:last] = np.where(
                    index < num_prompt, images.prompt_positions[:, np.minimum(index, num_prompt - 1)],
                    index + images.delta,
                )  # fmt: skip
            start, end = int(index[0]), int(index[-1]) + 1
            for mm in images.mm_inputs:
                lo, hi = max(start, mm.offset), min(end, mm.end)
                if lo < hi:  # this chunk holds placeholders lo..hi of the image
                    rows = self.encoder_cache[mm.mm_hash][lo - mm.offset : hi - mm.offset]
                    embeds[first + lo - start : first + hi - start] = rows.to(embeds.dtype)
        return embeds, torch.from_numpy(positions).to(self.device)
