"""The headline fleet's pools: Llama-3.1-8B-Instruct on H200, L4 and CPU nodes, with each pool's profile, speed,
price and cold start, and where every number comes from.

Model: Llama-3.1-8B-Instruct (config.json): 32 layers, hidden 4096, 32 query heads, 8 KV heads x 128 head dim,
vocabulary 128256, 8,030,261,248 parameters, bf16 (KV: 2 x 32 x 8 x 128 x 2 bytes = 128 KiB per token).

Profiles are built with the operator's own memory arithmetic (hpi_operator.sizing) and each GPU pool's speed is
the operator's roofline estimate (hpi_operator.fleet.assumed: NVIDIA datasheet bandwidth and dense bf16 FLOPs
at the efficiencies stated there): `source: assumed`. With `h200="measured"` the H200 pool takes its measurement
instead (MEASURED_H200: `hpi profile` on an H200, bench/results/gpu/2026-12-04-h200), plus the estimate's KV
reads for the context beyond the 26 tokens that run timed decode at: `source: measured`. The L4 pool is pinned
to int8 weights (spec.placement lets a platform team pin a profile): in bf16 the 16 GB of weights leave 4 GB of
its 24 GB for KV and a 90 ms decode step at batch 1, which no 100 ms ITL target survives.

CPU: scaled from a measurement, not measured. bench/results/profiles.md measured the embedded SmolLM2-135M
(134.5M parameters, bf16) on this machine's 2 vCPUs (AMD EPYC, AVX512-BF16, no AMX): ITL 19.4 + 2.22 x b ms,
prefill 760 tokens/s. Scaled to Llama-3.1-8B on an AWS c7a.16xlarge (64 vCPUs of a 4th-generation AMD EPYC
9R14, 128 GiB, the same ISA) with these rules:
- decode's fixed part reads every weight once per step: alpha = weight bytes / effective bandwidth. The node's
  share of memory bandwidth: a c7a.48xlarge host has 2 sockets x 12 channels of DDR5-4800 = 921.6 GB/s for
  192 vCPUs, so 64 vCPUs get 307 GB/s, at the same 0.6 efficiency the GPU estimate uses: 184 GB/s
  (the measured 135M step implies 13.9 GB/s per 2 vCPUs, which scaled by vCPUs would exceed that share);
- decode's per-sequence part and prefill are compute: scaled by FLOPs per token (8.03B / 134.5M parameters)
  and by vCPUs (64 / 2): beta = 2.22 ms x 59.7 / 32, prefill = 760 tokens/s / 59.7 x 32.
KV budget: 128 GiB less the weights and the runtime's overhead, capped by 64 sequences (the engine default).

Prices: public on-demand list prices, per replica-hour (one GPU, or one CPU node):
- H200: $6.305 per GPU-hour, CoreWeave on-demand, as listed in github.com/renshuBTC/compute-screener
  data/gpu_providers_latest.csv (read_at 2026-10-24); the AWS and GCP H200 pages were not in reach here.
- L4: $0.8048 per hour, AWS g6.xlarge (1 x L4, 4 vCPUs, 16 GiB), us-east-1 on-demand
  (aws.amazon.com/ec2/pricing/on-demand), recalled, not re-read in this session.
- CPU: $3.2845 per hour, AWS c7a.16xlarge, us-east-1 on-demand (same page, same caveat).
Cold starts (pod scheduled to first request served, node already present): H200 90 s, L4 120 s (slower
weight download per node), CPU 180 s; stated assumptions, not measured.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hpi_operator.fleet.assumed import assumed_performance
from hpi_operator.fleet.performance import PoolPerformance
from hpi_operator.nodes import Pool as NodePool
from hpi_operator.profiles import PoolChoice, Profile
from hpi_operator.sizing import ModelShape, kv_bytes_per_token, overhead_bytes, weight_bytes

from .replica import EngineShape

LLAMA_31_8B = ModelShape(num_parameters=8_030_261_248, num_layers=32, num_kv_heads=8, head_dim=128,
                         hidden_size=4096, vocab_size=128_256, num_heads=32)  # fmt: skip
GIB = 1 << 30
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default share of device memory the runtime may fill

# bench/results/profiles.md, SmolLM2-135M bf16 on 2 vCPUs here
MEASURED_CPU = {"alpha_s": 0.0194, "beta_s": 0.00222, "prefill_tokens_per_s": 760.0, "parameters": 134_515_008,
                "vcpus": 2}  # fmt: skip
C7A_16XLARGE = {"vcpus": 64, "memory_bytes": 128 * GIB, "bandwidth_gbps": 921.6 * 64 / 192, "efficiency": 0.6}


@dataclass(frozen=True)
class SimPool:
    """One pool as the simulator runs it, and as the optimizer and rank-fill see it."""

    name: str
    choice: PoolChoice | None  # the operator's view: node pool + profile (rank-fill orders these); None: unranked
    engine: EngineShape
    cost_per_hour: float
    max_replicas: int
    cold_start_s: float
    cpu_performance: PoolPerformance | None = None  # fixed figures (a spec override); None: GPU roofline
    measured_gpu: dict | None = None  # a GPU measurement (MEASURED_H200); None: the roofline estimate alone

    def performance_at(self, context_tokens: float) -> PoolPerformance:
        """What the optimizer reads at a mean context: the operator's estimate (or a measurement) for GPUs, the
        override for CPUs."""
        if self.cpu_performance is not None:
            return self.cpu_performance
        perf = gpu_performance(self.choice.pool.gpu_product, self.choice.profile, context_tokens, self.measured_gpu)
        return replace(perf, max_num_seqs=min(perf.max_num_seqs, self.engine.max_num_seqs))


# bench/results/gpu/2026-12-04-h200: `hpi profile` of random bf16 weights in Llama-3.1-8B's exact shape on one H200,
# decode timed at batch 1-256 with 16-token prompts (26 tokens of context on average over the timed steps).
MEASURED_H200 = {"alpha_s": 0.0067948, "beta_s": 0.0000302, "prefill_tokens_per_s": 30326.0, "context_tokens": 26}


def gpu_performance(product: str, profile: Profile, context_tokens: float, measured: dict | None) -> PoolPerformance:
    """The roofline estimate at `context_tokens`; with a measurement, its alpha and prefill, and its beta plus the
    estimate's KV reads for the context beyond the one it was measured at (the measurement's decode steps read
    26 tokens of KV per sequence; at the workload's 1,260 each step reads 48x more, which the estimate prices at
    0.6 of the datasheet bandwidth): `source: measured`."""
    perf = assumed_performance(product, profile, LLAMA_31_8B, context_tokens)
    assert perf is not None  # GPU pools here all have published figures
    if measured is None:
        return perf
    at_measured = assumed_performance(product, profile, LLAMA_31_8B, measured["context_tokens"])
    beta = measured["beta_s"] + perf.itl_beta_s - at_measured.itl_beta_s
    return PoolPerformance(measured["alpha_s"], beta, measured["prefill_tokens_per_s"], perf.max_num_seqs,
                           source="measured")  # fmt: skip


def _gpu_profile(memory_bytes: int, quantization: str) -> Profile:
    weights = weight_bytes(LLAMA_31_8B, "bf16", quantization)
    overhead = overhead_bytes(weights, 1)
    budget = int(memory_bytes * GPU_MEMORY_UTILIZATION)
    return Profile(device="cuda", dtype="bf16", quantization=quantization, num_gpus=1, weight_bytes=weights,
                   kv_cache_bytes=budget - weights - overhead, overhead_bytes=overhead,
                   memory_budget_bytes=budget)  # fmt: skip


def gpu_pool(name: str, product: str, memory_gib: float, quantization: str, *, price: float, max_replicas: int,
             cold_start_s: float, max_num_seqs: int, max_num_batched_tokens: int,
             context_tokens: float, measured: dict | None = None) -> SimPool:  # fmt: skip
    profile = _gpu_profile(int(memory_gib * GIB), quantization)
    node_pool = NodePool(name=name, device="cuda", node_names=(f"{name}-node",), gpu_product=product,
                         gpu_memory_mib=int(memory_gib * 1024), gpus_per_node=(max_replicas,),
                         gpu_bf16=True)  # fmt: skip
    choice = PoolChoice(node_pool, profile, "fleet-sim", capacity=max_replicas)
    perf = gpu_performance(product, profile, context_tokens, measured)
    kv_tokens = profile.kv_cache_bytes // kv_bytes_per_token(LLAMA_31_8B, "bf16")
    engine = EngineShape(perf, kv_tokens, max_num_seqs, max_num_batched_tokens)
    return SimPool(name, choice, engine, price, max_replicas, cold_start_s, measured_gpu=measured)


def cpu_performance(max_num_seqs: int) -> PoolPerformance:
    """Scaled from the 135M measurement to the 8B model on a c7a.16xlarge (module docstring)."""
    flops_ratio = LLAMA_31_8B.num_parameters / MEASURED_CPU["parameters"]
    vcpu_ratio = C7A_16XLARGE["vcpus"] / MEASURED_CPU["vcpus"]
    bandwidth = C7A_16XLARGE["bandwidth_gbps"] * 1e9 * C7A_16XLARGE["efficiency"]
    return PoolPerformance(
        itl_alpha_s=weight_bytes(LLAMA_31_8B, "bf16", "none") / bandwidth,
        itl_beta_s=MEASURED_CPU["beta_s"] * flops_ratio / vcpu_ratio,
        prefill_tokens_per_s=MEASURED_CPU["prefill_tokens_per_s"] / flops_ratio * vcpu_ratio,
        max_num_seqs=max_num_seqs,
        source="override",
    )


def cpu_pool(name: str, *, price: float, max_replicas: int, cold_start_s: float, max_num_seqs: int = 64) -> SimPool:
    weights = weight_bytes(LLAMA_31_8B, "bf16", "none")
    overhead = overhead_bytes(weights, 0)
    kv_bytes = C7A_16XLARGE["memory_bytes"] - weights - overhead - 8 * GIB  # the OS and the kubelet keep 8 GiB
    profile = Profile(device="cpu", dtype="bf16", quantization="none", num_gpus=0, weight_bytes=weights,
                      kv_cache_bytes=kv_bytes, overhead_bytes=overhead,
                      memory_budget_bytes=C7A_16XLARGE["memory_bytes"])  # fmt: skip
    node_pool = NodePool(name=name, device="cpu", node_names=(f"{name}-node",), cpu_bf16=True,
                         memory_bytes_per_node=(C7A_16XLARGE["memory_bytes"],))  # fmt: skip
    choice = PoolChoice(node_pool, profile, "fleet-sim", capacity=max_replicas)
    perf = cpu_performance(max_num_seqs)
    engine = EngineShape(perf, kv_bytes // kv_bytes_per_token(LLAMA_31_8B, "bf16"), max_num_seqs, 2048)
    return SimPool(name, choice, engine, price, max_replicas, cold_start_s, cpu_performance=perf)


def headline_pools(context_tokens: float, h200_max: int = 8, l4_max: int = 400, cpu_max: int = 100,
                   h200: str = "assumed") -> list[SimPool]:  # fmt: skip
    """The mixed fleet: a few H200s (one node's worth is what a team gets), many L4s, CPU nodes. `h200`:
    "assumed" (the roofline estimate) or "measured" (MEASURED_H200, plus the estimate's KV reads)."""
    if h200 not in ("assumed", "measured"):
        raise ValueError(f"h200 must be 'assumed' or 'measured', got {h200!r}")
    return [
        gpu_pool(
            "h200-bf16",
            "NVIDIA-H200",
            141,
            "none",
            price=6.305,
            max_replicas=h200_max,
            cold_start_s=90,
            max_num_seqs=512,
            max_num_batched_tokens=8192,
            context_tokens=context_tokens,
            measured=MEASURED_H200 if h200 == "measured" else None,
        ),
        gpu_pool(
            "l4-int8",
            "NVIDIA-L4",
            24,
            "int8",
            price=0.8048,
            max_replicas=l4_max,
            cold_start_s=120,
            max_num_seqs=128,
            max_num_batched_tokens=2048,
            context_tokens=context_tokens,
        ),
        cpu_pool("cpu-bf16", price=3.2845, max_replicas=cpu_max, cold_start_s=180),
    ]
