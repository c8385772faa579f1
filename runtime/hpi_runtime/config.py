"""Engine configuration: the knobs of scheduling and KV-cache sizing, validated once."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    max_num_seqs: int = 64  # running requests at most
    max_num_batched_tokens: int = 2048  # tokens computed per step at most (the chunked-prefill budget)
    max_model_len: int = 2048  # prompt + output tokens per request at most
    enable_prefix_caching: bool = True
    max_num_waiting: int = 1024  # queue limit: more waiting requests than this are refused (HTTP 429)
    # Fraction of KV blocks that admitting a waiting request must leave free, for the running requests' decode
    # growth (vLLM v0's `watermark`). 0 admits until the pool is full; then the next block boundary preempts
    # the newest request and recomputes it (bench/bench_engine_core.py compares values).
    kv_admission_watermark: float = 0.02
    # Set from the model when every layer attends only its last N tokens (Mistral, Gemma 2/3 without global
    # layers never qualify): blocks before that window are freed as a request grows. None: keep them all.
    kv_sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_num_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0.0 <= self.kv_admission_watermark < 1.0:  # also refuses NaN
            raise ValueError(f"kv_admission_watermark must be in [0, 1), got {self.kv_admission_watermark}")
        if self.kv_sliding_window is not None and self.kv_sliding_window < 1:
            raise ValueError(f"kv_sliding_window must be at least 1, got {self.kv_sliding_window}")
