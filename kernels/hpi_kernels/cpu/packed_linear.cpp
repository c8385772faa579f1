// fp32 linear layers over weights prepacked into column panels: the GEMMs of decode steps (a few to a few
// hundred rows against weights read once per step), where MKL's sgemm packs the weight again on every call
// and reaches ~40% of the FMA peak at 8-64 rows.
//
// - pack_linear_weight: the weight [N, K] becomes panels of kNr output columns, panel p a contiguous
//   [K, kNr] block (columns past N are zeros), so that a panel streams sequentially.
// - packed_linear: threads split the panels (at::parallel_for); for each panel, the rows run kMr at a
//   time with kMr x kNrVecs accumulators in registers (per k: kNrVecs loads of the panel, kMr broadcasts of
//   x, kMr * kNrVecs FMAs). While a panel's row tiles compute, each tile prefetches its share of the
//   thread's next panel into L2, so the weight's stream from memory overlaps the FMAs instead of
//   stalling the first tile of every panel: that overlap is most of the gain at 8-128 rows.
//   Rows are cut into chunks of kMc (x's chunk stays in L2 while the panels stream past). K is not cut
//   into blocks: at 16-320 rows, blocks of 64-256 measured 2-15% slower than whole panels from L2.
//
// bf16 weights pack as pairs of k and run packed_linear_bf16.cpp's kernel (same tile, widened to fp32);
// the ops here take either dtype.
//
// Built by hpi_kernels/cpu/_extension.py with the flags of torch's own CPU capability, so Vec is 16 (AVX512),
// 8 (AVX2) or 4/8 (other) lanes wide and the panel width kNr follows it; the packed tensor's panel dimension
// records it (dimension 2, in either dtype), and packed_linear checks it.

#include "packed_linear.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace hpi_packed;
constexpr int64_t kMaxPackedRows = 320;       // more rows (prefill): unpack the weight and call at::mm,
constexpr int64_t kMaxUnpackedFloats = 1 << 24;  // for weights of up to 64 MiB (not a vocabulary's LM head)
// bf16 panels under fp32 x from this many rows: packed_gemm_widened. AVX2 only: there the widen tile holds 5 rows
// (the fp32 one 6) and widens a panel 7 times for 32; the AVX512 widen tile holds 12, as many as the fp32 one, so
// widening once would save little there (not measured: no AVX512 CPU in reach when this was written).
constexpr int64_t kWidenOnceRows = kVecSize >= 16 ? std::numeric_limits<int64_t>::max() : 12;

// c[r, 0:ncols] = sum_k a[r, k] * b[k, 0:kNr] for r < R, k < K; b is one packed panel. The tile also
// prefetches rows k = phase, phase + step, ... of `next` (the thread's next panel, or nullptr) into L2: with
// `step` tiles per panel, the tiles share that panel's prefetch between them.
template <int R>
inline void tile(const float* a, int64_t lda, const float* b, int64_t K, float* c, int64_t ldc, int64_t ncols,
                 const float* next, int64_t phase, int64_t step) {
  Vec acc[R][kNrVecs];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kNrVecs; ++v) acc[r][v] = Vec(0.f);
  }
  int64_t countdown = phase;
  for (int64_t k = 0; k < K; ++k) {
    Vec bv[kNrVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kNrVecs; ++v) bv[v] = Vec::loadu(b + k * kNr + v * kVecSize);
    prefetch_rows(b, next, k, countdown, step);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Vec av(a[r * lda + k]);
#pragma GCC unroll 4
      for (int v = 0; v < kNrVecs; ++v) acc[r][v] = at::vec::fmadd(av, bv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kNrVecs; ++v) {
      const int64_t count = std::clamp<int64_t>(ncols - v * kVecSize, 0, kVecSize);
      if (ncols == kNr) {
        acc[r][v].store(c + r * ldc + v * kVecSize);
      } else if (count > 0) {  // the last panel of an N that is not a multiple of kNr
        acc[r][v].store(c + r * ldc + v * kVecSize, count);
      }
    }
  }
}

at::Tensor pack_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK_VALUE(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16)
                        && weight.device().is_cpu(),
                    "pack_linear_weight takes a float32 or bfloat16 CPU weight [out_features, in_features], got ",
                    weight.scalar_type(), " ", weight.sizes(), " on ", weight.device());
  if (weight.scalar_type() == at::kBFloat16) return pack_bf16(weight);
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kNr - 1) / kNr;
  at::Tensor packed = at::zeros({panels, K, kNr}, weight.options());
  const auto w = weight.accessor<float, 2>();  // any strides: row- or column-major as loaded
  float* out = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t ncols = std::min(kNr, N - p * kNr);
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t j = 0; j < ncols; ++j) out[(p * K + k) * kNr + j] = w[p * kNr + j][k];
      }
    }
  });
  return packed;
}

// The packed weight's in_features (K), after checking it against out_features and x's dtype: the weight's own, or
// bf16 panels under fp32 x (an fp32 model's weights that are bf16 values, kept at half the bytes).
int64_t check_packed(const at::Tensor& packed, int64_t out_features, at::ScalarType dtype) {
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  const int64_t dims = bf16 ? 4 : 3;
  TORCH_CHECK_VALUE(packed.dim() == dims && packed.size(2) == kNr && (!bf16 || packed.size(3) == 2) &&
                        (packed.scalar_type() == dtype || (bf16 && dtype == at::kFloat)) && packed.is_contiguous() &&
                        packed.device().is_cpu(),
                    "packed weight must be a contiguous CPU tensor from pack_linear_weight: float32 [panels, "
                    "in_features, ", kNr, "] under float32 x, or bfloat16 [panels, in_features / 2, ", kNr,
                    ", 2] under bfloat16 or float32 x; x is ", dtype, ", the weight ", packed.scalar_type(), " ",
                    packed.sizes());
  TORCH_CHECK_VALUE(out_features > (packed.size(0) - 1) * kNr && out_features <= packed.size(0) * kNr,
                    "out_features ", out_features, " does not fit a packed weight of ", packed.size(0),
                    " panels of ", kNr, " columns");
  return bf16 ? 2 * packed.size(1) : packed.size(1);  // bf16: K, or K + 1 (x then tells)
}

// out [M, N] = a [M, K] @ the packed weight's [K, N] (row stride of a: lda; out contiguous).
void packed_gemm(const float* a, int64_t lda, const float* packed, int64_t M, int64_t K, int64_t N, float* out) {
  const int64_t panels = (N + kNr - 1) / kNr;
  for (int64_t m0 = 0; m0 < M; m0 += kMc) {
    const int64_t mc = std::min(kMc, M - m0);
    const int64_t tiles = (mc + kMr - 1) / kMr;
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const float* panel = packed + p * K * kNr;
        const float* next = p + 1 < p1 ? panel + K * kNr : nullptr;
        const int64_t ncols = std::min(kNr, N - p * kNr);
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t m = m0 + t * kMr, rows = std::min<int64_t>(kMr, m0 + mc - m);
          with_rows<kMr>(rows, [&](auto height) {
            tile<decltype(height)::value>(a + m * lda, lda, panel, K, out + m * N + p * kNr, N, ncols, next, t, tiles);
          });
        }
      }
    });
  }
}

// packed_gemm over bf16 panels (an fp32 model's weights that are bf16 values) for more rows than one tile: each
// panel widened once into a per-thread fp32 panel in L2, then the fp32 tiles over it, where gemm_bf16_weight's
// widen tile widens the panel again for every tile of rows (a 32-row decode step: 7 times; 0.86x the fp32 panels'
// speed on an AVX2 EPYC, 0.98x this way, bench/results/embedded_bf16.md). The same products summed in the same k order as both: the
// same results bit for bit. The next panel's pairs are prefetched into L2 while this one is widened.
void packed_gemm_widened(const float* a, int64_t lda, const c10::BFloat16* packed, int64_t M, int64_t K, int64_t N,
                         float* out) {
  using IVec = at::vec::Vectorized<int32_t>;
  const int64_t pairs = (K + 1) / 2, panels = (N + kNr - 1) / kNr, panel_pairs = pairs * kNr;
  const auto* packed32 = reinterpret_cast<const int32_t*>(packed);  // a (k, k + 1) pair per int32 lane
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    static thread_local std::vector<float> widened;
    if (widened.size() < static_cast<size_t>(2 * panel_pairs)) widened.resize(2 * panel_pairs);
    float* w = widened.data();
    const IVec shift(16), high(static_cast<int32_t>(0xffff0000u));
    for (int64_t p = p0; p < p1; ++p) {
      const int32_t* panel = packed32 + p * panel_pairs;
      const int32_t* next = p + 1 < p1 ? panel + panel_pairs : nullptr;
      for (int64_t q = 0; q < pairs; ++q) {
        if (next != nullptr) __builtin_prefetch(next + q * kNr, 0, 2);
        for (int64_t v = 0; v < kNrVecs; ++v) {
          const IVec lanes = IVec::loadu(panel + q * kNr + v * kVecSize);
          at::vec::cast<float>(lanes << shift).store(w + 2 * q * kNr + v * kVecSize);  // row 2q: the high halves
          at::vec::cast<float>(lanes & high).store(w + (2 * q + 1) * kNr + v * kVecSize);
        }
      }
      const int64_t ncols = std::min(kNr, N - p * kNr);
      for (int64_t m0 = 0; m0 < M; m0 += kMc) {
        const int64_t mc = std::min(kMc, M - m0), tiles = (mc + kMr - 1) / kMr;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t m = m0 + t * kMr, rows = std::min<int64_t>(kMr, m0 + mc - m);
          with_rows<kMr>(rows, [&](auto height) {
            tile<decltype(height)::value>(a + m * lda, lda, w, K, out + m * N + p * kNr, N, ncols, nullptr, 0, 1);
          });
        }
      }
    }
  });
}

// The packed bf16 weight as bf16 [K, N] row-major, into a per-thread scratch buffer (bf16_prefill_gemm's path).
at::Tensor unpacked_weight_bf16(const at::Tensor& packed, int64_t K, int64_t N) {
  static thread_local at::Tensor scratch;
  if (!scratch.defined() || scratch.numel() < K * N) scratch = at::empty({K * N}, packed.options());
  unpack_bf16(packed.const_data_ptr<c10::BFloat16>(), K, N, scratch.data_ptr<c10::BFloat16>());
  return scratch.narrow(0, 0, K * N).view({K, N});
}

// The weight back as fp32 [K, N] row-major (column-major [N, K]; bf16 widened), into a per-thread scratch
// buffer reused across calls: for prefill-sized GEMMs, where MKL's own packing pays for itself and copying
// the weight once costs 2-7% of the GEMM.
at::Tensor unpacked_weight(const at::Tensor& packed, int64_t K, int64_t N) {
  static thread_local at::Tensor scratch;
  if (!scratch.defined() || scratch.numel() < K * N) scratch = at::empty({K * N}, packed.options().dtype(at::kFloat));
  float* dst = scratch.data_ptr<float>();
  if (packed.scalar_type() == at::kBFloat16) {
    unpack_bf16(packed.const_data_ptr<c10::BFloat16>(), K, N, dst);
    return scratch.narrow(0, 0, K * N).view({K, N});
  }
  const int64_t panels = packed.size(0);
  const float* src = packed.const_data_ptr<float>();
  at::parallel_for(0, K, 16, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      for (int64_t p = 0; p < panels; ++p) {
        const int64_t ncols = std::min(kNr, N - p * kNr);
        std::copy_n(src + (p * K + k) * kNr, ncols, dst + k * N + p * kNr);
      }
    }
  });
  return scratch.narrow(0, 0, K * N).view({K, N});
}

// fp32_out: the fp32 sums come out unrounded whatever x's dtype (packed_logits). residual [..., out_features] in x's
// dtype, or none: added to the result (a decoder layer's residual stream, the add folded into the GEMM where the
// GEMM is oneDNN's or MKL's, as Inductor folds it into addmm over torch's own linears; after the vector and AMX
// tiles, whose outputs are small enough to stay in cache).
at::Tensor packed_linear_to(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                            const std::optional<at::Tensor>& bias, bool fp32_out,
                            const std::optional<at::Tensor>& residual = std::nullopt) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE((x.scalar_type() == at::kFloat || bf16) && x.dim() >= 1 && x.device().is_cpu(),
                    "packed_linear takes float32 or bfloat16 CPU x [..., in_features], got ", x.scalar_type(), " ",
                    x.sizes(), " on ", x.device());
  const int64_t packed_k = check_packed(packed, out_features, x.scalar_type()), K = x.size(-1), N = out_features;
  const bool bf16_weight = packed.scalar_type() == at::kBFloat16;
  TORCH_CHECK_VALUE(K == packed_k || (bf16_weight && K == packed_k - 1), "packed_linear: x has ", K,
                    " features, the packed weight ", bf16_weight ? "holds pairs of " : "", packed_k);
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK_VALUE(!has_bias || (bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == x.scalar_type()),
                    "packed_linear's bias must be ", x.scalar_type(), " [", N, "], got ", bias->scalar_type(), " ",
                    bias->sizes());
  at::Tensor a = x.reshape({-1, K});
  if (a.stride(1) != 1 || (a.size(0) > 1 && a.stride(0) < K)) a = a.contiguous();
  const int64_t M = a.size(0);
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor out = at::empty(out_shape, x.options().dtype(fp32_out ? at::kFloat : x.scalar_type()));
  const bool has_residual = residual.has_value() && residual->defined();
  TORCH_CHECK_VALUE(
      !has_residual || (residual->sizes() == out.sizes() && residual->scalar_type() == out.scalar_type()),
      "packed_linear's residual must be ", out.scalar_type(), " ", out.sizes(), ", got ",
      has_residual ? residual->scalar_type() : out.scalar_type(), " ", has_residual ? residual->sizes() : out.sizes());
  const bool prefill = M > kMaxPackedRows && K * N <= kMaxUnpackedFloats;
  if (bf16 && prefill && !fp32_out && bf16_prefill_gemm()) {  // oneDNN's bf16 GEMM: fp32 sums, bf16 out
    at::Tensor out2d = out.view({M, N});
    if (has_residual) {  // the residual joins the fp32 sums, rounded once (with a bias, their sum rounded first)
      out2d.copy_(residual->reshape({M, N}));
      if (has_bias) out2d.add_(*bias);
      out2d.addmm_(a, unpacked_weight_bf16(packed, K, N));
    } else if (has_bias) {
      at::addmm_out(out2d, *bias, a, unpacked_weight_bf16(packed, K, N));
    } else {
      at::mm_out(out2d, a, unpacked_weight_bf16(packed, K, N));
    }
    return out;
  }
  if (bf16 && prefill) {  // MKL's sgemm in fp32 (x and the weight widened), rounded to bf16 once
    at::Tensor out32 = at::mm(a.to(at::kFloat), unpacked_weight(packed, K, N));
    if (has_bias) out32.add_(*bias);
    if (has_residual) out32.add_(residual->reshape({M, N}));
    out.view({M, N}).copy_(out32);
    return out;
  }
  if (bf16) {  // the bias joins the fp32 sums, rounded once (or not at all)
    const at::Tensor bias_c = has_bias ? bias->contiguous() : at::Tensor();
    if (M > 0) {
      const c10::BFloat16* bias_p = has_bias ? bias_c.const_data_ptr<c10::BFloat16>() : nullptr;
      const auto* a_p = a.const_data_ptr<c10::BFloat16>();
      const auto* packed_p = packed.const_data_ptr<c10::BFloat16>();
      if (fp32_out) {
        gemm_bf16(a_p, a.stride(0), packed_p, bias_p, M, K, N, out.data_ptr<float>());
      } else {
        gemm_bf16(a_p, a.stride(0), packed_p, bias_p, M, K, N, out.data_ptr<c10::BFloat16>());
      }
    }
    if (has_residual) out.add_(*residual);
    return out;
  }
  if (prefill) {  // fp32 x: MKL's sgemm over the weight unpacked to fp32 (bf16 panels widened)
    at::Tensor out2d = out.view({M, N});
    if (has_residual) {
      out2d.copy_(residual->reshape({M, N}));
      out2d.addmm_(a, unpacked_weight(packed, K, N));
    } else {
      at::mm_out(out2d, a, unpacked_weight(packed, K, N));
    }
  } else if (M >= kWidenOnceRows && bf16_weight) {
    packed_gemm_widened(a.const_data_ptr<float>(), a.stride(0), packed.const_data_ptr<c10::BFloat16>(), M, K, N,
                        out.data_ptr<float>());
  } else if (M > 0 && bf16_weight) {
    gemm_bf16_weight(a.const_data_ptr<float>(), a.stride(0), packed.const_data_ptr<c10::BFloat16>(), M, K, N,
                     out.data_ptr<float>());
  } else if (M > 0) {
    packed_gemm(a.const_data_ptr<float>(), a.stride(0), packed.const_data_ptr<float>(), M, K, N,
                out.data_ptr<float>());
  }
  if (has_bias) out.add_(*bias);
  if (has_residual && !prefill) out.add_(*residual);
  return out;
}

// 0: not chosen yet, 1: bf16, 2: fp32.
std::atomic<int> g_prefill_gemm{0};

double call_ms(const at::Tensor& a, const at::Tensor& b) {
  const auto start = std::chrono::steady_clock::now();
  at::mm(a, b);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> times) {
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// bf16 vs fp32 GEMM on a prefill-sized problem of a small model's shape, measured on this CPU: without native
// bf16 (AVX2 only) torch's bf16 GEMM is emulated and several times slower; with AVX512-BF16 (an AMD EPYC here) it
// measured 2.1-2.7x faster than sgemm at 512-2048 rows, with AMX more. Two warm-up calls each (oneDNN builds its
// kernel at the first), then seven alternating pairs and their medians: whatever else runs at start-up (compiles,
// the API process) lands on both sides, where four calls of one and then four of the other once chose the 3x
// slower sgemm.
int measure_prefill_gemm() {
  const at::Tensor a = at::randn({384, 576}), b = at::randn({576, 1024});
  const at::Tensor a16 = a.to(at::kBFloat16), b16 = b.to(at::kBFloat16);
  for (int i = 0; i < 2; ++i) {
    call_ms(a, b);
    call_ms(a16, b16);
  }
  std::vector<double> fp32, bf16;
  for (int i = 0; i < 7; ++i) {
    fp32.push_back(call_ms(a, b));
    bf16.push_back(call_ms(a16, b16));
  }
  return median(bf16) < median(fp32) ? 1 : 2;
}

int parse_prefill_gemm(const std::string& choice) {
  TORCH_CHECK_VALUE(choice == "auto" || choice == "bf16" || choice == "fp32",
                    "prefill GEMM choice must be auto, bf16 or fp32, got '", choice, "'");
  return choice == "bf16" ? 1 : choice == "fp32" ? 2 : 0;
}

// choice "": the current choice (measured now if not made yet); "auto", "bf16", "fp32": set it (auto measures).
std::string prefill_gemm_choice(const std::string& choice) {
  if (!choice.empty()) {
    const int value = parse_prefill_gemm(choice);
    g_prefill_gemm.store(value == 0 ? measure_prefill_gemm() : value);
  } else if (g_prefill_gemm.load() == 0) {
    const char* env = std::getenv("HPI_CPU_PREFILL_GEMM");
    const int value = env != nullptr && *env != '\0' ? parse_prefill_gemm(env) : 0;
    g_prefill_gemm.store(value == 0 ? measure_prefill_gemm() : value);
  }
  return g_prefill_gemm.load() == 1 ? "bf16" : "fp32";
}

}  // namespace

namespace hpi_packed {

bool bf16_prefill_gemm() {
  const int value = g_prefill_gemm.load();
  return value != 0 ? value == 1 : prefill_gemm_choice("") == "bf16";
}

}  // namespace hpi_packed

namespace {

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& residual) {
  return packed_linear_to(x, packed, out_features, bias, false, residual);
}

// An LM head's logits: in fp32 even for bf16 x and weights, so that greedy choices between near-equal logits are
// not decided by bf16's rounding (steps of 0.125 at logits of 16-32); the kernel sums in fp32 either way.
at::Tensor packed_logits(const at::Tensor& x, const at::Tensor& packed, int64_t out_features) {
  return packed_linear_to(x, packed, out_features, std::nullopt, true);
}

at::Tensor packed_logits_meta(const at::Tensor& x, const at::Tensor&, int64_t out_features) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = c10::SymInt(out_features);
  return at::empty_symint(shape, x.options().dtype(at::kFloat));
}

at::Tensor packed_linear_meta(const at::Tensor& x, const at::Tensor&, int64_t out_features,
                              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = c10::SymInt(out_features);
  return at::empty_symint(shape, x.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hpi_kernels, m) {
  m.def("pack_linear_weight(Tensor weight) -> Tensor");
  m.def(
      "packed_linear(Tensor x, Tensor packed, int out_features, Tensor? bias=None, Tensor? residual=None) -> Tensor");
  m.def("packed_logits(Tensor x, Tensor packed, int out_features) -> Tensor");
  m.def("prefill_gemm(str choice='') -> str", &prefill_gemm_choice);
}

TORCH_LIBRARY_IMPL(hpi_kernels, CPU, m) {
  m.impl("pack_linear_weight", &pack_linear_weight);
  m.impl("packed_linear", &packed_linear);
  m.impl("packed_logits", &packed_logits);
}

TORCH_LIBRARY_IMPL(hpi_kernels, Meta, m) {
  m.impl("packed_linear", &packed_linear_meta);
  m.impl("packed_logits", &packed_logits_meta);
}
