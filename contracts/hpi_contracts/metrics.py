"""Prometheus metric names the runtime exports and the router and operator read.

They are vLLM's names (the ecosystem's contract: KEDA recipes, AIBrix, llm-d and the Gateway API inference
extension read them), so the router and the operator also work with stock vLLM pods. Every sample carries
`model_name`. Counters are declared without `_total`; prometheus-client exposes them with it.
"""

from __future__ import annotations

MODEL_NAME_LABEL = "model_name"

# Gauges.
NUM_REQUESTS_RUNNING = "vllm:num_requests_running"  # requests in the running batch
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"  # requests queued, not yet scheduled
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"  # 0..1: the fraction of KV blocks in use
# Counters.
PROMPT_TOKENS = "vllm:prompt_tokens"
GENERATION_TOKENS = "vllm:generation_tokens"
REQUEST_SUCCESS = "vllm:request_success"  # label finished_reason
NUM_PREEMPTIONS = "vllm:num_preemptions"
PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"
# Speculative decoding (only with --speculative-config): verifications (request-steps with drafts), draft tokens
# verified, drafts accepted, and drafts accepted by position (label `position`, 0-based). The acceptance rate is
# accepted / draft tokens; the mean accepted length per verification is 1 + accepted / drafts.
SPEC_DECODE_NUM_DRAFTS = "vllm:spec_decode_num_drafts"
SPEC_DECODE_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"
POSITION_LABEL = "position"
# Histograms.
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY = "vllm:e2e_request_latency_seconds"
REQUEST_QUEUE_TIME = "vllm:request_queue_time_seconds"
# Per request with at least two output tokens, once when it finishes: its mean inter-token latency,
# (e2e - TTFT) / (output tokens - 1). The per-token ITL histogram weighs long answers more; SLO attainment
# ("mean ITL within the target") counts requests, so the operator reads this one.
REQUEST_TIME_PER_OUTPUT_TOKEN = "vllm:request_time_per_output_token_seconds"
# Per finished request: its prompt and generated token counts (vLLM's 1-2-5 buckets): the demand's length
# distributions, which means alone do not give (a short answer's mean ITL weighs the prefills landing while it
# decodes far more than a long one's; bench/results/fleet.md).
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
# LoRA (vLLM's info gauge: one series whose labels name the adapters with running / waiting requests, comma-
# separated, and max_lora; its value is the time it was set: vLLM leaves earlier states on the page, so readers
# take the newest sample, as the Gateway API inference extension's LoRA affinity and the router do) and the
# runtime's adapter moves (counters).
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
# 1, labelled with the KV cache's configuration as vLLM labels it: block_size, cache_dtype (as configured:
# auto, fp8, ...), enable_prefix_caching, num_gpu_blocks (the device pool's, also on CPU), num_cpu_blocks (the
# host tier's).
CACHE_CONFIG_INFO = "vllm:cache_config_info"
RUNNING_LORA_ADAPTERS_LABEL = "running_lora_adapters"
WAITING_LORA_ADAPTERS_LABEL = "waiting_lora_adapters"
MAX_LORA_LABEL = "max_lora"
LORA_LOADS = "hpi:lora_loads"  # adapters copied into a device slot (from host memory, read from disk if evicted)
LORA_EVICTIONS = "hpi:lora_evictions"  # adapters dropped from host memory (least recently used, --max-cpu-loras)
# Pipeline parallelism (only with --pipeline-parallel-size > 1): seconds each stage (label `stage`, its first
# tensor-parallel rank) spent computing rather than waiting for a step or the previous stage's hidden states, since
# its first step, published by the ranks about once a second. rate() of it is the stage's busy fraction.
PIPELINE_STAGE_BUSY_SECONDS = "hpi:pipeline_stage_busy_seconds"
STAGE_LABEL = "stage"
# The project's own: 1 while the server is ready to take requests (the router reads it).
READY = "hpi:ready"
# 1 while the engine sleeps (vLLM's sleep mode: POST /sleep frees its KV cache or weights; it is not ready then).
SLEEPING = "hpi:sleeping"
# The pool profile the pod was started with (`hpi serve --pool-profile`, hpi_contracts.pool_profile), labelled
# `source` (measured, assumed, override); absent when none was given. The router's prior for a new backend's speed.
PROFILE_ITL_ALPHA = "hpi:profile_itl_alpha_seconds"
PROFILE_ITL_BETA = "hpi:profile_itl_beta_seconds"
PROFILE_PREFILL_RATE = "hpi:profile_prefill_tokens_per_second"
PROFILE_MAX_NUM_SEQS = "hpi:profile_max_num_seqs"
PROFILE_GAUGES: tuple[str, ...] = (PROFILE_ITL_ALPHA, PROFILE_ITL_BETA, PROFILE_PREFILL_RATE, PROFILE_MAX_NUM_SEQS)
# Optional beside them: the fleet optimizer's planned most sequences within the SLO (pool_profile.py).
PROFILE_SLO_MAX_NUM_SEQS = "hpi:profile_slo_max_num_seqs"

# The router's queue (hpi-router holds a request while no backend can take it: none ready, as when a pool scales
# from zero, or every ready one saturated). A gauge per flow, labels `tenant` and `priority`; the operator sums it
# over the router pods as demand the runtime pods cannot see (scale from zero without an annotation).
ROUTER_QUEUED_REQUESTS = "hpi:router_queued_requests"
ROUTER_QUEUE_WAIT = "hpi:router_queue_wait_seconds"  # histogram: how long each request waited, same labels
TENANT_LABEL, PRIORITY_LABEL = "tenant", "priority"
# API keys the router loaded from its tenants file (spec.routing.router.tenantsSecretRef): the operator reports the
# count in status.routing.tenantKeys, so it never reads the Secret itself.
ROUTER_TENANT_KEYS = "hpi:router_tenant_keys"
# How long the server took to start (hpi_runtime/startup.py): per phase (label `phase`), and from process start
# to ready; for whoever tunes a cold start, and the operator's start-time figures.
STARTUP_PHASE_SECONDS = "hpi:startup_phase_seconds"
STARTUP_SECONDS = "hpi:startup_seconds"
# Everything the operator reads from a router pod's /metrics.
READ_FROM_ROUTER: tuple[str, ...] = (ROUTER_QUEUED_REQUESTS, ROUTER_TENANT_KEYS)


def total(counter: str) -> str:
    """A counter's sample name as prometheus-client exposes it."""
    return f"{counter}_total"


# Everything the operator (reconciler and autoscaler) may read from a runtime pod's /metrics.
# The counters (request_success, prompt_tokens, generation_tokens) are the fleet optimizer's demand; the TTFT and
# per-request time-per-output-token histograms its observed SLO attainment.
READ_BY_OPERATOR: tuple[str, ...] = (KV_CACHE_USAGE, NUM_REQUESTS_WAITING, NUM_REQUESTS_RUNNING, NUM_PREEMPTIONS,
                                     REQUEST_SUCCESS, PROMPT_TOKENS, GENERATION_TOKENS, TIME_TO_FIRST_TOKEN,
                                     REQUEST_TIME_PER_OUTPUT_TOKEN)  # fmt: skip
# Everything the router reads.
READ_BY_ROUTER: tuple[str, ...] = (NUM_REQUESTS_RUNNING, NUM_REQUESTS_WAITING, KV_CACHE_USAGE, GENERATION_TOKENS, READY,
                                   LORA_REQUESTS_INFO, *PROFILE_GAUGES, PROFILE_SLO_MAX_NUM_SEQS)  # fmt: skip
