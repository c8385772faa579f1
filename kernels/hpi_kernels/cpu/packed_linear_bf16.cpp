// bf16 linear layers over prepacked weights. The weight stays bf16 in memory, packed as pairs (packed_linear.h),
// and one of three tiles multiplies it (tile_choice: measured on this CPU at the first call):
// - "widen": each pair widened to fp32 in registers (a shift and a mask per 16 pairs) for fp32 FMAs, half of
//   fp32's bytes at fp32's FMA peak. The only tile where the CPU lacks AVX512-BF16 (there bf16 is emulated), and
//   the faster one where vdpbf16ps issues at half the FMA rate (an Intel machine measured it so).
// - "dpbf16" (AVX512 build, CPUs with AVX512-BF16): vdpbf16ps on the pairs as they are in memory and x's pair
//   broadcast, two products exact and summed in fp32 per lane: half the instructions per k, and on AMD Zen 4
//   vdpbf16ps issues at the FMA's rate with twice its multiply-adds. Sums differ from widen's in order only.
// - "amx" (CPUs with AMX-BF16): AMX tiles over the same panels, packed_linear_amx.cpp; weights whose K is no
//   multiple of 32 keep the faster of the two above, which the int8/int4 tiles and the LoRA shrink take too.
//
// The tile is packed_linear.cpp's: kMr rows x kNr columns of fp32 accumulators; per pair of k, kNrVecs loads
// of the panel widened into 2 * kNrVecs vectors, 2 * kMr broadcasts of x (converted to fp32 once per call),
// 2 * kMr * kNrVecs FMAs, the next panel prefetched into L2 meanwhile. Sums are fp32 in k order, plus the
// bias, rounded to bf16 once. Prefill-sized x goes to MKL instead (packed_linear.cpp), over unpack_bf16's fp32
// copy of the weight: the kernel was 10% slower than MKL on a 2,048-token prefill step.

#include "packed_linear.h"

#include <ATen/Parallel.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace hpi_packed {

namespace {

using IVec = at::vec::Vectorized<int32_t>;
static_assert(IVec::size() == kVecSize, "a panel row of pairs is kNrVecs vectors of int32");
constexpr int kMrBf16 = kVecSize >= 16 ? 12 : 5;  // 24 (or 10) accumulators + 4 widened weights + a broadcast

// c[r, 0:ncols] = Out(acc[r] + bias) for r < R: bf16 rounded once, or the fp32 sums themselves (logits).
template <int R, typename Out>
inline void store_tile(const Vec (&acc)[R][kNrVecs], const c10::BFloat16* bias, Out* c, int64_t ldc, int64_t ncols) {
  static_assert(kNrVecs == 2, "one Vectorized<BFloat16> holds the two vectors of a tile row");
  using BVec = at::vec::Vectorized<c10::BFloat16>;
  Vec bias_v[kNrVecs] = {Vec(0.f), Vec(0.f)};
  if (bias != nullptr) {
    std::tie(bias_v[0], bias_v[1]) =
        at::vec::convert_bfloat16_float(ncols == kNr ? BVec::loadu(bias) : BVec::loadu(bias, ncols));
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (std::is_same_v<Out, float>) {
      for (int v = 0; v < kNrVecs; ++v) {
        const int64_t count = std::clamp<int64_t>(ncols - v * kVecSize, 0, kVecSize);
        const Vec sum = acc[r][v] + bias_v[v];
        if (count == kVecSize) {
          sum.store(c + r * ldc + v * kVecSize);
        } else if (count > 0) {
          sum.store(c + r * ldc + v * kVecSize, count);
        }
      }
    } else {
      const auto rounded = at::vec::convert_float_bfloat16(acc[r][0] + bias_v[0], acc[r][1] + bias_v[1]);
      if (ncols == kNr) {
        rounded.store(c + r * ldc);
      } else {
        rounded.store(c + r * ldc, ncols);
      }
    }
  }
}

// c[r, 0:ncols] = Out(sum_k a[r, k] * w[k, 0:kNr] + bias) for r < R (Out: bf16, rounded once, or the fp32 sums
// themselves, for logits); a is fp32 (row stride lda, padded to even K), b one packed panel of `pairs` rows of
// pairs.
template <int R, typename Out>
inline void tile(const float* a, int64_t lda, const int32_t* b, int64_t pairs, const c10::BFloat16* bias, Out* c,
                 int64_t ldc, int64_t ncols, const int32_t* next, int64_t phase, int64_t step) {
  const IVec shift(16), high(static_cast<int32_t>(0xffff0000u));
  Vec acc[R][kNrVecs];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kNrVecs; ++v) acc[r][v] = Vec(0.f);
  }
  int64_t countdown = phase;
  for (int64_t q = 0; q < pairs; ++q) {
    Vec even[kNrVecs], odd[kNrVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kNrVecs; ++v) {
      const IVec lanes = IVec::loadu(b + q * kNr + v * kVecSize);
      even[v] = at::vec::cast<float>(lanes << shift);  // a bf16 is the high half of its fp32
      odd[v] = at::vec::cast<float>(lanes & high);
    }
    prefetch_rows(b, next, q, countdown, step);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Vec a_even(a[r * lda + 2 * q]), a_odd(a[r * lda + 2 * q + 1]);
#pragma GCC unroll 4
      for (int v = 0; v < kNrVecs; ++v) {
        acc[r][v] = at::vec::fmadd(a_even, even[v], acc[r][v]);
        acc[r][v] = at::vec::fmadd(a_odd, odd[v], acc[r][v]);
      }
    }
  }
  store_tile<R, Out>(acc, bias, c, ldc, ncols);
}

#if defined(CPU_CAPABILITY_AVX512)
// tile's twin with vdpbf16ps: a is bf16 (row stride lda, even K: the pair (2q, 2q + 1) of a row read as one int32),
// broadcast per row and multiplied with the panel's pairs as they are in memory.
template <int R, typename Out>
__attribute__((target("avx512bf16"))) void tile_dp(const c10::BFloat16* a, int64_t lda, const int32_t* b,
                                                   int64_t pairs, const c10::BFloat16* bias, Out* c, int64_t ldc,
                                                   int64_t ncols, const int32_t* next, int64_t phase, int64_t step) {
  static_assert(kVecSize == 16, "AVX512: 16 columns of pairs per vector");
  __m512 acc[R][kNrVecs];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kNrVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  int64_t countdown = phase;
  for (int64_t q = 0; q < pairs; ++q) {
    __m512bh w[kNrVecs];
#pragma GCC unroll 4
    for (int v = 0; v < kNrVecs; ++v) w[v] = (__m512bh)_mm512_loadu_si512(b + q * kNr + v * kVecSize);
    prefetch_rows(b, next, q, countdown, step);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, a + r * lda + 2 * q, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int v = 0; v < kNrVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, w[v]);
    }
  }
  Vec sums[R][kNrVecs];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kNrVecs; ++v) sums[r][v] = acc[r][v];
  }
  store_tile<R, Out>(sums, bias, c, ldc, ncols);
}
#endif

}  // namespace

at::Tensor pack_bf16(const at::Tensor& weight) {
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kNr - 1) / kNr, pairs = (K + 1) / 2;
  at::Tensor packed = at::zeros({panels, pairs, kNr, 2}, weight.options());
  const auto w = weight.accessor<c10::BFloat16, 2>();  // any strides
  c10::BFloat16* out = packed.data_ptr<c10::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t ncols = std::min(kNr, N - p * kNr);
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t j = 0; j < ncols; ++j) out[((p * pairs + k / 2) * kNr + j) * 2 + k % 2] = w[p * kNr + j][k];
      }
    }
  });
  return packed;
}

namespace {

template <typename T>
void unpack_bf16_to(const c10::BFloat16* packed, int64_t K, int64_t N, T* dst) {
  const int64_t pairs = (K + 1) / 2, n_panels = (N + kNr - 1) / kNr;
  at::parallel_for(0, pairs, 8, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      for (int64_t p = 0; p < n_panels; ++p) {
        const c10::BFloat16* row = packed + ((p * pairs + q) * kNr) * 2;
        const int64_t ncols = std::min(kNr, N - p * kNr);
#if defined(CPU_CAPABILITY_AVX512)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (ncols == kNr && 2 * q + 1 < K) {  // a panel row's 32 pairs -> rows 2q and 2q + 1 of 32 columns
            const __m512i lo = _mm512_loadu_si512(row), hi = _mm512_loadu_si512(row + kNr);
            T* even = dst + 2 * q * N + p * kNr;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(even), _mm512_cvtepi32_epi16(lo));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(even + kVecSize), _mm512_cvtepi32_epi16(hi));
            T* odd = even + N;
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(odd), _mm512_cvtepi32_epi16(_mm512_srli_epi32(lo, 16)));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(odd + kVecSize),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(hi, 16)));
            continue;
          }
        }
#endif
        for (int64_t k = 2 * q; k < std::min(K, 2 * q + 2); ++k) {
          for (int64_t j = 0; j < ncols; ++j) dst[k * N + p * kNr + j] = static_cast<T>(row[2 * j + k % 2]);
        }
      }
    }
  });
}

}  // namespace

void unpack_bf16(const c10::BFloat16* packed, int64_t K, int64_t N, float* dst) {
  unpack_bf16_to(packed, K, N, dst);
}

void unpack_bf16(const c10::BFloat16* packed, int64_t K, int64_t N, c10::BFloat16* dst) {
  unpack_bf16_to(packed, K, N, dst);
}

namespace {

// In: x's dtype, bf16 (a bf16 model) or fp32 (an fp32 model whose weights are bf16 values, packed as bf16 at half
// the bytes: the widen tile only).
template <typename In, typename Out>
void gemm_bf16_to(const In* a, int64_t lda, const c10::BFloat16* packed, const c10::BFloat16* bias, int64_t M,
                  int64_t K, int64_t N, Out* out, bool dp) {
  const int64_t pairs = (K + 1) / 2, n_panels = (N + kNr - 1) / kNr;
  int64_t lda32 = 2 * pairs;
  const float* a32 = nullptr;  // x in fp32, rows padded with a zero to even K (the widen tile's)
  if constexpr (std::is_same_v<In, float>) {
    if (K % 2 == 0) a32 = a, lda32 = lda;  // fp32 x as it is
  }
  if (!dp && a32 == nullptr) {
    static thread_local std::vector<float> scratch;
    if (scratch.size() < static_cast<size_t>(M * lda32)) scratch.resize(M * lda32);
    float* widened = scratch.data();  // a pointer: inside parallel_for, `scratch` would name each worker's own
    at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {  // a prefill's x is megabytes: every thread widens
      for (int64_t m = m0; m < m1; ++m) {
        for (int64_t k = 0; k < K; ++k) widened[m * lda32 + k] = static_cast<float>(a[m * lda + k]);
        if (K % 2 != 0) widened[m * lda32 + K] = 0.f;
      }
    });
    a32 = widened;
  }
  const auto* packed32 = reinterpret_cast<const int32_t*>(packed);  // a pair per int32
  for (int64_t m0 = 0; m0 < M; m0 += kMc) {
    const int64_t mc = std::min(kMc, M - m0), tiles = (mc + kMrBf16 - 1) / kMrBf16;
    at::parallel_for(0, n_panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int32_t* panel = packed32 + p * pairs * kNr;
        const int32_t* next = p + 1 < p1 ? panel + pairs * kNr : nullptr;
        const int64_t ncols = std::min(kNr, N - p * kNr);
        const c10::BFloat16* panel_bias = bias != nullptr ? bias + p * kNr : nullptr;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t m = m0 + t * kMrBf16, rows = std::min<int64_t>(kMrBf16, m0 + mc - m);
          with_rows<kMrBf16>(rows, [&](auto height) {
#if defined(CPU_CAPABILITY_AVX512)
            if constexpr (std::is_same_v<In, c10::BFloat16>) {
              if (dp) {
                tile_dp<decltype(height)::value, Out>(a + m * lda, lda, panel, pairs, panel_bias,
                                                      out + m * N + p * kNr, N, ncols, next, t, tiles);
                return;
              }
            }
#endif
            tile<decltype(height)::value, Out>(a32 + m * lda32, lda32, panel, pairs, panel_bias,
                                               out + m * N + p * kNr, N, ncols, next, t, tiles);
          });
        }
      }
    });
  }
}

// Which tile the packed bf16 GEMMs run on this CPU: 0 not chosen yet, 1 widen, 2 dpbf16. One choice for every
// row count, so that a row's result stays independent of the rows beside it (the tiles sum in different orders).
// The int8/int4 tiles and the LoRA shrink follow it (dp_tile). g_amx: 0 not chosen yet, 1 no, 2 the packed bf16
// GEMMs run AMX tiles instead (packed_linear_amx.cpp), at every row count up to prefill size too.
std::atomic<int> g_tile{0};
std::atomic<int> g_amx{0};

// One request's decode (1 row) and a batch's (16 rows) together, on a weight that streams from memory (8 MiB,
// beyond L2, like a layer's): per candidate (gemm(x, rows, out)), the best of 5 alternating blocks of 4 calls per
// row count, summed over the row counts, so that a load that comes and goes weighs on all alike. The index of the
// fastest.
template <typename Gemm>
int fastest(const std::vector<Gemm>& candidates) {
  constexpr int64_t K = 1024, N = 4096;
  const at::Tensor packed = pack_bf16(at::randn({N, K}).to(at::kBFloat16));
  std::vector<double> total(candidates.size(), 0.0);
  for (const int64_t rows : {1, 16}) {
    const at::Tensor x = at::randn({rows, K}).to(at::kBFloat16);
    std::vector<c10::BFloat16> out(static_cast<size_t>(rows * N));
    std::vector<double> best(candidates.size(), 1e30);
    for (int block = 0; block < 6; ++block) {
      for (size_t c = 0; c < candidates.size(); ++c) {
        const auto start = std::chrono::steady_clock::now();
        for (int i = 0; i < 4; ++i) {
          candidates[c](x.const_data_ptr<c10::BFloat16>(), K, packed.const_data_ptr<c10::BFloat16>(), rows, N,
                        out.data());
        }
        const auto elapsed = std::chrono::steady_clock::now() - start;
        if (block > 0) best[c] = std::min(best[c], std::chrono::duration<double, std::milli>(elapsed).count());
      }
    }
    for (size_t c = 0; c < candidates.size(); ++c) total[c] += best[c];
  }
  return static_cast<int>(std::min_element(total.begin(), total.end()) - total.begin());
}

using Gemm = void (*)(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, int64_t, c10::BFloat16*);

void widen_gemm(const c10::BFloat16* a, int64_t K, const c10::BFloat16* packed, int64_t rows, int64_t N,
                c10::BFloat16* out) {
  gemm_bf16_to(a, K, packed, nullptr, rows, K, N, out, false);
}

void dp_gemm(const c10::BFloat16* a, int64_t K, const c10::BFloat16* packed, int64_t rows, int64_t N,
             c10::BFloat16* out) {
  gemm_bf16_to(a, K, packed, nullptr, rows, K, N, out, true);
}

void amx_gemm(const c10::BFloat16* a, int64_t K, const c10::BFloat16* packed, int64_t rows, int64_t N,
              c10::BFloat16* out) {
  gemm_bf16_amx(a, K, packed, nullptr, rows, K, N, out);
}

int measure_tile() { return avx512_bf16() ? 1 + fastest(std::vector<Gemm>{widen_gemm, dp_gemm}) : 1; }

// AMX against the vector tile measure_tile chose.
int measure_amx() {
  if (!amx_available()) return 1;
  const Gemm vector_tile = g_tile.load() == 2 ? dp_gemm : widen_gemm;
  return fastest(std::vector<Gemm>{vector_tile, amx_gemm}) == 1 ? 2 : 1;
}

// A choice: {tile (0: measure), amx (0: measure)}.
std::pair<int, int> parse_tile(const std::string& choice) {
  TORCH_CHECK_VALUE(choice == "auto" || choice == "widen" || choice == "dpbf16" || choice == "amx",
                    "bf16 GEMM tile must be auto, widen, dpbf16 or amx, got '", choice, "'");
  TORCH_CHECK_VALUE(choice != "dpbf16" || avx512_bf16(),
                    "the dpbf16 tile needs a CPU with AVX512-BF16 and the AVX512 build of the kernels");
  TORCH_CHECK_VALUE(choice != "amx" || amx_available(),
                    "the amx tile needs a CPU with AMX-BF16 (granted by Linux) and the AVX512 build of the kernels");
  if (choice == "widen") return {1, 1};
  if (choice == "dpbf16") return {2, 1};
  return {0, choice == "amx" ? 2 : 0};
}

void choose(const std::pair<int, int>& choice) {
  const bool keep_tile = choice.second == 2 && g_tile.load() != 0;  // forcing amx keeps a vector tile measured before
  g_tile.store(choice.first != 0 ? choice.first : keep_tile ? g_tile.load() : measure_tile());
  g_amx.store(choice.second != 0 ? choice.second : measure_amx());
}

// choice "": the current tile (measured now if not chosen yet, unless HPI_CPU_BF16_TILE=widen|dpbf16|amx says);
// "auto" measures again; "widen" / "dpbf16" / "amx" force one (with amx, the int8/int4 tiles' widen or dpbf16 is
// still measured).
std::string tile_choice(const std::string& choice) {
  if (!choice.empty()) {
    choose(parse_tile(choice));
  } else if (g_tile.load() == 0 || g_amx.load() == 0) {
    const char* env = std::getenv("HPI_CPU_BF16_TILE");
    choose(parse_tile(env != nullptr && *env != '\0' ? env : "auto"));
  }
  return g_amx.load() == 2 ? "amx" : g_tile.load() == 2 ? "dpbf16" : "widen";
}

bool use_dp(int64_t K) { return K % 2 == 0 && dp_tile(); }

}  // namespace

bool amx_tile(int64_t K) {
  if (!amx_fits(K)) return false;
  if (g_amx.load() == 0) tile_choice("");
  return g_amx.load() == 2;
}

bool avx512_bf16() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool available = [] {
    const char* setting = std::getenv("HPI_CPU_AVX512_BF16");
    return __builtin_cpu_supports("avx512bf16") && !(setting != nullptr && std::strcmp(setting, "0") == 0);
  }();
  return available;
#else
  return false;
#endif
}

bool dp_tile() {
  if (!avx512_bf16()) return false;
  if (g_tile.load() == 0) tile_choice("");
  return g_tile.load() == 2;
}

void gemm_bf16(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* packed, const c10::BFloat16* bias,
               int64_t M, int64_t K, int64_t N, c10::BFloat16* out) {
  if (amx_tile(K)) return gemm_bf16_amx(a, lda, packed, bias, M, K, N, out);
  gemm_bf16_to(a, lda, packed, bias, M, K, N, out, use_dp(K));
}

void gemm_bf16(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* packed, const c10::BFloat16* bias,
               int64_t M, int64_t K, int64_t N, float* out) {
  if (amx_tile(K)) return gemm_bf16_amx(a, lda, packed, bias, M, K, N, out);
  gemm_bf16_to(a, lda, packed, bias, M, K, N, out, use_dp(K));
}

void gemm_bf16_weight(const float* a, int64_t lda, const c10::BFloat16* packed, int64_t M, int64_t K, int64_t N,
                      float* out) {
  gemm_bf16_to(a, lda, packed, static_cast<const c10::BFloat16*>(nullptr), M, K, N, out, false);
}

}  // namespace hpi_packed

TORCH_LIBRARY_FRAGMENT(hpi_kernels, m) {
  m.def("bf16_tile(str choice='') -> str", &hpi_packed::tile_choice);
}
