"""Prometheus metrics under vLLM's names (the ecosystem's contract, spelled in hpi_contracts.metrics) plus
`hpi:` extras.

Each server owns its own CollectorRegistry (no process-global state). Gauges and counters are brought up
to date from the engine's cumulative stats whenever /metrics is scraped, so the numbers are exact at scrape
time and the engine loop pays nothing per step; latency histograms are observed by the request handlers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hpi_contracts import metrics as names
from hpi_contracts.pool_profile import PoolProfile
from hpi_runtime.config import CacheConfig
from hpi_runtime.core.interface import MemoryFootprint

CACHE_CONFIG_LABELS = ("block_size", "cache_dtype", "enable_prefix_caching", "num_gpu_blocks", "num_cpu_blocks")

LATENCY_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                     7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
# vLLM's token-count buckets (its build_1_2_5_buckets), here up to a million tokens whatever the model's length.
TOKEN_BUCKETS = tuple(m * 10**e for e in range(7) for m in (1, 2, 5))[:-2]


class ServingMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = [names.MODEL_NAME_LABEL]
        reg = self.registry
        self._running = Gauge(names.NUM_REQUESTS_RUNNING, "Requests in the running batch.", labels, registry=reg)
        self._waiting = Gauge(names.NUM_REQUESTS_WAITING, "Requests waiting to be scheduled.", labels,
                              registry=reg)
        self._kv_usage = Gauge(names.KV_CACHE_USAGE, "KV-cache usage, 0 to 1 (1 = full).", labels,
                               registry=reg)
        self._prompt_tokens = Counter(names.PROMPT_TOKENS, "Prefill tokens processed.", labels, registry=reg)
        self._generation_tokens = Counter(names.GENERATION_TOKENS, "Generated tokens.", labels, registry=reg)
        self._preemptions = Counter(names.NUM_PREEMPTIONS, "Preemptions (recompute).", labels, registry=reg)
        self._prefix_queries = Counter(names.PREFIX_CACHE_QUERIES, "Prefix-cache queries, in tokens.", labels,
                                       registry=reg)
        self._prefix_hits = Counter(names.PREFIX_CACHE_HITS, "Prefix-cache hits, in tokens.", labels,
                                    registry=reg)
        self._spec_drafts = Counter(names.SPEC_DECODE_NUM_DRAFTS, "Speculative decoding: verifications (request-steps "
                                    "with draft tokens).", labels, registry=reg)
        self._spec_draft_tokens = Counter(names.SPEC_DECODE_NUM_DRAFT_TOKENS, "Speculative decoding: draft tokens "
                                          "verified.", labels, registry=reg)
        self._spec_accepted = Counter(names.SPEC_DECODE_NUM_ACCEPTED_TOKENS, "Speculative decoding: draft tokens "
                                      "accepted.", labels, registry=reg)
        self._spec_accepted_per_pos = Counter(names.SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS, "Speculative "
                                              "decoding: draft tokens accepted at each draft position.",
                                              labels + [names.POSITION_LABEL], registry=reg)  # fmt: skip
        self._success = Counter(names.REQUEST_SUCCESS, "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=reg)
        self._ttft = Histogram(names.TIME_TO_FIRST_TOKEN, "Time to first token.", labels,
                               buckets=LATENCY_BUCKETS_S, registry=reg)
        self._itl = Histogram(names.INTER_TOKEN_LATENCY, "Time between output tokens.", labels,
                              buckets=ITL_BUCKETS_S, registry=reg)
        self._tpot = Histogram(names.REQUEST_TIME_PER_OUTPUT_TOKEN, "Mean time per output token of each request "
                               "with two or more: (e2e - TTFT) / (output tokens - 1).", labels,
                               buckets=ITL_BUCKETS_S, registry=reg)  # fmt: skip
        self._e2e = Histogram(names.E2E_REQUEST_LATENCY, "End-to-end request latency.", labels,
                              buckets=LATENCY_BUCKETS_S, registry=reg)
        self._queue = Histogram(names.REQUEST_QUEUE_TIME, "Time spent waiting before scheduling.",
                                labels, buckets=LATENCY_BUCKETS_S, registry=reg)
        self._request_prompt = Histogram(names.REQUEST_PROMPT_TOKENS, "Prompt tokens of each finished request.",
                                         labels, buckets=TOKEN_BUCKETS, registry=reg)  # fmt: skip
        self._request_generation = Histogram(names.REQUEST_GENERATION_TOKENS, "Generated tokens of each finished "
                                             "request.", labels, buckets=TOKEN_BUCKETS, registry=reg)  # fmt: skip
        self._weight_bytes = Gauge("hpi:model_weight_bytes", "Bytes of model weights on the device.", labels,
                                   registry=reg)
        self._kv_bytes = Gauge("hpi:kv_cache_bytes", "Bytes reserved for the paged KV cache.", labels,
                               registry=reg)
        self._kv_blocks = Gauge("hpi:kv_cache_blocks", "KV-cache blocks in the pool.", labels, registry=reg)
        self._block_size = Gauge("hpi:kv_cache_block_size_tokens", "Tokens per KV-cache block.", labels,
                                 registry=reg)
        self._cache_config = Gauge(names.CACHE_CONFIG_INFO, "1, labelled with the KV cache's configuration (vLLM's "
                                   "labels).", labels + list(CACHE_CONFIG_LABELS), registry=reg)  # fmt: skip
        self._ready = Gauge(names.READY, "1 when the server accepts requests.", labels, registry=reg)
        self._sleeping = Gauge(names.SLEEPING, "1 while the engine sleeps (POST /sleep; not ready).", labels,
                               registry=reg)
        self._sleeping.labels(model_name).set(0)
        self._startup_phase = Gauge(names.STARTUP_PHASE_SECONDS, "Seconds each start-up phase took (imports, "
                                    "prepare, core_process, load, quantize, layout, kv_cache, compile, warm_up).",
                                    labels + ["phase"], registry=reg)  # fmt: skip
        self._startup = Gauge(names.STARTUP_SECONDS, "Seconds from process start to ready.", labels, registry=reg)
        self._quantization = Gauge("hpi:quantization_info", "1, labelled with the weights' quantization: method "
                                   "(none|int8|int4) and scheme (e.g. int4-g32-mse-mixed, gptq-int4-g128).",
                                   labels + ["method", "scheme"], registry=reg)  # fmt: skip
        self._host_usage = Gauge("hpi:kv_host_cache_usage_perc", "Host KV tier usage, 0 to 1: blocks held by "
                                 "swapped-out requests or copies in flight (offloaded prefix blocks count as free, "
                                 "as cached blocks do in vllm:kv_cache_usage_perc).", labels, registry=reg)
        self._host_cached = Gauge("hpi:kv_host_cache_cached_blocks", "Host KV tier blocks holding offloaded "
                                  "prefix KV, reusable by hash.", labels, registry=reg)
        self._host_bytes = Gauge("hpi:kv_host_cache_bytes", "Bytes of host memory reserved for the host KV tier "
                                 "(0: off).", labels, registry=reg)
        self._host_blocks = Gauge("hpi:kv_host_cache_blocks", "Blocks in the host KV tier.", labels, registry=reg)
        self._tier_hits = Counter("hpi:prefix_cache_hits_by_tier", "Prefix-cache hits in tokens, by the tier that "
                                  "held them (device, host); they add up to vllm:prefix_cache_hits.",
                                  labels + ["tier"], registry=reg)
        self._blocks_moved = Counter("hpi:kv_blocks_transferred", "KV blocks copied between the device cache and "
                                     "the host tier (to_host: offloads and swaps; to_device: loads).",
                                     labels + ["direction"], registry=reg)
        self._bytes_moved = Counter("hpi:kv_bytes_transferred", "Bytes copied between the device cache and the "
                                    "host tier, summed over tensor-parallel ranks.", labels + ["direction"],
                                    registry=reg)
        self._preemption_modes = Counter("hpi:preemptions_by_mode", "Preemptions by how the request resumes: swap "
                                         "(its KV kept in the host tier) or recompute.", labels + ["mode"],
                                         registry=reg)
        self._prefill_computed = Counter("hpi:prefill_tokens_computed", "Tokens run through the model to build "
                                         "the KV of known tokens (prompts, recomputes after preemption): what "
                                         "prefix caching and the host tier save.", labels, registry=reg)
        self._encoder_queries = Counter("hpi:encoder_cache_queries", "Images whose vision-encoder embeddings a "
                                        "prefill needed.", labels, registry=reg)
        self._encoder_hits = Counter("hpi:encoder_cache_hits", "Images found in the encoder cache (by content "
                                     "hash): not encoded again.", labels, registry=reg)
        self._encoder_usage = Gauge("hpi:encoder_cache_usage_perc", "Encoder cache usage, 0 to 1: embedding rows "
                                    "held for running requests (kept rows nobody uses count as free).", labels,
                                    registry=reg)  # fmt: skip
        self._stage_busy = Counter(names.PIPELINE_STAGE_BUSY_SECONDS, "Seconds each pipeline stage spent computing "
                                   "rather than waiting (rate(): its busy fraction).", labels + [names.STAGE_LABEL],
                                   registry=reg)  # fmt: skip
        profile_labels = labels + ["source"]
        self._profile = {
            names.PROFILE_ITL_ALPHA: Gauge(names.PROFILE_ITL_ALPHA, "Pool profile: decode step time with an empty "
                                           "batch (ITL = alpha + beta x batch).", profile_labels, registry=reg),
            names.PROFILE_ITL_BETA: Gauge(names.PROFILE_ITL_BETA, "Pool profile: decode step time added per "
                                          "sequence in the batch.", profile_labels, registry=reg),
            names.PROFILE_PREFILL_RATE: Gauge(names.PROFILE_PREFILL_RATE, "Pool profile: prefill tokens per "
                                              "second.", profile_labels, registry=reg),
            names.PROFILE_MAX_NUM_SEQS: Gauge(names.PROFILE_MAX_NUM_SEQS, "Pool profile: the most sequences the "
                                              "KV cache holds at the profiled context.", profile_labels,
                                              registry=reg),
            names.PROFILE_SLO_MAX_NUM_SEQS: Gauge(names.PROFILE_SLO_MAX_NUM_SEQS, "Pool profile: the most "
                                                  "sequences within the SLO, as the fleet optimizer plans the pool "
                                                  "(absent without a plan).", profile_labels, registry=reg),
        }  # fmt: skip
        self._max_loras: int | None = None  # set_max_loras: LoRA is on
        self._model = model_name
        self._block_bytes = 0  # bytes of one KV block over all ranks, once the footprint is known
        self._last: dict[str, float] = {}
        for counter in (self._prompt_tokens, self._generation_tokens, self._preemptions, self._prefix_queries,
                        self._prefix_hits, self._prefill_computed):
            counter.labels(model_name)  # exported at 0 from the start
        for counter, values in ((self._tier_hits, ("device", "host")), (self._blocks_moved, ("to_host", "to_device")),
                                (self._bytes_moved, ("to_host", "to_device")),
                                (self._preemption_modes, ("swap", "recompute"))):
            for value in values:
                counter.labels(model_name, value)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        for histogram in (self._ttft, self._itl, self._tpot, self._e2e, self._queue, self._request_prompt,
                          self._request_generation):
            histogram.labels(model_name)  # empty buckets from the start, so queries over them never go missing
        for gauge in (self._running, self._waiting, self._kv_usage):
            gauge.labels(model_name).set(0)

    def set_footprint(self, footprint: MemoryFootprint) -> None:
        self._weight_bytes.labels(self._model).set(footprint.weight_bytes)
        self._kv_bytes.labels(self._model).set(footprint.kv_cache_bytes)
        self._kv_blocks.labels(self._model).set(footprint.num_kv_blocks)
        self._block_size.labels(self._model).set(footprint.block_size)
        self._host_bytes.labels(self._model).set(footprint.host_kv_cache_bytes)
        self._host_blocks.labels(self._model).set(footprint.num_host_kv_blocks)
        self._block_bytes = footprint.kv_cache_bytes // max(footprint.num_kv_blocks, 1)

    def set_cache_config(self, cache: CacheConfig, footprint: MemoryFootprint) -> None:
        values = {"block_size": footprint.block_size, "cache_dtype": cache.kv_cache_dtype,
                  "enable_prefix_caching": cache.enable_prefix_caching, "num_gpu_blocks": footprint.num_kv_blocks,
                  "num_cpu_blocks": footprint.num_host_kv_blocks}  # fmt: skip
        self._cache_config.clear()
        self._cache_config.labels(self._model, *(str(values[name]) for name in CACHE_CONFIG_LABELS)).set(1)

    def set_pool_profile(self, profile: PoolProfile | None) -> None:
        """Export `profile` as the only profile series (None: none): a profile that moved from assumed to
        measured must not leave its assumed series behind for the router to read."""
        for gauge in self._profile.values():
            gauge.clear()
        if profile is None:
            return
        values = {names.PROFILE_ITL_ALPHA: profile.itl_alpha_ms / 1000,
                  names.PROFILE_ITL_BETA: profile.itl_beta_ms / 1000,
                  names.PROFILE_PREFILL_RATE: profile.prefill_tokens_per_s,
                  names.PROFILE_MAX_NUM_SEQS: profile.max_num_seqs}  # fmt: skip
        if profile.slo_max_num_seqs is not None:
            values[names.PROFILE_SLO_MAX_NUM_SEQS] = profile.slo_max_num_seqs
        for name, value in values.items():
            self._profile[name].labels(self._model, profile.source).set(value)

    def set_startup(self, phases: Mapping[str, float], total_s: float | None) -> None:
        """How long start-up took, per phase (hpi_runtime/startup.py) and from process start to ready."""
        for phase, seconds in phases.items():
            self._startup_phase.labels(self._model, phase).set(seconds)
        if total_s is not None:
            self._startup.labels(self._model).set(total_s)

    def set_quantization(self, method: str, scheme: str) -> None:
        self._quantization.labels(self._model, method, scheme).set(1)

    def set_max_loras(self, max_loras: int) -> None:
        """LoRA is on: export vllm:lora_requests_info and the adapter counters (at 0 from the start)."""
        reg, labels = self.registry, [names.MODEL_NAME_LABEL]
        self._max_loras = max_loras
        self._lora_info = Gauge(names.LORA_REQUESTS_INFO, "Running and waiting LoRA adapters (labels, comma-separated) "
                                "and max_lora; the value is when it was set.", [names.RUNNING_LORA_ADAPTERS_LABEL,
                                names.WAITING_LORA_ADAPTERS_LABEL, names.MAX_LORA_LABEL], registry=reg)  # fmt: skip
        self._lora_loads = Counter(names.LORA_LOADS, "LoRA adapters copied into a device slot.", labels, registry=reg)
        self._lora_evictions = Counter(names.LORA_EVICTIONS, "LoRA adapters dropped from host memory (least "
                                       "recently used).", labels, registry=reg)  # fmt: skip
        self._lora_loads.labels(self._model)
        self._lora_evictions.labels(self._model)
        self._lora_info.labels("", "", str(max_loras)).set_to_current_time()

    def _refresh_lora(self, stats) -> None:
        if self._max_loras is None:
            return
        # One series at a time (vLLM adds one per change and leaves the old ones): the current adapters.
        self._lora_info.clear()
        self._lora_info.labels(",".join(stats.lora_running), ",".join(stats.lora_waiting),
                               str(self._max_loras)).set_to_current_time()  # fmt: skip
        self._advance("lora_loads", stats.lora_slot_loads, self._lora_loads.labels(self._model))
        self._advance("lora_evictions", stats.lora_host_evictions, self._lora_evictions.labels(self._model))

    def set_ready(self, ready: bool) -> None:
        self._ready.labels(self._model).set(1 if ready else 0)

    def set_sleeping(self, sleeping: bool) -> None:
        self._sleeping.labels(self._model).set(1 if sleeping else 0)

    def refresh(self, stats) -> None:
        """Bring gauges and counters up to the engine's cumulative `EngineStats`."""
        model = self._model
        self._running.labels(model).set(stats.num_running)
        self._waiting.labels(model).set(stats.num_waiting)
        self._kv_usage.labels(model).set(stats.kv_cache_usage)
        for name, counter in (
            ("num_prompt_tokens", self._prompt_tokens),
            ("num_generation_tokens", self._generation_tokens),
            ("num_preemptions", self._preemptions),
            ("prefix_cache_queries", self._prefix_queries),
            ("prefix_cache_hits", self._prefix_hits),
            ("spec_num_drafts", self._spec_drafts),
            ("spec_num_draft_tokens", self._spec_draft_tokens),
            ("spec_num_accepted_tokens", self._spec_accepted),
        ):
            self._advance(name, int(getattr(stats, name)), counter.labels(model))
        for position, accepted in enumerate(stats.spec_accepted_per_pos):
            self._advance(f"spec_pos_{position}", accepted, self._spec_accepted_per_pos.labels(model, str(position)))
        self._host_usage.labels(model).set(stats.kv_host_usage)
        self._encoder_usage.labels(model).set(stats.encoder_cache_usage)
        self._host_cached.labels(model).set(stats.kv_host_cached_blocks)
        block_bytes = self._block_bytes
        for key, total, child in (
            ("prefill", stats.num_prefill_tokens_computed, self._prefill_computed.labels(model)),
            ("hits_device", stats.prefix_cache_hits - stats.prefix_cache_host_hits,
             self._tier_hits.labels(model, "device")),
            ("hits_host", stats.prefix_cache_host_hits, self._tier_hits.labels(model, "host")),
            ("to_host", stats.kv_blocks_to_host, self._blocks_moved.labels(model, "to_host")),
            ("to_device", stats.kv_blocks_to_device, self._blocks_moved.labels(model, "to_device")),
            ("bytes_to_host", stats.kv_blocks_to_host * block_bytes, self._bytes_moved.labels(model, "to_host")),
            ("bytes_to_device", stats.kv_blocks_to_device * block_bytes, self._bytes_moved.labels(model, "to_device")),
            ("swap", stats.num_swapped_preemptions, self._preemption_modes.labels(model, "swap")),
            ("recompute", stats.num_preemptions - stats.num_swapped_preemptions,
             self._preemption_modes.labels(model, "recompute")),
            ("encoder_queries", stats.encoder_cache_queries, self._encoder_queries.labels(model)),
            ("encoder_hits", stats.encoder_cache_hits, self._encoder_hits.labels(model)),
        ):  # fmt: skip
            self._advance(key, total, child)
        for stage, busy_s in enumerate(stats.pipeline_stage_busy_s):
            self._advance(f"stage_busy_{stage}", busy_s, self._stage_busy.labels(model, str(stage)))
        self._refresh_lora(stats)

    def _advance(self, key: str, total: float, child) -> None:
        """Bring one counter up to the engine's cumulative total."""
        delta = total - self._last.get(key, 0)
        if delta > 0:
            child.inc(delta)
        self._last[key] = total

    def observe_request(self, timing: RequestTiming, finish_reason: str) -> None:
        model = self._model
        self._success.labels(model, finish_reason).inc()
        if timing.first_token_s is not None:
            self._ttft.labels(model).observe(timing.first_token_s)
        for gap in timing.inter_token_s:
            self._itl.labels(model).observe(gap)
        self._e2e.labels(model).observe(timing.e2e_s)
        tpot = timing.time_per_output_token_s
        if tpot is not None:
            self._tpot.labels(model).observe(tpot)
        if timing.queue_s is not None:
            self._queue.labels(model).observe(timing.queue_s)
        self._request_prompt.labels(model).observe(timing.num_prompt_tokens)
        self._request_generation.labels(model).observe(timing.num_output_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(frozen=True)
class RequestTiming:
    first_token_s: float | None
    inter_token_s: tuple[float, ...]
    e2e_s: float
    queue_s: float | None
    num_output_tokens: int = 0
    num_prompt_tokens: int = 0

    @property
    def time_per_output_token_s(self) -> float | None:
        """vLLM's per-request mean ITL: the time after the first token over the tokens after it; None below two
        tokens (no gap to average)."""
        if self.first_token_s is None or self.num_output_tokens < 2:
            return None
        return max(0.0, self.e2e_s - self.first_token_s) / (self.num_output_tokens - 1)
