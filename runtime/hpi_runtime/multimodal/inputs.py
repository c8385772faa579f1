"""One image of a request as the engine sees it: its processed pixels, where its placeholder tokens sit in the
prompt, and the hash that names its content (for the encoder cache and the prefix cache).

The frontend builds these (multimodal/processor.py); they travel inside `EngineCoreRequest` and, when the
scheduler first sends the request to the executor, inside `NewRequestData`, as numpy arrays: pickled once per
process hop, never through JSON. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class MultiModalInput:
    """One image: its placeholder run is prompt tokens [offset, offset + length), one embedding row each."""

    mm_hash: str  # the image's content (decoded pixels, mode and size) and the processor's settings, hex
    offset: int  # the first placeholder token's index in the prompt
    length: int  # placeholder tokens = rows of its embedding
    # float32: Qwen2-VL's [num_patches, channels * temporal_patch * patch * patch], or one [3, H, W] frame (LLaVA)
    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]  # patches along time, height and width, before any spatial merge

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ValueError(
                f"an image's placeholder run must be non-empty and in the prompt: {self.offset}+{self.length}"
            )

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether its placeholder run meets tokens [start, end)."""
        return self.offset < end and start < self.end


def mm_extra_keys(mm_inputs: tuple[MultiModalInput, ...], start: int, end: int) -> tuple[str, ...]:
    """The prefix-cache keys of tokens [start, end) beyond their ids: the hash of each image whose placeholders
    fall there, so the same text with another image never shares KV."""
    return tuple(mm.mm_hash for mm in mm_inputs if mm.overlaps(start, end))
