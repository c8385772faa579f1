"""The runtime metrics the operator reads: exactly these names, a contract the runtime's tests check.

They are vLLM's names (the ecosystem's contract: KEDA recipes, AIBrix, llm-d and the Gateway API inference
extension read them), so the operator also works with stock vLLM pods. Every sample carries `model_name`.
"""

from __future__ import annotations

KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # gauge, 0..1: the fraction of KV blocks in use
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"  # gauge: requests queued, not yet scheduled
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"  # gauge: requests in the running batch
NUM_PREEMPTIONS = "vllm:num_preemptions"  # counter (exposed with _total): KV pressure evicted a request
REQUEST_SUCCESS = "vllm:request_success"  # counter (exposed with _total): finished requests, by finished_reason
PROMPT_TOKENS = "vllm:prompt_tokens"  # counter (exposed with _total): prefill tokens processed
GENERATION_TOKENS = "vllm:generation_tokens"  # counter (exposed with _total): generated tokens

MODEL_NAME_LABEL = "model_name"

# Everything the operator (reconciler and autoscaler) may read from a runtime pod's /metrics.
READ_BY_OPERATOR: tuple[str, ...] = (KV_CACHE_USAGE, NUM_REQUESTS_WAITING, NUM_REQUESTS_RUNNING, NUM_PREEMPTIONS,
                                     REQUEST_SUCCESS, PROMPT_TOKENS, GENERATION_TOKENS)  # fmt: skip
