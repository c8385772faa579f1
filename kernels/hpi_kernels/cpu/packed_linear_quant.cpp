// Weight-only int8 / int4 linear layers over prepacked weights: the panels of packed_linear.cpp, with the weight
// streamed at one byte (int8) or half a byte (int4) per value and widened in registers.
//
// torch's own CPU ops (aten._weight_int8pack_mm, _weight_int4pack_mm_for_cpu) run in bf16 with a tile per
// output block that re-reads x and leaves the FMA units idle at 8-64 rows: slower than the packed bf16 linear
// beyond one row (bench/results/quantization.md). Here:
// - int8 (one scale per output channel): panels [panels, K, kNr] int8, the codes of kNr output columns per k.
//   The tiles sum x * code and apply the channel's scale once to the sum (the scale is constant along k).
// - int4 (w = (q - 8) * scale + zero per group of `group_size` k): panels [panels, K / 8, kNr] int32, the word
//   of a column holding its codes for 8 consecutive k (Int4Words); scales and zeros [panels,
//   K / group_size, kNr, 2] bf16, the pair of a column one 32-bit lane (widened as the bf16 linear widens).
//   The tiles sum x * (q - 8) and x over each group apart and add scale * the one + zero * the other per
//   group: per k only the codes are widened (a table lookup with AVX512).
// Two tiles per format: fp32 FMAs over the codes widened to fp32 (x read in fp32, bf16 x widened once per
// call), and, for bf16 x on CPUs with AVX512-BF16 (checked at run time), vdpbf16ps over pairs of k, x's pairs as
// they are in memory and the codes as bf16 (exact: they are small integers). Both sum in fp32, so they differ
// in summation order only; on Zen 4 vdpbf16ps issues at the FMA's rate with twice its multiply-adds, which
// doubles the compute-bound steps (bench/results/quantization.md, "Tries"). The bias joins the fp32 sums; the
// result is rounded to x's dtype once. Prefill-sized x (more than kMaxTileRows rows) goes to MKL's sgemm over
// the weight dequantized into a per-thread fp32 scratch copy: one pass over the weight, which a long prefill
// amortizes. A row's result does not depend on the other rows below that size.
//
// - int4_a8_linear (W4A8): the int4 panels against x quantized to int8 per row and group of k, products summed
//   exactly in int32 (vpdpbusd on CPUs with AVX512-VNNI, and in the AVX2 build on CPUs with AVX-VNNI; else
//   vpmaddubsw in the AVX2 build, plain loops elsewhere), up to its max_rows (every row count by default).
// - int8_a8_linear (W8A8): the int8 panels as they are against x quantized likewise per group of 32 k, products
//   summed exactly in int32 (vpdpbusd over panel rows regrouped by vpermi2b on CPUs with AVX512-VNNI and -VBMI, or
//   by byte and word unpacks in the AVX2 build on CPUs with AVX-VNNI; plain loops elsewhere), up to its max_rows.
// - On CPUs with AMX, where the packed bf16 linear runs AMX tiles (amx_tile), int8_linear / int8_logits and
//   int4_linear with bf16 x run them too from kMinAmxRows rows up to prefill size (packed_linear_amx.cpp): each
//   panel dequantized to bf16 pairs, int8 exactly (its scales multiply the sums), int4's (q - 8) * scale + zero
//   rounded to bf16. One or two rows take the vector tiles, for which that dequantization costs more than the
//   rows' products; int8's paths differ by summation order only.
//
// Widening uses AVX512 / AVX2 intrinsics in those builds (_extension.py builds one per CPU capability) and
// plain loops in the generic one; the vdpbf16ps and 512-bit vpdpbusd tiles exist in the AVX512 build only, the
// vpmaddubsw W4A8 tile and the AVX-VNNI (256-bit vpdpbusd) W4A8 / W8A8 tiles in the AVX2 build only.

#include "cpu_vec.h"
#include "packed_linear.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using namespace hpi_packed;
using hpi_vec::load_float;
using IVec = at::vec::Vectorized<int32_t>;
static_assert(kNrVecs == 2, "a panel row is two vectors: int4's low and high nibbles of one run of bytes");
// Fewer rows than this take the vector tiles where the AMX tiles would run: over the embedded model's int8 linears
// (bf16 x, the AMX Xeon) the vector tile took 0.70x the AMX tiles' time at one row, 0.87x at two, 1.15x at four.
constexpr int64_t kMinAmxRows = 3;
constexpr int64_t kMaxTileRows = 320;           // more rows (prefill): dequantize and call at::mm,
constexpr int64_t kMaxScratchFloats = 1 << 24;  // for weights of up to 64 MiB as fp32
constexpr int64_t kLine = 64;                   // bytes per cache line
constexpr int kMrInt8 = kVecSize >= 16 ? 12 : 6;  // 24 (12) accumulators + 2 weights + a broadcast
// int4: 2 * 2 * rows accumulators (sums and the current group's) + codes + widened weights + a table.
constexpr int kMrInt4 = kVecSize >= 16 ? 4 : 2;

// Two fp32 vectors (columns 0..kVecSize-1, kVecSize..kNr-1) from the kNr int8 codes at p.
inline void widen_int8(const int8_t* p, Vec (&w)[kNrVecs]) {
#if defined(CPU_CAPABILITY_AVX512)
  w[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  w[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
#elif defined(CPU_CAPABILITY_AVX2)
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))));
#else
  float lanes[kNr];
  for (int64_t j = 0; j < kNr; ++j) lanes[j] = static_cast<float>(p[j]);
  w[0] = Vec::loadu(lanes);
  w[1] = Vec::loadu(lanes + kVecSize);
#endif
}

// Lanes shifted right (logically) by Shift bits.
template <int Shift>
inline IVec shift_right(const IVec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_srli_epi32(x, Shift);
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_srli_epi32(x, Shift);
#else
  int32_t lanes[kVecSize];
  x.store(lanes);
  for (int64_t j = 0; j < kVecSize; ++j) lanes[j] = static_cast<int32_t>(static_cast<uint32_t>(lanes[j]) >> Shift);
  return IVec::loadu(lanes);
#endif
}

// The low nibble q of each lane as the fp32 q - 8.
inline Vec low_code(const IVec& x) {
#if defined(CPU_CAPABILITY_AVX512)
  // vpermps reads the low 4 bits of each lane: a 16-entry table lookup, no mask, subtract or convert.
  return _mm512_permutexvar_ps(x, _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0xf)), _mm256_set1_epi32(8)));
#else
  int32_t lanes[kVecSize];
  float codes[kVecSize];
  x.store(lanes);
  for (int64_t j = 0; j < kVecSize; ++j) codes[j] = static_cast<float>((lanes[j] & 0xf) - 8);
  return Vec::loadu(codes);
#endif
}

// int4 codes of one panel row of 8 k: kNrVecs vectors of 32-bit words, a column's word holding its codes for
// k = 8 * k8 + 2i at bits 4i..4i+3 and for k = 8 * k8 + 2i + 1 at bits 16 + 4i..16 + 4i + 3 (i < 4): the
// 16-bit halves are the pairs of k that vdpbf16ps multiplies (tile_int4_dp). `next_pair()` gives q - 8 as
// fp32 for the next pair of k.
struct Int4Words {
  IVec even[kNrVecs], odd[kNrVecs];

  explicit Int4Words(const int32_t* row) {
    for (int v = 0; v < kNrVecs; ++v) {
      even[v] = IVec::loadu(row + v * kVecSize);
      odd[v] = shift_right<16>(even[v]);
    }
  }

  __attribute__((always_inline)) void next_pair(Vec (&w_even)[kNrVecs], Vec (&w_odd)[kNrVecs]) {
    for (int v = 0; v < kNrVecs; ++v) {
      w_even[v] = low_code(even[v]);
      w_odd[v] = low_code(odd[v]);
      even[v] = shift_right<4>(even[v]);
      odd[v] = shift_right<4>(odd[v]);
    }
  }
};

// Where the code of k = 8 * k8 + i sits in its column's word (see Int4Words).
constexpr int int4_bit(int64_t i) { return static_cast<int>(16 * (i % 2) + 4 * (i / 2)); }

// A tile's prefetches at panel row k, once per cache line of rows: the line kPrefetch lines ahead in its own
// panel into L1, and (every `step`-th line, counting down from the tile's phase) the same line of the
// thread's next panel into L2, so that a panel's tiles share the next one's stream (as packed_linear.h's).
template <int64_t RowBytes>
__attribute__((always_inline)) inline void prefetch_line(const uint8_t* panel, const uint8_t* next, int64_t k,
                                                        int64_t& countdown, int64_t step) {
  constexpr int64_t rows_per_line = RowBytes >= kLine ? 1 : kLine / RowBytes;
  if (k % rows_per_line != 0) return;
  for (int64_t b = 0; b < std::max<int64_t>(RowBytes, kLine); b += kLine) {
    __builtin_prefetch(panel + (k + kPrefetch * rows_per_line) * RowBytes + b, 0, 3);
  }
  if (next != nullptr && --countdown < 0) {
    countdown = step - 1;
    for (int64_t b = 0; b < std::max<int64_t>(RowBytes, kLine); b += kLine) __builtin_prefetch(next + k * RowBytes + b, 0, 2);
  }
}

// What the tiles share: where the rows of x and of out are, and the per-column epilogue.
struct TileArgs {
  int64_t row;           // of x: the tile's first
  const float* a;        // [R, K] fp32, row stride lda
  int64_t lda;
  int64_t K;
  const float* scale;    // [kNr] per-column factor applied to the sums (int8's scales), or nullptr
  const float* bias;     // [ncols] fp32, or nullptr
  void* c;               // out rows (fp32 or bf16), row stride ldc, this panel's first column
  int64_t ldc;
  int64_t ncols;
  bool bf16_out;
};

template <int R>
inline void store_tile(const TileArgs& t, Vec (&acc)[R][kNrVecs]) {
  Vec scale[kNrVecs] = {Vec(1.f), Vec(1.f)}, bias[kNrVecs] = {Vec(0.f), Vec(0.f)};
  for (int v = 0; v < kNrVecs; ++v) {
    const int64_t count = std::clamp<int64_t>(t.ncols - v * kVecSize, 0, kVecSize);
    if (t.scale != nullptr) scale[v] = Vec::loadu(t.scale + v * kVecSize);  // padded to whole panels
    if (t.bias != nullptr && count > 0) bias[v] = Vec::loadu(t.bias + v * kVecSize, count);
  }
  for (int r = 0; r < R; ++r) {
    const Vec y0 = at::vec::fmadd(acc[r][0], scale[0], bias[0]), y1 = at::vec::fmadd(acc[r][1], scale[1], bias[1]);
    if (t.bf16_out) {
      auto* c = static_cast<c10::BFloat16*>(t.c) + r * t.ldc;
      const auto rounded = at::vec::convert_float_bfloat16(y0, y1);
      if (t.ncols == kNr) {
        rounded.store(c);
      } else {
        rounded.store(c, t.ncols);
      }
    } else {
      float* c = static_cast<float*>(t.c) + r * t.ldc;
      const Vec y[kNrVecs] = {y0, y1};
      for (int v = 0; v < kNrVecs; ++v) {
        const int64_t count = std::clamp<int64_t>(t.ncols - v * kVecSize, 0, kVecSize);
        if (count == kVecSize) {
          y[v].store(c + v * kVecSize);
        } else if (count > 0) {
          y[v].store(c + v * kVecSize, count);
        }
      }
    }
  }
}

template <int R>
inline void zero(Vec (&acc)[R][kNrVecs]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < kNrVecs; ++v) acc[r][v] = Vec(0.f);
  }
}

template <int R>
__attribute__((always_inline)) inline void accumulate(const TileArgs& t, int64_t k, const Vec (&w)[kNrVecs],
                                                      Vec (&acc)[R][kNrVecs]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const Vec av(t.a[r * t.lda + k]);
#pragma GCC unroll 4
    for (int v = 0; v < kNrVecs; ++v) acc[r][v] = at::vec::fmadd(av, w[v], acc[r][v]);
  }
}

// int8: sums of x * code; the channel scale joins in store_tile.
template <int R>
void tile_int8(const TileArgs& t, const int8_t* b, const int8_t* next, int64_t phase, int64_t step) {
  Vec acc[R][kNrVecs];
  zero<R>(acc);
  int64_t countdown = phase;
  const auto* bytes = reinterpret_cast<const uint8_t*>(b);
  for (int64_t k = 0; k < t.K; ++k) {
    Vec w[kNrVecs];
    widen_int8(b + k * kNr, w);
    prefetch_line<kNr>(bytes, reinterpret_cast<const uint8_t*>(next), k, countdown, step);
    accumulate<R>(t, k, w, acc);
  }
  store_tile<R>(t, acc);
}

// int8 with fp32 x over many row tiles of a panel (kWidenOnceTiles or more), in the AVX2 build: the panel's codes
// widened to fp32 once, at its first row tile, into a per-thread copy (K x kNr floats, L2-resident) that every row
// tile then reads as the fp32 packed tile reads its weights, instead of each row tile widening the codes again (per k
// and 6 rows, 12 FMAs and 2 conversions on the same two ports). The same products in the same order as tile_int8: the
// same sums, bit for bit. The embedded model's int8 linears, fp32 x, against the fp32 packed tile in one process
// (medians of three): 1.01 -> 0.97x its time at 32 rows, 1.04 -> 0.94x at 64; no gain at 16 rows (3 tiles). The
// AVX512 build keeps tile_int8: its copy, twice as wide, measured 0.97 -> 1.05x at 64 rows.
#if defined(CPU_CAPABILITY_AVX2)
constexpr int64_t kWidenOnceTiles = 4;
#else
constexpr int64_t kWidenOnceTiles = std::numeric_limits<int64_t>::max();
#endif

inline void widen_panel(const int8_t* b, int64_t K, const int8_t* next, float* dst) {
  for (int64_t k = 0; k < K; ++k) {
    Vec w[kNrVecs];
    widen_int8(b + k * kNr, w);
    for (int v = 0; v < kNrVecs; ++v) w[v].store(dst + k * kNr + v * kVecSize);
    if (next != nullptr && k % (kLine / kNr) == 0) __builtin_prefetch(next + k * kNr, 0, 2);  // a line per line
  }
}

// The calling thread's widened panel (run_tiles' threads each widen the panels they take).
inline std::vector<float>& widened_panel() {
  static thread_local std::vector<float> widened;
  return widened;
}

template <int R>
void tile_int8_widened(const TileArgs& t, const float* w32) {
  Vec acc[R][kNrVecs];
  zero<R>(acc);
  for (int64_t k = 0; k < t.K; ++k) {
    Vec w[kNrVecs];
    for (int v = 0; v < kNrVecs; ++v) w[v] = Vec::loadu(w32 + k * kNr + v * kVecSize);
    accumulate<R>(t, k, w, acc);
  }
  store_tile<R>(t, acc);
}

// A group's (scale, zero) bf16 pairs of the panel's columns, widened.
inline void widen_scales_zeros(const int32_t* pairs, Vec (&scale)[kNrVecs], Vec (&zero_point)[kNrVecs]) {
  const IVec shift(16), high(static_cast<int32_t>(0xffff0000u));
  for (int v = 0; v < kNrVecs; ++v) {
    const IVec lanes = IVec::loadu(pairs + v * kVecSize);
    scale[v] = at::vec::cast<float>(lanes << shift);  // a bf16 is the high half of its fp32
    zero_point[v] = at::vec::cast<float>(lanes & high);
  }
}

// int4: per group, sum x * (q - 8) and sum x apart, then add scale * the first + zero * the second: the
// scales cost two FMAs per group and row instead of a dequantizing FMA per k, and the codes turn into fp32 by
// a table lookup, so that a k costs little more than its FMAs.
template <int R>
void tile_int4(const TileArgs& t, const int32_t* b, const int32_t* scales_zeros, int64_t group_size,
                      const float* x_sums, const int32_t* next, int64_t phase, int64_t step) {
  const int64_t groups = t.K / group_size;
  const auto* bytes = reinterpret_cast<const uint8_t*>(b);
  const auto* next_bytes = reinterpret_cast<const uint8_t*>(next);
  Vec acc[R][kNrVecs];
  zero<R>(acc);
  int64_t countdown = phase;
  for (int64_t g = 0; g < groups; ++g) {
    Vec part[R][kNrVecs];
    zero<R>(part);
    for (int64_t k8 = g * group_size / 8; k8 < (g + 1) * group_size / 8; ++k8) {
      Int4Words row(b + k8 * kNr);
      prefetch_line<kNr * 4>(bytes, next_bytes, k8, countdown, step);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        Vec w_even[kNrVecs], w_odd[kNrVecs];
        row.next_pair(w_even, w_odd);
        accumulate<R>(t, 8 * k8 + 2 * i, w_even, part);
        accumulate<R>(t, 8 * k8 + 2 * i + 1, w_odd, part);
      }
    }
    Vec scale[kNrVecs], zero_point[kNrVecs];
    widen_scales_zeros(scales_zeros + g * kNr, scale, zero_point);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const Vec x_sum(x_sums[r * groups + g]);
#pragma GCC unroll 4
      for (int v = 0; v < kNrVecs; ++v) {
        acc[r][v] = at::vec::fmadd(part[r][v], scale[v], acc[r][v]);
        acc[r][v] = at::vec::fmadd(x_sum, zero_point[v], acc[r][v]);
      }
    }
  }
  store_tile<R>(t, acc);
}

#if defined(CPU_CAPABILITY_AVX512)
// int4 with bf16 x on CPUs with AVX512-BF16 (chosen at run time): vdpbf16ps multiplies a pair of k per 32-bit
// lane, x's pair broadcast as it is in memory and the codes' pair looked up as bf16 (q - 8 is exact in bf16)
// from the 16-bit halves of Int4Words' layout by one vpermw. Products are exact and summed in fp32, so this
// differs from tile_int4 by summation order only; it issues half the instructions per k (Zen 4 runs
// vdpbf16ps at the FMA's rate, twice its multiply-adds).
// Taken where the packed bf16 linear's tile is (dp_tile: measured at start, HPI_CPU_BF16_TILE overrides): whether
// vdpbf16ps beats widening to fp32 is the CPU's, whatever the weight's format.

// int8 with bf16 x, likewise: codes k and k + 1 of 16 columns as bf16 pairs (int8_bf16_pairs, exact).
template <int R>
__attribute__((target("avx512bf16"))) void tile_int8_dp(const TileArgs& t, const c10::BFloat16* x, int64_t ldx,
                                                        const int8_t* b, const int8_t* next, int64_t phase,
                                                        int64_t step) {
  static_assert(kVecSize == 16, "AVX512: 16 columns of pairs per vector");
  const auto* bytes = reinterpret_cast<const uint8_t*>(b);
  const auto* next_bytes = reinterpret_cast<const uint8_t*>(next);
  __m512 acc[R][kNrVecs];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kNrVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  int64_t countdown = phase;
  for (int64_t k = 0; k < t.K; k += 2) {
    __m512bh w[kNrVecs];
    for (int v = 0; v < kNrVecs; ++v) {
      w[v] = (__m512bh)int8_bf16_pairs(b + k * kNr + v * kVecSize, b + (k + 1) * kNr + v * kVecSize);
    }
    prefetch_line<kNr>(bytes, next_bytes, k, countdown, step);
    prefetch_line<kNr>(bytes, next_bytes, k + 1, countdown, step);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + (t.row + r) * ldx + k, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < kNrVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, w[v]);
    }
  }
  Vec out[R][kNrVecs];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kNrVecs; ++v) out[r][v] = acc[r][v];
  }
  store_tile<R>(t, out);
}

template <int R>
__attribute__((target("avx512bf16"))) void tile_int4_dp(const TileArgs& t, const c10::BFloat16* x, int64_t ldx,
                                                        const int32_t* b, const int32_t* scales_zeros,
                                                        int64_t group_size, const float* x_sums, const int32_t* next,
                                                        int64_t phase, int64_t step) {
  static_assert(kVecSize == 16, "AVX512: 16 columns of pairs per vector");
  const int64_t groups = t.K / group_size;
  const auto* bytes = reinterpret_cast<const uint8_t*>(b);
  const auto* next_bytes = reinterpret_cast<const uint8_t*>(next);
  const __m512i codes_table = _mm512_load_si512(kInt4Bf16Codes);
  __m512 acc[R][kNrVecs];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kNrVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  int64_t countdown = phase;
  for (int64_t g = 0; g < groups; ++g) {
    __m512 part[R][kNrVecs];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < kNrVecs; ++v) part[r][v] = _mm512_setzero_ps();
    }
    for (int64_t k8 = g * group_size / 8; k8 < (g + 1) * group_size / 8; ++k8) {
      __m512i words[kNrVecs];
      for (int v = 0; v < kNrVecs; ++v) words[v] = _mm512_loadu_si512(b + k8 * kNr + v * kVecSize);
      prefetch_line<kNr * 4>(bytes, next_bytes, k8, countdown, step);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        __m512bh w[kNrVecs];
        for (int v = 0; v < kNrVecs; ++v) {
          w[v] = (__m512bh)_mm512_permutexvar_epi16(words[v], codes_table);
          words[v] = _mm512_srli_epi16(words[v], 4);
        }
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, x + (t.row + r) * ldx + 8 * k8 + 2 * i, sizeof(pair));
          const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
          for (int v = 0; v < kNrVecs; ++v) part[r][v] = _mm512_dpbf16_ps(part[r][v], xv, w[v]);
        }
      }
    }
    Vec scale[kNrVecs], zero_point[kNrVecs];
    widen_scales_zeros(scales_zeros + g * kNr, scale, zero_point);
    for (int r = 0; r < R; ++r) {
      const __m512 x_sum = _mm512_set1_ps(x_sums[r * groups + g]);
      for (int v = 0; v < kNrVecs; ++v) {
        acc[r][v] = _mm512_fmadd_ps(part[r][v], scale[v], acc[r][v]);
        acc[r][v] = _mm512_fmadd_ps(x_sum, zero_point[v], acc[r][v]);
      }
    }
  }
  Vec out[R][kNrVecs];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kNrVecs; ++v) out[r][v] = acc[r][v];
  }
  store_tile<R>(t, out);
}
#endif

// x as fp32 rows: itself when it is fp32 with unit column stride, else widened into a per-thread scratch.
const float* fp32_rows(const at::Tensor& a, int64_t& lda) {
  if (a.scalar_type() == at::kFloat) {
    lda = a.stride(0);
    return a.const_data_ptr<float>();
  }
  static thread_local std::vector<float> scratch;
  const int64_t M = a.size(0), K = a.size(1);
  if (scratch.size() < static_cast<size_t>(M * K)) scratch.resize(M * K);
  float* a32 = scratch.data();  // a pointer: inside parallel_for, `scratch` would name each worker's own
  const auto* src = a.const_data_ptr<c10::BFloat16>();
  const int64_t stride = a.stride(0);
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t k = 0; k < K; ++k) a32[m * K + k] = static_cast<float>(src[m * stride + k]);
    }
  });
  lda = K;
  return a32;
}

// [M, K / group_size]: each row's sum of x over each group of k, in fp32 (int4's zero points multiply it), a vector
// at a time in an order that depends on the row alone. (A scalar loop over k with a division per element cost as
// much as the tiles of a 576 x 576 layer at 32 rows.)
template <typename T>
void group_sums_of(const T* x, int64_t ldx, int64_t M, int64_t K, int64_t group_size, float* out) {
  const int64_t groups = K / group_size;
  for (int64_t m = 0; m < M; ++m) {
    const T* row = x + m * ldx;
    for (int64_t g = 0; g < groups; ++g) {
      Vec sum(0.f);
      int64_t k = g * group_size;
      for (; k + kVecSize <= (g + 1) * group_size; k += kVecSize) {
        if constexpr (std::is_same_v<T, float>) {
          sum = sum + Vec::loadu(row + k);
        } else {
          const auto halves = at::vec::Vectorized<c10::BFloat16>::loadu(row + k, kVecSize);
          sum = sum + std::get<0>(at::vec::convert_bfloat16_float(halves));
        }
      }
      float lanes[kVecSize];
      sum.store(lanes);
      float total = 0.f;
      for (const float lane : lanes) total += lane;
      for (; k < (g + 1) * group_size; ++k) total += static_cast<float>(row[k]);
      out[m * groups + g] = total;
    }
  }
}

std::vector<float> group_sums(const at::Tensor& a, int64_t group_size) {
  const int64_t M = a.size(0), K = a.size(1);
  std::vector<float> sums(static_cast<size_t>(M * (K / group_size)));
  if (a.scalar_type() == at::kFloat) {
    group_sums_of(a.const_data_ptr<float>(), a.stride(0), M, K, group_size, sums.data());
  } else {
    group_sums_of(a.const_data_ptr<c10::BFloat16>(), a.stride(0), M, K, group_size, sums.data());
  }
  return sums;
}

// W4A8 (int4_a8_linear): x quantized to int8 per row and group of k, as llama.cpp's Q4_0 x Q8_0 dot products do,
// so that int8 x int4 products are summed exactly in int32, four per 32-bit lane and instruction (vpdpbusd on
// CPUs with AVX512-VNNI), where the float tiles multiply-add two (vdpbf16ps) or one (FMA). Per row and group:
// scale = max|x| / 127, codes = round(x / scale) (to nearest, ties to even); a group's dot product with a
// column is then scale * sum(code * (q - 8)), exact up to the rounding of x, and the int4 weight's own scale and
// zero point apply to it as in tile_int4 (the zero point to the exact sum of x).
// The codes of each run of 8 k are stored in the order in which Int4Words' nibbles leave a 32-bit word by a mask
// (k = 0, 4, 1, 5 in its four bytes) and by a shift and the mask (2, 6, 3, 7): one 32-bit broadcast of x's codes
// then meets four codes of each column's word.
constexpr int64_t kNibbleOrder[8] = {0, 4, 1, 5, 2, 6, 3, 7};
constexpr int kMrInt4A8 = kVecSize >= 16 ? 4 : 2;  // as kMrInt4: 6 rows measured the same (1.09-1.29x bf16)

// W8A8 (int8_a8_linear) quantizes x the same way, per row and group of kA8Group k (llama.cpp's Q8_0 blocks), with
// the codes in k's order, and sums them against the int8 panels exactly in int32.
constexpr int64_t kA8Group = 32;

struct Int8Rows {
  int64_t groups = 0;
  std::vector<int8_t> codes;     // [M, K]: runs of 8 in kNibbleOrder (W4A8) or in k's order (W8A8)
  std::vector<float> scales;     // [M, groups]
  // [M, groups]: -bias * the sum of the group's codes, where the tiles multiply x's codes by the weight's code +
  // bias as unsigned bytes: W4A8's words hold q, not q - 8 (bias 8); W8A8 flips the int8 code's sign bit (128).
  std::vector<int32_t> offsets;
};

// One row's group of x (`count` values, a multiple of 8) quantized into codes (kNibbleOrder runs where Nibbles,
// else k's order); returns the sum of its codes. The vector and scalar paths give the same codes: one fp32
// multiply, then round to even.
template <bool Nibbles, typename T>
int32_t quantize_group(const T* x, int64_t count, float inv, int8_t* codes) {
  int32_t sum = 0;
  int64_t k = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i order = Nibbles ? _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15)
                                : _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; k + 16 <= count; k += 16) {
    const __m512 scaled = _mm512_mul_ps(load_float(x + k), _mm512_set1_ps(inv));
    const __m512i ints = _mm512_cvt_roundps_epi32(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    sum += _mm512_reduce_add_epi32(ints);
    const __m128i bytes = _mm_shuffle_epi8(_mm512_cvtsepi32_epi8(ints), order);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + k), bytes);
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i order = Nibbles ? _mm_setr_epi8(0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15)
                                : _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (; k + 16 <= count; k += 16) {
    // Rounded by the MXCSR's mode, to nearest even as std::nearbyint below; NaN gives INT_MIN, saturated to -128.
    const __m256i first = _mm256_cvtps_epi32(_mm256_mul_ps(load_float(x + k), _mm256_set1_ps(inv)));
    const __m256i second = _mm256_cvtps_epi32(_mm256_mul_ps(load_float(x + k + 8), _mm256_set1_ps(inv)));
    const __m256i both = _mm256_add_epi32(first, second);
    const __m128i halves = _mm_add_epi32(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
    const __m128i pairs = _mm_add_epi32(halves, _mm_shuffle_epi32(halves, 0x4e));
    sum += _mm_cvtsi128_si32(_mm_add_epi32(pairs, _mm_shuffle_epi32(pairs, 0xb1)));
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(first, second), 0xd8);  // k 0..15 as int16
    const __m128i bytes = _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + k), _mm_shuffle_epi8(bytes, order));
  }
#endif
  for (; k < count; k += 8) {
    for (int64_t p = 0; p < 8; ++p) {
      const float scaled = static_cast<float>(x[k + (Nibbles ? kNibbleOrder[p] : p)]) * inv;
      const int32_t code = std::isnan(scaled) ? -128 : static_cast<int32_t>(std::nearbyint(std::clamp(scaled, -128.f, 127.f)));
      codes[k + p] = static_cast<int8_t>(code);
      sum += code;
    }
  }
  return sum;
}

constexpr float kMinAmax = 1e-36f;

template <bool Nibbles, typename T>
void quantize_rows(const T* x, int64_t ldx, int64_t M, int64_t K, int64_t group_size, int32_t bias, Int8Rows& out) {
  const int64_t groups = K / group_size;
  at::parallel_for(0, M, std::max<int64_t>(1, 16384 / K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t g = 0; g < groups; ++g) {
        const T* group = x + m * ldx + g * group_size;
        Vec peak(0.f);
        int64_t k = 0;
        for (; k + kVecSize <= group_size; k += kVecSize) peak = at::vec::maximum(peak, load_float(group + k).abs());
        float amax = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); },
                                                    peak);
        for (; k < group_size; ++k) amax = std::max(amax, std::abs(static_cast<float>(group[k])));
        // A group whose largest |x| is below kMinAmax counts as zeros (codes and scale 0): 127 / amax would
        // overflow fp32 below ~3.7e-37. An inf or NaN amax gives codes 0 and a scale that carries it to the sums.
        const bool tiny = amax < kMinAmax;
        const float inv = tiny || !std::isfinite(amax) ? 0.f : 127.f / amax;
        const int32_t sum = quantize_group<Nibbles>(group, group_size, inv, out.codes.data() + m * K + g * group_size);
        out.scales[m * groups + g] = tiny ? 0.f : amax / 127.f;
        out.offsets[m * groups + g] = -bias * sum;
      }
    }
  });
}

// x's rows quantized for W4A8 (Nibbles: the int4 words' order, offsets for bias 8) or W8A8 (k's order, bias 128).
template <bool Nibbles>
Int8Rows int8_rows(const at::Tensor& a, int64_t group_size) {
  const int64_t M = a.size(0), K = a.size(1);
  const int32_t bias = Nibbles ? 8 : 128;
  Int8Rows rows;
  rows.groups = K / group_size;
  rows.codes.resize(static_cast<size_t>(M * K));
  rows.scales.resize(static_cast<size_t>(M * rows.groups));
  rows.offsets.resize(static_cast<size_t>(M * rows.groups));
  if (a.scalar_type() == at::kFloat) {
    quantize_rows<Nibbles>(a.const_data_ptr<float>(), a.stride(0), M, K, group_size, bias, rows);
  } else {
    quantize_rows<Nibbles>(a.const_data_ptr<c10::BFloat16>(), a.stride(0), M, K, group_size, bias, rows);
  }
  return rows;
}

// The epilogue of a group shared by both W4A8 tiles: acc += float(sum) * (weight scale * x scale), then the zero
// point times the exact sum of x.
template <int R>
__attribute__((always_inline)) inline void add_group(const Vec (&sums)[R][kNrVecs], const Vec (&scale)[kNrVecs],
                                                     const Vec (&zero_point)[kNrVecs], const float* x_scales,
                                                     const float* x_sums, int64_t groups, int64_t g,
                                                     Vec (&acc)[R][kNrVecs]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const Vec x_scale(x_scales[r * groups + g]), x_sum(x_sums[r * groups + g]);
#pragma GCC unroll 4
    for (int v = 0; v < kNrVecs; ++v) {
      acc[r][v] = at::vec::fmadd(sums[r][v], scale[v] * x_scale, acc[r][v]);
      acc[r][v] = at::vec::fmadd(x_sum, zero_point[v], acc[r][v]);
    }
  }
}

// W4A8 in plain loops: any CPU (the builds without AVX512, and AVX512 CPUs without VNNI).
template <int R>
void tile_int4_a8(const TileArgs& t, const Int8Rows& x, const int32_t* b, const int32_t* scales_zeros,
                  int64_t group_size, const float* x_sums) {
  const int64_t groups = x.groups;
  const int8_t* codes = x.codes.data() + t.row * t.K;
  Vec acc[R][kNrVecs];
  zero<R>(acc);
  for (int64_t g = 0; g < groups; ++g) {
    int32_t part[R][kNr];
    for (int r = 0; r < R; ++r) std::fill_n(part[r], kNr, x.offsets[(t.row + r) * groups + g]);
    for (int64_t k8 = g * group_size / 8; k8 < (g + 1) * group_size / 8; ++k8) {
      for (int64_t j = 0; j < kNr; ++j) {
        const auto word = static_cast<uint32_t>(b[k8 * kNr + j]);
        for (int64_t p = 0; p < 4; ++p) {
          const int32_t low = (word >> (8 * p)) & 0xf, high = (word >> (8 * p + 4)) & 0xf;
          for (int r = 0; r < R; ++r) {
            part[r][j] += low * codes[r * t.K + 8 * k8 + p] + high * codes[r * t.K + 8 * k8 + 4 + p];
          }
        }
      }
    }
    Vec sums[R][kNrVecs], scale[kNrVecs], zero_point[kNrVecs];
    for (int r = 0; r < R; ++r) {
      float lanes[kNr];
      for (int64_t j = 0; j < kNr; ++j) lanes[j] = static_cast<float>(part[r][j]);
      for (int v = 0; v < kNrVecs; ++v) sums[r][v] = Vec::loadu(lanes + v * kVecSize);
    }
    widen_scales_zeros(scales_zeros + g * kNr, scale, zero_point);
    add_group<R>(sums, scale, zero_point, x.scales.data() + t.row * groups, x_sums, groups, g, acc);
  }
  store_tile<R>(t, acc);
}

#if defined(CPU_CAPABILITY_AVX512)
bool cpu_has_vnni() {
  static const bool vnni = __builtin_cpu_supports("avx512vnni");
  return vnni;
}

// The int32 sums of group g of the tile's rows, started at the rows' offsets (both vpdpbusd tiles).
template <int R>
__attribute__((always_inline)) inline void start_group(const Int8Rows& x, int64_t row, int64_t g,
                                                       __m512i (&part)[R][kNrVecs]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kNrVecs; ++v) part[r][v] = _mm512_set1_epi32(x.offsets[(row + r) * x.groups + g]);
  }
}

// W4A8 with vpdpbusd: per 8 k and column, the word's low nibbles (k = 0, 4, 1, 5) and high ones (2, 6, 3, 7) as
// unsigned bytes against a broadcast of x's four codes for the same k; int32 sums per group, started at the
// group's offset (-8 * sum of x's codes) so that they come out as sum(code * (q - 8)).
template <int R>
__attribute__((target("avx512vnni"))) void tile_int4_a8_vnni(const TileArgs& t, const Int8Rows& x, const int32_t* b,
                                                             const int32_t* scales_zeros, int64_t group_size,
                                                             const float* x_sums, const int32_t* next, int64_t phase,
                                                             int64_t step) {
  static_assert(kVecSize == 16, "AVX512: 16 columns per vector");
  const int64_t groups = x.groups;
  const int8_t* codes = x.codes.data() + t.row * t.K;
  const auto* bytes = reinterpret_cast<const uint8_t*>(b);
  const auto* next_bytes = reinterpret_cast<const uint8_t*>(next);
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  Vec acc[R][kNrVecs];
  zero<R>(acc);
  int64_t countdown = phase;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i part[R][kNrVecs];
    start_group<R>(x, t.row, g, part);
    for (int64_t k8 = g * group_size / 8; k8 < (g + 1) * group_size / 8; ++k8) {
      __m512i low[kNrVecs], high[kNrVecs];
      for (int v = 0; v < kNrVecs; ++v) {
        const __m512i words = _mm512_loadu_si512(b + k8 * kNr + v * kVecSize);
        low[v] = _mm512_and_si512(words, nibble);
        high[v] = _mm512_and_si512(_mm512_srli_epi32(words, 4), nibble);
      }
      prefetch_line<kNr * 4>(bytes, next_bytes, k8, countdown, step);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        int32_t first, second;
        std::memcpy(&first, codes + r * t.K + 8 * k8, sizeof(first));
        std::memcpy(&second, codes + r * t.K + 8 * k8 + 4, sizeof(second));
        const __m512i x_low = _mm512_set1_epi32(first), x_high = _mm512_set1_epi32(second);
        for (int v = 0; v < kNrVecs; ++v) {
          part[r][v] = _mm512_dpbusd_epi32(part[r][v], low[v], x_low);
          part[r][v] = _mm512_dpbusd_epi32(part[r][v], high[v], x_high);
        }
      }
    }
    Vec sums[R][kNrVecs], scale[kNrVecs], zero_point[kNrVecs];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < kNrVecs; ++v) sums[r][v] = _mm512_cvtepi32_ps(part[r][v]);
    }
    widen_scales_zeros(scales_zeros + g * kNr, scale, zero_point);
    add_group<R>(sums, scale, zero_point, x.scales.data() + t.row * groups, x_sums, groups, g, acc);
  }
  store_tile<R>(t, acc);
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// The AVX2 build's integer tiles' shared steps (the AVX2 baseline: they inline into the AVX-VNNI tiles too): a group's
// int32 sums started at the rows' offsets; 8 k of a W4A8 panel row's words split into their low and high nibbles
// (unsigned bytes); a W4A8 group's sums folded into the fp32 accumulators with the group's scales and zero points.
template <int R>
__attribute__((always_inline)) inline void start_group(const Int8Rows& x, int64_t row, int64_t g,
                                                       __m256i (&part)[R][kNrVecs]) {
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kNrVecs; ++v) part[r][v] = _mm256_set1_epi32(x.offsets[(row + r) * x.groups + g]);
  }
}

__attribute__((always_inline)) inline void split_nibbles(const int32_t* b, int64_t k8, __m256i (&low)[kNrVecs],
                                                         __m256i (&high)[kNrVecs]) {
  const __m256i nibble = _mm256_set1_epi8(0x0f);
  for (int v = 0; v < kNrVecs; ++v) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + k8 * kNr + v * kVecSize));
    low[v] = _mm256_and_si256(words, nibble);
    high[v] = _mm256_and_si256(_mm256_srli_epi32(words, 4), nibble);
  }
}

template <int R>
__attribute__((always_inline)) inline void fold_int4_group(const __m256i (&part)[R][kNrVecs], const Int8Rows& x,
                                                           int64_t row, const int32_t* scales_zeros,
                                                           const float* x_sums, int64_t g, Vec (&acc)[R][kNrVecs]) {
  Vec sums[R][kNrVecs], scale[kNrVecs], zero_point[kNrVecs];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kNrVecs; ++v) sums[r][v] = _mm256_cvtepi32_ps(part[r][v]);
  }
  widen_scales_zeros(scales_zeros + g * kNr, scale, zero_point);
  add_group<R>(sums, scale, zero_point, x.scales.data() + row * x.groups, x_sums, x.groups, g, acc);
}

// W4A8 on AVX2 (no VNNI): vpmaddubsw multiplies the nibbles (unsigned bytes) by x's codes and adds adjacent pairs
// into int16 (at most 2 * 15 * 127: no saturation), the low and high nibbles' results are added as int16 (at most
// 7620) and vpmaddwd with ones widens the pairs into the int32 sums: four instructions per 8 k, row and vector,
// where the fp32 tile issues eight FMAs.
template <int R>
void tile_int4_a8_avx2(const TileArgs& t, const Int8Rows& x, const int32_t* b, const int32_t* scales_zeros,
                       int64_t group_size, const float* x_sums, const int32_t* next, int64_t phase, int64_t step) {
  static_assert(kVecSize == 8, "AVX2: 8 columns per vector");
  const int64_t groups = x.groups;
  const int8_t* codes = x.codes.data() + t.row * t.K;
  const auto* bytes = reinterpret_cast<const uint8_t*>(b);
  const auto* next_bytes = reinterpret_cast<const uint8_t*>(next);
  const __m256i ones = _mm256_set1_epi16(1);
  Vec acc[R][kNrVecs];
  zero<R>(acc);
  int64_t countdown = phase;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i part[R][kNrVecs];
    start_group<R>(x, t.row, g, part);
    for (int64_t k8 = g * group_size / 8; k8 < (g + 1) * group_size / 8; ++k8) {
      __m256i low[kNrVecs], high[kNrVecs];
      split_nibbles(b, k8, low, high);
      prefetch_line<kNr * 4>(bytes, next_bytes, k8, countdown, step);
      for (int r = 0; r < R; ++r) {
        int32_t first, second;
        std::memcpy(&first, codes + r * t.K + 8 * k8, sizeof(first));
        std::memcpy(&second, codes + r * t.K + 8 * k8 + 4, sizeof(second));
        const __m256i x_low = _mm256_set1_epi32(first), x_high = _mm256_set1_epi32(second);
        for (int v = 0; v < kNrVecs; ++v) {
          const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low[v], x_low),
                                                 _mm256_maddubs_epi16(high[v], x_high));
          part[r][v] = _mm256_add_epi32(part[r][v], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    fold_int4_group<R>(part, x, t.row, scales_zeros, x_sums, g, acc);
  }
  store_tile<R>(t, acc);
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// AVX-VNNI (vpdpbusd on 256-bit vectors, VEX-encoded) in the AVX2 build: CPUs with AVX2 and AVX-VNNI but no AVX512
// (Intel's E-core Xeons such as Sierra Forest, Alder Lake and later client cores) sum four byte products per 32-bit
// lane in one instruction where vpmaddubsw + vpmaddwd + vpaddd take three. HPI_CPU_AVX_VNNI=0 keeps the vpmaddubsw
// tiles (the tests run both on a CPU that has it).
bool cpu_has_avx_vnni() {
  static const bool available = [] {
    const char* setting = std::getenv("HPI_CPU_AVX_VNNI");
    return __builtin_cpu_supports("avxvnni") && !(setting != nullptr && std::strcmp(setting, "0") == 0);
  }();
  return available;
}

constexpr int kMrA8Avxvnni = 4;  // rows per W4A8 / W8A8 AVX-VNNI tile: 8 int32 sums of 16 registers

// W4A8 with AVX-VNNI: tile_int4_a8_vnni's scheme on 8-column vectors, 4 rows a tile.
template <int R>
__attribute__((target("avxvnni"))) void tile_int4_a8_avxvnni(const TileArgs& t, const Int8Rows& x, const int32_t* b,
                                                             const int32_t* scales_zeros, int64_t group_size,
                                                             const float* x_sums, const int32_t* next, int64_t phase,
                                                             int64_t step) {
  static_assert(kVecSize == 8, "AVX2: 8 columns per vector");
  const int64_t groups = x.groups;
  const int8_t* codes = x.codes.data() + t.row * t.K;
  const auto* bytes = reinterpret_cast<const uint8_t*>(b);
  const auto* next_bytes = reinterpret_cast<const uint8_t*>(next);
  Vec acc[R][kNrVecs];
  zero<R>(acc);
  int64_t countdown = phase;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i part[R][kNrVecs];
    start_group<R>(x, t.row, g, part);
    for (int64_t k8 = g * group_size / 8; k8 < (g + 1) * group_size / 8; ++k8) {
      __m256i low[kNrVecs], high[kNrVecs];
      split_nibbles(b, k8, low, high);
      prefetch_line<kNr * 4>(bytes, next_bytes, k8, countdown, step);
      for (int r = 0; r < R; ++r) {
        int32_t first, second;
        std::memcpy(&first, codes + r * t.K + 8 * k8, sizeof(first));
        std::memcpy(&second, codes + r * t.K + 8 * k8 + 4, sizeof(second));
        const __m256i x_low = _mm256_set1_epi32(first), x_high = _mm256_set1_epi32(second);
        for (int v = 0; v < kNrVecs; ++v) {
          part[r][v] = _mm256_dpbusd_avx_epi32(part[r][v], low[v], x_low);
          part[r][v] = _mm256_dpbusd_avx_epi32(part[r][v], high[v], x_high);
        }
      }
    }
    fold_int4_group<R>(part, x, t.row, scales_zeros, x_sums, g, acc);
  }
  store_tile<R>(t, acc);
}
#endif

// W8A8 (int8_a8_linear): the int8 panels against x quantized per row and group of kA8Group k (int8_rows<false>).
// The tiles multiply x's codes by the weight's code + 128 (its sign bit flipped: an unsigned byte, as vpdpbusd
// wants) and start each group's int32 sums at -128 * the sum of x's codes, so that they come out as
// sum(code * w) exactly (at most 32 * 127 * 255 in magnitude); per group the sums join the fp32 accumulators times
// x's scale, and the channel's scale applies once in store_tile (it is constant along k).
constexpr int kMrInt8A8 = kVecSize >= 16 ? 8 : 4;  // 8 of 4, 6, 8, 12 measured fastest (1.2-1.9x 6 at 1-64 rows)

// The epilogue of a W8A8 group: acc += float(sums) * x's scale for the group.
template <int R>
__attribute__((always_inline)) inline void add_a8_group(const Vec (&sums)[R][kNrVecs], const float* x_scales,
                                                        int64_t groups, int64_t g, Vec (&acc)[R][kNrVecs]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const Vec x_scale(x_scales[r * groups + g]);
#pragma GCC unroll 4
    for (int v = 0; v < kNrVecs; ++v) acc[r][v] = at::vec::fmadd(sums[r][v], x_scale, acc[r][v]);
  }
}

// W8A8 in plain loops: any CPU (tested everywhere; the runtime takes W8A8 by default only on the vpdpbusd tiles).
template <int R>
void tile_int8_a8(const TileArgs& t, const Int8Rows& x, const int8_t* b) {
  const int64_t groups = x.groups;
  const int8_t* codes = x.codes.data() + t.row * t.K;
  Vec acc[R][kNrVecs];
  zero<R>(acc);
  for (int64_t g = 0; g < groups; ++g) {
    int32_t part[R][kNr];
    for (int r = 0; r < R; ++r) std::fill_n(part[r], kNr, x.offsets[(t.row + r) * groups + g]);
    for (int64_t k = g * kA8Group; k < (g + 1) * kA8Group; ++k) {
      for (int64_t j = 0; j < kNr; ++j) {
        const int32_t w = static_cast<int32_t>(b[k * kNr + j]) + 128;
        for (int r = 0; r < R; ++r) part[r][j] += w * codes[r * t.K + k];
      }
    }
    Vec sums[R][kNrVecs];
    for (int r = 0; r < R; ++r) {
      float lanes[kNr];
      for (int64_t j = 0; j < kNr; ++j) lanes[j] = static_cast<float>(part[r][j]);
      for (int v = 0; v < kNrVecs; ++v) sums[r][v] = Vec::loadu(lanes + v * kVecSize);
    }
    add_a8_group<R>(sums, x.scales.data() + t.row * groups, groups, g, acc);
  }
  store_tile<R>(t, acc);
}

#if defined(CPU_CAPABILITY_AVX512)
// HPI_CPU_AVX512_VBMI=0 takes the unpack tile below on a CPU with VBMI too (the tests run both where it has it).
bool cpu_has_vnni_vbmi() {
  static const bool both = [] {
    const char* setting = std::getenv("HPI_CPU_AVX512_VBMI");
    return cpu_has_vnni() && __builtin_cpu_supports("avx512vbmi") &&
           !(setting != nullptr && std::strcmp(setting, "0") == 0);
  }();
  return both;
}

// The two W8A8 vpdpbusd tiles' shared steps: x's four codes at 4 k of each row against w, the four panel rows
// regrouped (two vectors of 16 columns, four codes per 32-bit lane); and a group's int32 sums folded into the fp32
// accumulators times x's scale.
template <int R>
__attribute__((target("avx512vnni"), always_inline)) inline void dot_four_k(const int8_t* codes, int64_t K, int64_t k4,
                                                                           const __m512i (&w)[kNrVecs],
                                                                           __m512i (&part)[R][kNrVecs]) {
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    int32_t four;
    std::memcpy(&four, codes + r * K + 4 * k4, sizeof(four));
    const __m512i xv = _mm512_set1_epi32(four);
    for (int v = 0; v < kNrVecs; ++v) part[r][v] = _mm512_dpbusd_epi32(part[r][v], w[v], xv);
  }
}

template <int R>
__attribute__((always_inline)) inline void fold_group(const __m512i (&part)[R][kNrVecs], const Int8Rows& x,
                                                      int64_t row, int64_t g, Vec (&acc)[R][kNrVecs]) {
  Vec sums[R][kNrVecs];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kNrVecs; ++v) sums[r][v] = _mm512_cvtepi32_ps(part[r][v]);
  }
  add_a8_group<R>(sums, x.scales.data() + row * x.groups, x.groups, g, acc);
}

// W8A8 with vpdpbusd: four panel rows (k .. k + 3, 128 bytes) turn into two vectors of 16 columns whose 32-bit
// lanes hold a column's four codes (vpermi2b, AVX512-VBMI), the sign bits flipped; each meets a broadcast of x's
// four codes for the same k. Per 4 k and row: two vpdpbusd for 32 columns (128 multiply-adds), where the fp32
// tile issues eight FMAs and the vdpbf16ps tile four.
template <int R>
__attribute__((target("avx512vnni,avx512vbmi"))) void tile_int8_a8_vnni(const TileArgs& t, const Int8Rows& x,
                                                                       const int8_t* b, const int8_t* next,
                                                                       int64_t phase, int64_t step) {
  static_assert(kVecSize == 16 && kNr == 32, "AVX512: 16 columns per vector, 32 per panel row");
  alignas(64) static const auto kGather = [] {
    std::array<std::array<uint8_t, 64>, kNrVecs> idx{};
    for (int v = 0; v < kNrVecs; ++v) {
      for (int j = 0; j < kVecSize; ++j) {
        for (int i = 0; i < 4; ++i) idx[v][4 * j + i] = static_cast<uint8_t>(i * kNr + v * kVecSize + j);
      }
    }
    return idx;
  }();
  const int64_t groups = x.groups;
  const int8_t* codes = x.codes.data() + t.row * t.K;
  const auto* bytes = reinterpret_cast<const uint8_t*>(b);
  const auto* next_bytes = reinterpret_cast<const uint8_t*>(next);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i gather[kNrVecs];
  for (int v = 0; v < kNrVecs; ++v) gather[v] = _mm512_loadu_si512(kGather[v].data());
  Vec acc[R][kNrVecs];
  zero<R>(acc);
  int64_t countdown = phase;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i part[R][kNrVecs];
    start_group<R>(x, t.row, g, part);
#pragma GCC unroll 2
    for (int64_t k4 = g * kA8Group / 4; k4 < (g + 1) * kA8Group / 4; ++k4) {
      const __m512i first = _mm512_loadu_si512(b + 4 * k4 * kNr), second = _mm512_loadu_si512(b + (4 * k4 + 2) * kNr);
      __m512i w[kNrVecs];
      for (int v = 0; v < kNrVecs; ++v) w[v] = _mm512_xor_si512(_mm512_permutex2var_epi8(first, gather[v], second), sign);
      prefetch_line<4 * kNr>(bytes, next_bytes, k4, countdown, step);
      dot_four_k<R>(codes, t.K, k4, w, part);
    }
    fold_group<R>(part, x, t.row, g, acc);
  }
  store_tile<R>(t, acc);
}

// W8A8 with vpdpbusd where AVX512-VBMI is missing (Cascade Lake: AVX512-VNNI alone): the AVX-VNNI tile's regrouping at
// 512 bits. Four panel rows of 32 columns become two vectors whose 32-bit lanes hold a column's four codes, by two
// 256-bit lane shuffles, a byte unpack pair, two qword permutes and a word unpack pair per 4 k (AVX512BW), shared by
// the tile's rows. The first vector holds columns 0-3, 8-11, 16-19 and 24-27, the second 4-7, 12-15, 20-23 and 28-31;
// the sums stay in that order until one permute per row puts them back before store_tile.
template <int R>
__attribute__((target("avx512vnni,avx512bw"))) void tile_int8_a8_vnni_unpack(const TileArgs& t, const Int8Rows& x,
                                                                            const int8_t* b, const int8_t* next,
                                                                            int64_t phase, int64_t step) {
  static_assert(kVecSize == 16 && kNr == 32, "AVX512: 16 columns per vector, 32 per panel row");
  const int64_t groups = x.groups;
  const int8_t* codes = x.codes.data() + t.row * t.K;
  const auto* bytes = reinterpret_cast<const uint8_t*>(b);
  const auto* next_bytes = reinterpret_cast<const uint8_t*>(next);
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  const __m512i pairs_lo = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);    // (k, k + 1) of columns 0-31 in order
  const __m512i pairs_hi = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);  // (k + 2, k + 3), likewise
  Vec acc[R][kNrVecs];
  zero<R>(acc);
  int64_t countdown = phase;
  for (int64_t g = 0; g < groups; ++g) {
    __m512i part[R][kNrVecs];
    start_group<R>(x, t.row, g, part);
    for (int64_t k4 = g * kA8Group / 4; k4 < (g + 1) * kA8Group / 4; ++k4) {
      const __m512i rows01 = _mm512_loadu_si512(b + 4 * k4 * kNr), rows23 = _mm512_loadu_si512(b + (4 * k4 + 2) * kNr);
      const __m512i even = _mm512_shuffle_i64x2(rows01, rows23, _MM_SHUFFLE(1, 0, 1, 0));  // rows k, k + 2
      const __m512i odd = _mm512_shuffle_i64x2(rows01, rows23, _MM_SHUFFLE(3, 2, 3, 2));   // rows k + 1, k + 3
      const __m512i low = _mm512_unpacklo_epi8(even, odd);   // byte pairs of columns 0-7 and 16-23 per row pair
      const __m512i high = _mm512_unpackhi_epi8(even, odd);  // columns 8-15 and 24-31
      const __m512i first = _mm512_permutex2var_epi64(low, pairs_lo, high);   // (k, k + 1): columns 0-31
      const __m512i second = _mm512_permutex2var_epi64(low, pairs_hi, high);  // (k + 2, k + 3): columns 0-31
      const __m512i w[kNrVecs] = {_mm512_xor_si512(_mm512_unpacklo_epi16(first, second), sign),
                                  _mm512_xor_si512(_mm512_unpackhi_epi16(first, second), sign)};
      prefetch_line<4 * kNr>(bytes, next_bytes, k4, countdown, step);
      dot_four_k<R>(codes, t.K, k4, w, part);
    }
    fold_group<R>(part, x, t.row, g, acc);
  }
  const __m512i order0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i order1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int r = 0; r < R; ++r) {  // columns (0-3, 8-11, 16-19, 24-27), (4-7, ...) -> 0-15, 16-31
    const __m512 first = acc[r][0], second = acc[r][1];
    acc[r][0] = _mm512_permutex2var_ps(first, order0, second);
    acc[r][1] = _mm512_permutex2var_ps(first, order1, second);
  }
  store_tile<R>(t, acc);
}
#endif

#if defined(CPU_CAPABILITY_AVX2)
// W8A8 with AVX-VNNI: four panel rows (k .. k + 3, 16 columns each) turn into two vectors whose 32-bit lanes hold a
// column's four codes (byte and word unpacks within 128-bit halves, no VBMI here), the sign bits flipped. The first
// vector holds columns 0-3 and 8-11, the second 4-7 and 12-15; the tile keeps its sums in that order and puts them
// back in column order once, before store_tile.
template <int R>
__attribute__((target("avxvnni"))) void tile_int8_a8_avxvnni(const TileArgs& t, const Int8Rows& x, const int8_t* b,
                                                             const int8_t* next, int64_t phase, int64_t step) {
  static_assert(kVecSize == 8 && kNr == 16, "AVX2: 8 columns per vector, 16 per panel row");
  const int64_t groups = x.groups;
  const int8_t* codes = x.codes.data() + t.row * t.K;
  const auto* bytes = reinterpret_cast<const uint8_t*>(b);
  const auto* next_bytes = reinterpret_cast<const uint8_t*>(next);
  const __m256i sign = _mm256_set1_epi8(static_cast<char>(0x80));
  Vec acc[R][kNrVecs];
  zero<R>(acc);
  int64_t countdown = phase;
  for (int64_t g = 0; g < groups; ++g) {
    __m256i part[R][kNrVecs];
    start_group<R>(x, t.row, g, part);
    for (int64_t k4 = g * kA8Group / 4; k4 < (g + 1) * kA8Group / 4; ++k4) {
      const __m256i rows01 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 4 * k4 * kNr));
      const __m256i rows23 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + (4 * k4 + 2) * kNr));
      const __m256i even = _mm256_permute2x128_si256(rows01, rows23, 0x20);  // rows k, k + 2
      const __m256i odd = _mm256_permute2x128_si256(rows01, rows23, 0x31);   // rows k + 1, k + 3
      const __m256i low = _mm256_unpacklo_epi8(even, odd);   // columns 0-7: (k, k + 1) pairs | (k + 2, k + 3)
      const __m256i high = _mm256_unpackhi_epi8(even, odd);  // columns 8-15, likewise
      const __m256i first_pairs = _mm256_permute2x128_si256(low, high, 0x20);   // (k, k + 1): 0-7 | 8-15
      const __m256i second_pairs = _mm256_permute2x128_si256(low, high, 0x31);  // (k + 2, k + 3): 0-7 | 8-15
      const __m256i w[kNrVecs] = {_mm256_xor_si256(_mm256_unpacklo_epi16(first_pairs, second_pairs), sign),
                                  _mm256_xor_si256(_mm256_unpackhi_epi16(first_pairs, second_pairs), sign)};
      prefetch_line<4 * kNr>(bytes, next_bytes, k4, countdown, step);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, codes + r * t.K + 4 * k4, sizeof(four));
        const __m256i xv = _mm256_set1_epi32(four);
        for (int v = 0; v < kNrVecs; ++v) part[r][v] = _mm256_dpbusd_avx_epi32(part[r][v], w[v], xv);
      }
    }
    Vec sums[R][kNrVecs];
    for (int r = 0; r < R; ++r) {
      for (int v = 0; v < kNrVecs; ++v) sums[r][v] = _mm256_cvtepi32_ps(part[r][v]);
    }
    add_a8_group<R>(sums, x.scales.data() + t.row * groups, groups, g, acc);
  }
  for (int r = 0; r < R; ++r) {  // columns (0-3, 8-11), (4-7, 12-15) -> 0-7, 8-15
    const __m256 first = acc[r][0], second = acc[r][1];
    acc[r][0] = _mm256_permute2f128_ps(first, second, 0x20);
    acc[r][1] = _mm256_permute2f128_ps(first, second, 0x31);
  }
  store_tile<R>(t, acc);
}
#endif

// Which W8A8 tile this build runs on this CPU: "vnni" (AVX512-VNNI with AVX512-VBMI), "vnni_unpack" (AVX512-VNNI
// without VBMI, or HPI_CPU_AVX512_VBMI=0), "avxvnni" (the AVX2 build on a CPU with AVX-VNNI) or "portable" (the
// int8_a8_tile op; the runtime takes W8A8 by default where it is not "portable").
std::string int8_a8_tile() {
#if defined(CPU_CAPABILITY_AVX512)
  return cpu_has_vnni_vbmi() ? "vnni" : cpu_has_vnni() ? "vnni_unpack" : "portable";
#elif defined(CPU_CAPABILITY_AVX2)
  return cpu_has_avx_vnni() ? "avxvnni" : "portable";
#else
  return "portable";
#endif
}

// Which W4A8 tile this build runs on this CPU: "vnni" (AVX512-VNNI), "avxvnni" (the AVX2 build on a CPU with
// AVX-VNNI), "avx2" or "portable" (the int4_a8_tile op; the runtime takes W4A8 by default where it is not "portable").
std::string int4_a8_tile() {
#if defined(CPU_CAPABILITY_AVX512)
  return cpu_has_vnni() ? "vnni" : "portable";
#elif defined(CPU_CAPABILITY_AVX2)
  return cpu_has_avx_vnni() ? "avxvnni" : "avx2";
#else
  return "portable";
#endif
}

// The layer's shape and inputs, checked; shared by both formats.
struct Problem {
  at::Tensor a;      // [M, K] rows of x, unit column stride
  at::Tensor out;    // x's leading shape + [N], x's dtype (fp32 for int8_logits)
  at::Tensor bias;   // [N] fp32, or undefined
  int64_t M, K, N;
};

Problem problem(const char* op, const at::Tensor& x, int64_t K, int64_t N, const std::optional<at::Tensor>& bias,
                bool fp32_out = false) {
  TORCH_CHECK_VALUE((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() >= 1 &&
                        x.device().is_cpu(),
                    op, " takes float32 or bfloat16 CPU x [..., in_features], got ", x.scalar_type(), " ", x.sizes(),
                    " on ", x.device());
  TORCH_CHECK_VALUE(x.size(-1) == K, op, ": x has ", x.size(-1), " features, the packed weight ", K);
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK_VALUE(!has_bias || (bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == x.scalar_type()),
                    op, "'s bias must be ", x.scalar_type(), " [", N, "], got ", bias->scalar_type(), " ",
                    bias->sizes());
  at::Tensor a = x.reshape({-1, K});
  if (a.stride(1) != 1 || (a.size(0) > 1 && a.stride(0) < K)) a = a.contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = N;
  at::Tensor out = at::empty(out_shape, fp32_out ? x.options().dtype(at::kFloat) : x.options());
  return {a, out, has_bias ? bias->to(at::kFloat).contiguous() : at::Tensor(), a.size(0), K, N};
}

void check_panels(const char* op, const at::Tensor& packed, at::ScalarType dtype, int64_t out_features) {
  TORCH_CHECK_VALUE(packed.dim() == 3 && packed.size(2) == kNr && packed.scalar_type() == dtype &&
                        packed.is_contiguous() && packed.device().is_cpu(),
                    op, ": the packed weight must be a contiguous ", dtype, " CPU tensor [panels, rows, ", kNr,
                    "] from its pack op on this CPU, got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK_VALUE(out_features > (packed.size(0) - 1) * kNr && out_features <= packed.size(0) * kNr,
                    op, ": out_features ", out_features, " does not fit a packed weight of ", packed.size(0),
                    " panels of ", kNr, " columns");
}

// Runs `panel_tile(tile_args, panel, next_panel_or_null, phase, step, rows)` over every (panel, row tile),
// threads splitting the panels, rows in chunks of kMc.
template <int MaxRows, typename PanelTile>
void run_tiles(const Problem& p, const float* a, int64_t lda, const float* scales, int64_t panel_bytes,
               const uint8_t* packed, PanelTile&& panel_tile) {
  const int64_t panels = (p.N + kNr - 1) / kNr;
  const bool bf16_out = p.out.scalar_type() == at::kBFloat16;
  const size_t out_bytes = bf16_out ? 2 : 4;
  auto* out = static_cast<char*>(p.out.data_ptr());
  const float* bias = p.bias.defined() ? p.bias.const_data_ptr<float>() : nullptr;
  for (int64_t m0 = 0; m0 < p.M; m0 += kMc) {
    const int64_t mc = std::min(kMc, p.M - m0), tiles = (mc + MaxRows - 1) / MaxRows;
    at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t q = p0; q < p1; ++q) {
        const uint8_t* panel = packed + q * panel_bytes;
        const uint8_t* next = q + 1 < p1 ? panel + panel_bytes : nullptr;
        const int64_t ncols = std::min(kNr, p.N - q * kNr);
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t m = m0 + t * MaxRows, rows = std::min<int64_t>(MaxRows, m0 + mc - m);
          const TileArgs args{m, a + m * lda, lda, p.K, scales != nullptr ? scales + q * kNr : nullptr,
                              bias != nullptr ? bias + q * kNr : nullptr, out + (m * p.N + q * kNr) * out_bytes,
                              p.N, ncols, bf16_out};
          with_rows<MaxRows>(rows, [&](auto height) { panel_tile(height, args, q, panel, next, t, tiles); });
        }
      }
    });
  }
}

// Prefill: out = x @ W + bias over `dequantize(dst)`'s [K, N] copy in a per-thread scratch: bf16 for oneDNN's bf16
// GEMM where bf16_prefill_gemm() says so (bf16 x and out: the weight rounded to bf16, as an unquantized bf16 model's
// is), else fp32 for MKL's sgemm.
template <typename Dequantize>
void dequantized_mm(const Problem& p, Dequantize&& dequantize) {
  if (p.a.scalar_type() == at::kBFloat16 && p.out.scalar_type() == at::kBFloat16 && bf16_prefill_gemm()) {
    static thread_local at::Tensor scratch16;
    if (!scratch16.defined() || scratch16.numel() < p.K * p.N) scratch16 = at::empty({p.K * p.N}, p.a.options());
    dequantize(scratch16.data_ptr<c10::BFloat16>());
    const at::Tensor w = scratch16.narrow(0, 0, p.K * p.N).view({p.K, p.N});
    at::Tensor out2d = p.out.view({p.M, p.N});
    if (p.bias.defined()) {
      at::addmm_out(out2d, p.bias.to(at::kBFloat16), p.a, w);
    } else {
      at::mm_out(out2d, p.a, w);
    }
    return;
  }
  static thread_local at::Tensor scratch;
  if (!scratch.defined() || scratch.numel() < p.K * p.N) scratch = at::empty({p.K * p.N}, p.a.options().dtype(at::kFloat));
  dequantize(scratch.data_ptr<float>());
  at::Tensor out32 = at::mm(p.a.to(at::kFloat), scratch.narrow(0, 0, p.K * p.N).view({p.K, p.N}));
  if (p.bias.defined()) out32.add_(p.bias);
  p.out.view({p.M, p.N}).copy_(out32);
}

bool prefill_sized(const Problem& p) { return p.M > kMaxTileRows && p.K * p.N <= kMaxScratchFloats; }

std::tuple<at::Tensor, at::Tensor> pack_int8_weight(const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK_VALUE(qweight.dim() == 2 && qweight.scalar_type() == at::kChar && qweight.device().is_cpu(),
                    "pack_int8_weight takes int8 CPU codes [out_features, in_features], got ", qweight.scalar_type(),
                    " ", qweight.sizes(), " on ", qweight.device());
  const int64_t N = qweight.size(0), K = qweight.size(1), panels = (N + kNr - 1) / kNr;
  TORCH_CHECK_VALUE(scales.dim() == 1 && scales.size(0) == N && scales.is_floating_point(),
                    "pack_int8_weight's scales must be float [", N, "], got ", scales.scalar_type(), " ",
                    scales.sizes());
  at::Tensor packed = at::zeros({panels, K, kNr}, qweight.options());
  at::Tensor scales32 = at::zeros({panels * kNr}, scales.options().dtype(at::kFloat));
  scales32.narrow(0, 0, N).copy_(scales);
  const auto w = qweight.accessor<int8_t, 2>();
  int8_t* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t q = p0; q < p1; ++q) {
      const int64_t ncols = std::min(kNr, N - q * kNr);
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t j = 0; j < ncols; ++j) dst[(q * K + k) * kNr + j] = w[q * kNr + j][k];
      }
    }
  });
  return {packed, scales32};
}

void check_int8_weight(const char* op, const at::Tensor& packed, const at::Tensor& scales, int64_t out_features) {
  check_panels(op, packed, at::kChar, out_features);
  TORCH_CHECK_VALUE(scales.dim() == 1 && scales.size(0) == packed.size(0) * kNr && scales.scalar_type() == at::kFloat &&
                        scales.is_contiguous(),
                    op, ": scales must be the float32 [", packed.size(0) * kNr, "] from pack_int8_weight, got ",
                    scales.scalar_type(), " ", scales.sizes());
}

// fp32_out: the fp32 sums come out unrounded whatever x's dtype (int8_logits).
at::Tensor int8_linear_to(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          int64_t out_features, const std::optional<at::Tensor>& bias, bool fp32_out) {
  check_int8_weight("int8_linear", packed, scales, out_features);
  const Problem p = problem("int8_linear", x, packed.size(1), out_features, bias, fp32_out);
  if (p.M == 0) return p.out;
  const auto* codes = packed.const_data_ptr<int8_t>();
  const float* scale = scales.const_data_ptr<float>();
  if (prefill_sized(p)) {
    dequantized_mm(p, [&](auto* dst) {
      using T = std::remove_pointer_t<decltype(dst)>;
      at::parallel_for(0, p.K, 16, [&](int64_t k0, int64_t k1) {
        for (int64_t k = k0; k < k1; ++k) {
          for (int64_t q = 0; q * kNr < p.N; ++q) {
            const int64_t ncols = std::min(kNr, p.N - q * kNr);
            const int8_t* row = codes + (q * p.K + k) * kNr;
            for (int64_t j = 0; j < ncols; ++j) {
              dst[k * p.N + q * kNr + j] = static_cast<T>(row[j] * scale[q * kNr + j]);
            }
          }
        }
      });
    });
    return p.out;
  }
  const int64_t panel_bytes = p.K * kNr;
  if (p.a.scalar_type() == at::kBFloat16 && p.M >= kMinAmxRows && amx_tile(p.K)) {  // AMX where bf16 runs it
    const auto* x = p.a.const_data_ptr<c10::BFloat16>();
    const float* bias32 = p.bias.defined() ? p.bias.const_data_ptr<float>() : nullptr;
    if (fp32_out) {
      gemm_int8_amx(x, p.a.stride(0), codes, scale, bias32, p.M, p.K, p.N, p.out.data_ptr<float>());
    } else {
      gemm_int8_amx(x, p.a.stride(0), codes, scale, bias32, p.M, p.K, p.N, p.out.data_ptr<c10::BFloat16>());
    }
    return p.out;
  }
#if defined(CPU_CAPABILITY_AVX512)
  if (p.a.scalar_type() == at::kBFloat16 && p.K % 2 == 0 && dp_tile()) {
    const auto* x = p.a.const_data_ptr<c10::BFloat16>();
    const int64_t ldx = p.a.stride(0);
    run_tiles<kMrInt8>(p, nullptr, 0, scale, panel_bytes, reinterpret_cast<const uint8_t*>(codes),
                       [&](auto height, const TileArgs& args, int64_t, const uint8_t* panel, const uint8_t* next,
                           int64_t phase, int64_t step) {
                         tile_int8_dp<decltype(height)::value>(args, x, ldx, reinterpret_cast<const int8_t*>(panel),
                                                               reinterpret_cast<const int8_t*>(next), phase, step);
                       });
    return p.out;
  }
#endif
  int64_t lda = 0;
  const float* a = fp32_rows(p.a, lda);
  run_tiles<kMrInt8>(p, a, lda, scale, panel_bytes, reinterpret_cast<const uint8_t*>(codes),
                     [&](auto height, const TileArgs& args, int64_t, const uint8_t* panel, const uint8_t* next,
                         int64_t phase, int64_t step) {
                       const auto* codes8 = reinterpret_cast<const int8_t*>(panel);
                       if (step < kWidenOnceTiles) {
                         tile_int8<decltype(height)::value>(args, codes8, reinterpret_cast<const int8_t*>(next), phase,
                                                            step);
                         return;
                       }
                       std::vector<float>& widened = widened_panel();  // one per thread, whatever the tile's height
                       if (phase == 0) {
                         if (widened.size() < static_cast<size_t>(p.K * kNr)) widened.resize(p.K * kNr);
                         widen_panel(codes8, p.K, reinterpret_cast<const int8_t*>(next), widened.data());
                       }
                       tile_int8_widened<decltype(height)::value>(args, widened.data());
                     });
  return p.out;
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t out_features,
                       const std::optional<at::Tensor>& bias) {
  return int8_linear_to(x, packed, scales, out_features, bias, false);
}

// W8A8: x quantized to int8 per row and group of kA8Group k, for inputs of at most max_rows rows (-1: any number,
// prefill-sized too, so that a row's result does not depend on its batch); more rows, or K no multiple of
// kA8Group, take int8_linear's float paths (the runtime measures where W8A8 stops winning: a8_max_rows in
// quant_linear.py).
// fp32_out as int8_linear_to's (int8_a8_logits).
at::Tensor int8_a8_linear_to(const char* op, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                             int64_t out_features, const std::optional<at::Tensor>& bias, int64_t max_rows,
                             bool fp32_out) {
  TORCH_CHECK_VALUE(max_rows >= -1, op, ": max_rows must be -1 (any) or >= 0, got ", max_rows);
  check_int8_weight(op, packed, scales, out_features);
  const Problem p = problem(op, x, packed.size(1), out_features, bias, fp32_out);
  if (p.M == 0) return p.out;
  if (p.K % kA8Group != 0 || (max_rows >= 0 && p.M > max_rows)) {
    return int8_linear_to(x, packed, scales, out_features, bias, fp32_out);
  }
  const Int8Rows rows = int8_rows<false>(p.a, kA8Group);
  const float* scale = scales.const_data_ptr<float>();
  const auto* panels = reinterpret_cast<const uint8_t*>(packed.const_data_ptr<int8_t>());
  auto codes = [](const uint8_t* panel) { return reinterpret_cast<const int8_t*>(panel); };
#if defined(CPU_CAPABILITY_AVX512)
  if (cpu_has_vnni_vbmi()) {
    run_tiles<kMrInt8A8>(p, nullptr, 0, scale, p.K * kNr, panels,
                         [&](auto height, const TileArgs& args, int64_t, const uint8_t* panel, const uint8_t* next,
                             int64_t phase, int64_t step) {
                           tile_int8_a8_vnni<decltype(height)::value>(args, rows, codes(panel), codes(next), phase,
                                                                      step);
                         });
    return p.out;
  }
  if (cpu_has_vnni()) {
    run_tiles<kMrInt8A8>(p, nullptr, 0, scale, p.K * kNr, panels,
                         [&](auto height, const TileArgs& args, int64_t, const uint8_t* panel, const uint8_t* next,
                             int64_t phase, int64_t step) {
                           tile_int8_a8_vnni_unpack<decltype(height)::value>(args, rows, codes(panel), codes(next),
                                                                             phase, step);
                         });
    return p.out;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if (cpu_has_avx_vnni()) {
    run_tiles<kMrA8Avxvnni>(p, nullptr, 0, scale, p.K * kNr, panels,
                            [&](auto height, const TileArgs& args, int64_t, const uint8_t* panel, const uint8_t* next,
                                int64_t phase, int64_t step) {
                              tile_int8_a8_avxvnni<decltype(height)::value>(args, rows, codes(panel), codes(next),
                                                                           phase, step);
                            });
    return p.out;
  }
#endif
  run_tiles<kMrInt8A8>(p, nullptr, 0, scale, p.K * kNr, panels,
                       [&](auto height, const TileArgs& args, int64_t, const uint8_t* panel, const uint8_t*, int64_t,
                           int64_t) { tile_int8_a8<decltype(height)::value>(args, rows, codes(panel)); });
  return p.out;
}

at::Tensor int8_a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          int64_t out_features, const std::optional<at::Tensor>& bias, int64_t max_rows) {
  return int8_a8_linear_to("int8_a8_linear", x, packed, scales, out_features, bias, max_rows, false);
}

// A quantized LM head's logits (packed_logits' int8 twin): fp32 out even for bf16 x, so that bf16's steps of 0.125
// at logits of 16-32 do not decide near-ties under argmax.
at::Tensor int8_logits(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t out_features) {
  return int8_linear_to(x, packed, scales, out_features, std::nullopt, true);
}

// The `count` largest of n logits, as indices into them (in no particular order): one pass that keeps the best
// `count` so far and compares a vector of logits at a time against the least of them.
std::vector<int64_t> top_indices(const float* logits, int64_t n, int64_t count) {
  std::vector<int64_t> index(count);
  std::vector<float> value(count);
  for (int64_t i = 0; i < count; ++i) index[i] = i, value[i] = logits[i];
  auto least = std::min_element(value.begin(), value.end()) - value.begin();
  auto take = [&](int64_t i) {
    if (!(logits[i] > value[least])) return;
    index[least] = i, value[least] = logits[i];
    least = std::min_element(value.begin(), value.end()) - value.begin();
  };
  using Vec = at::vec::Vectorized<float>;
  int64_t i = count;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    if ((Vec::loadu(logits + i) > Vec(value[least])).zero_mask() == (1 << Vec::size()) - 1) continue;
    for (int64_t j = i; j < i + Vec::size(); ++j) take(j);
  }
  for (; i < n; ++i) take(i);
  return index;
}

// Within how many nats of a row's largest W8A8 logit int8_a8_logits recomputes the leading ones: x's rounding moves a
// logit by hundredths of a nat on the embedded model (at most 0.07 over 1.5 M logits), so a token further behind
// cannot lead once recomputed.
constexpr float kRescoreMargin = 1.0f;

// W8A8 logits with each row's leaders recomputed from x as it is (fp64 sums of x times the codes, times the channel's
// scale: int8_logits' products, summed more exactly): the `rescore` largest that are within kRescoreMargin of the
// row's largest. x's rounding to int8 moves the other logits by its noise, but does not decide which of the leading
// tokens greedy decoding takes. Rows above max_rows take int8_logits whole.
at::Tensor int8_a8_logits(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          int64_t out_features, int64_t max_rows, int64_t rescore) {
  TORCH_CHECK_VALUE(rescore >= 0 && rescore <= out_features, "int8_a8_logits: rescore must be in [0, ",
                    out_features, "], got ", rescore);
  at::Tensor out = int8_a8_linear_to("int8_a8_logits", x, packed, scales, out_features, std::nullopt, max_rows, true);
  const int64_t K = packed.size(1), M = out.numel() / std::max<int64_t>(out_features, 1);
  if (rescore == 0 || M == 0 || K % kA8Group != 0 || (max_rows >= 0 && M > max_rows)) return out;
  const at::Tensor a = x.reshape({M, K}).to(at::kFloat).contiguous();
  const float* xs = a.const_data_ptr<float>();
  const auto* codes = packed.const_data_ptr<int8_t>();
  const float* scale = scales.const_data_ptr<float>();
  float* logits = out.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      float* row = logits + m * out_features;
      const std::vector<int64_t> top = top_indices(row, out_features, rescore);
      float largest = row[top[0]];
      for (const int64_t n : top) largest = std::max(largest, row[n]);
      for (const int64_t n : top) {
        if (row[n] < largest - kRescoreMargin) continue;
        const int8_t* column = codes + (n / kNr) * K * kNr + n % kNr;
        double sum = 0;
        for (int64_t k = 0; k < K; ++k) sum += static_cast<double>(xs[m * K + k]) * column[k * kNr];
        row[n] = static_cast<float>(sum * scale[n]);
      }
    }
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> pack_int4_weight(const at::Tensor& qweight, const at::Tensor& scales,
                                                    const at::Tensor& zeros, int64_t group_size) {
  TORCH_CHECK_VALUE(qweight.dim() == 2 && qweight.scalar_type() == at::kByte && qweight.device().is_cpu(),
                    "pack_int4_weight takes uint8 CPU codes [out_features, in_features / 2] (two per byte, the "
                    "first k in the high nibble), got ", qweight.scalar_type(), " ", qweight.sizes(), " on ",
                    qweight.device());
  const int64_t N = qweight.size(0), K = 2 * qweight.size(1), panels = (N + kNr - 1) / kNr;
  TORCH_CHECK_VALUE(group_size > 0 && group_size % 8 == 0 && K % group_size == 0, "pack_int4_weight: group_size ",
                    group_size, " must be a multiple of 8 that divides in_features ", K);
  const int64_t groups = K / group_size;
  for (const at::Tensor* t : {&scales, &zeros}) {
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == N && t->size(1) == groups && t->is_floating_point(),
                      "pack_int4_weight's scales and zeros must be float [", N, ", ", groups, "], got ",
                      t->scalar_type(), " ", t->sizes());
  }
  // Padding columns: code 8 at every k (with scale and zero 0 they dequantize to 0).
  at::Tensor packed = at::full({panels, K / 8, kNr}, static_cast<int32_t>(0x88888888u), qweight.options().dtype(at::kInt));
  at::Tensor scales_zeros = at::zeros({panels * kNr, groups, 2}, scales.options().dtype(at::kBFloat16));
  scales_zeros.narrow(0, 0, N).select(2, 0).copy_(scales);
  scales_zeros.narrow(0, 0, N).select(2, 1).copy_(zeros);
  scales_zeros = scales_zeros.view({panels, kNr, groups, 2}).permute({0, 2, 1, 3}).contiguous();
  const auto w = qweight.accessor<uint8_t, 2>();
  auto* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t q = p0; q < p1; ++q) {
      const int64_t ncols = std::min(kNr, N - q * kNr);
      for (int64_t k8 = 0; k8 < K / 8; ++k8) {
        for (int64_t j = 0; j < ncols; ++j) {
          uint32_t word = 0;
          for (int64_t i = 0; i < 8; ++i) {
            const uint8_t byte = w[q * kNr + j][(8 * k8 + i) / 2];
            word |= static_cast<uint32_t>(i % 2 == 0 ? byte >> 4 : byte & 0xf) << int4_bit(i);
          }
          dst[(q * (K / 8) + k8) * kNr + j] = word;
        }
      }
    }
  });
  return {packed, scales_zeros};
}

// a8_max_rows: W4A8 (x quantized to int8 per row and group) for inputs of at most that many rows (-1: any, 0:
// none). On the AVX512-VNNI EPYC its tile beat dequantize + GEMM at 256-2048 rows too (1.14-1.45x oneDNN's bf16
// GEMM, 2.5-3.4x MKL's sgemm over the int4 linears of the embedded model); with bf16 x where the AMX tiles run, the
// float path wins from 16 rows (0.4-0.8x W4A8's time), so the runtime measures where to switch.
at::Tensor int4_linear_impl(const char* op, const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales_zeros, int64_t group_size, int64_t out_features,
                            const std::optional<at::Tensor>& bias, int64_t a8_max_rows) {
  check_panels(op, packed, at::kInt, out_features);
  const int64_t K = 8 * packed.size(1);
  TORCH_CHECK_VALUE(group_size > 0 && group_size % 8 == 0 && K % group_size == 0, op, ": group_size ", group_size,
                    " must be a multiple of 8 that divides in_features ", K);
  TORCH_CHECK_VALUE(scales_zeros.dim() == 4 && scales_zeros.size(0) == packed.size(0) &&
                        scales_zeros.size(1) == K / group_size && scales_zeros.size(2) == kNr &&
                        scales_zeros.size(3) == 2 && scales_zeros.scalar_type() == at::kBFloat16 &&
                        scales_zeros.is_contiguous(),
                    op, ": scales_zeros must be the bfloat16 [", packed.size(0), ", ", K / group_size, ", ",
                    kNr, ", 2] from pack_int4_weight, got ", scales_zeros.scalar_type(), " ", scales_zeros.sizes());
  const Problem p = problem(op, x, K, out_features, bias);
  if (p.M == 0) return p.out;
  const bool int8_x = a8_max_rows < 0 || p.M <= a8_max_rows;  // W4A8 (x quantized to int8 per group) or float x
  const int32_t* codes = packed.const_data_ptr<int32_t>();
  const auto* sz = reinterpret_cast<const int32_t*>(scales_zeros.const_data_ptr<c10::BFloat16>());
  const int64_t groups = K / group_size, panel_words = K / 8 * kNr;
  if (!int8_x && prefill_sized(p)) {
    const auto* pairs = scales_zeros.const_data_ptr<c10::BFloat16>();
    dequantized_mm(p, [&](auto* dst) {
      using T = std::remove_pointer_t<decltype(dst)>;
      at::parallel_for(0, K, 16, [&](int64_t k0, int64_t k1) {
        for (int64_t k = k0; k < k1; ++k) {
          for (int64_t q = 0; q * kNr < p.N; ++q) {
            const int64_t ncols = std::min(kNr, p.N - q * kNr);
            const int32_t* row = codes + q * panel_words + (k / 8) * kNr;
            const c10::BFloat16* group = pairs + ((q * groups + k / group_size) * kNr) * 2;
            for (int64_t j = 0; j < ncols; ++j) {
              const int code = static_cast<int>((static_cast<uint32_t>(row[j]) >> int4_bit(k % 8)) & 0xf) - 8;
              dst[k * p.N + q * kNr + j] = static_cast<T>(static_cast<float>(code) * static_cast<float>(group[2 * j]) +
                                                          static_cast<float>(group[2 * j + 1]));
            }
          }
        }
      });
    });
    return p.out;
  }
  if (!int8_x && p.a.scalar_type() == at::kBFloat16 && p.M >= kMinAmxRows && amx_tile(K)) {  // as int8's
    gemm_int4_amx(p.a.const_data_ptr<c10::BFloat16>(), p.a.stride(0), codes, sz, group_size,
                  p.bias.defined() ? p.bias.const_data_ptr<float>() : nullptr, p.M, K, p.N,
                  p.out.data_ptr<c10::BFloat16>());
    return p.out;
  }
  const auto* panels = reinterpret_cast<const uint8_t*>(codes);
  const int64_t panel_bytes = panel_words * 4;
  auto words = [](const uint8_t* panel) { return reinterpret_cast<const int32_t*>(panel); };
  const std::vector<float> x_sums = group_sums(p.a, group_size);
  if (int8_x) {
    const Int8Rows rows = int8_rows<true>(p.a, group_size);
#if defined(CPU_CAPABILITY_AVX512)
    if (cpu_has_vnni()) {
      run_tiles<kMrInt4A8>(p, nullptr, 0, nullptr, panel_bytes, panels,
                           [&](auto height, const TileArgs& args, int64_t q, const uint8_t* panel, const uint8_t* next,
                               int64_t phase, int64_t step) {
                             tile_int4_a8_vnni<decltype(height)::value>(args, rows, words(panel), sz + q * groups * kNr,
                                                                        group_size, x_sums.data() + args.row * groups,
                                                                        words(next), phase, step);
                           });
      return p.out;
    }
#elif defined(CPU_CAPABILITY_AVX2)
    if (cpu_has_avx_vnni()) {
      run_tiles<kMrA8Avxvnni>(p, nullptr, 0, nullptr, panel_bytes, panels,
                              [&](auto height, const TileArgs& args, int64_t q, const uint8_t* panel,
                                  const uint8_t* next, int64_t phase, int64_t step) {
                                tile_int4_a8_avxvnni<decltype(height)::value>(
                                    args, rows, words(panel), sz + q * groups * kNr, group_size,
                                    x_sums.data() + args.row * groups, words(next), phase, step);
                              });
      return p.out;
    }
    run_tiles<kMrInt4A8>(p, nullptr, 0, nullptr, panel_bytes, panels,
                         [&](auto height, const TileArgs& args, int64_t q, const uint8_t* panel, const uint8_t* next,
                             int64_t phase, int64_t step) {
                           tile_int4_a8_avx2<decltype(height)::value>(args, rows, words(panel), sz + q * groups * kNr,
                                                                      group_size, x_sums.data() + args.row * groups,
                                                                      words(next), phase, step);
                         });
    return p.out;
#endif
    run_tiles<kMrInt4A8>(p, nullptr, 0, nullptr, panel_bytes, panels,
                         [&](auto height, const TileArgs& args, int64_t q, const uint8_t* panel, const uint8_t*,
                             int64_t, int64_t) {
                           tile_int4_a8<decltype(height)::value>(args, rows, words(panel), sz + q * groups * kNr,
                                                                 group_size, x_sums.data() + args.row * groups);
                         });
    return p.out;
  }
#if defined(CPU_CAPABILITY_AVX512)
  if (p.a.scalar_type() == at::kBFloat16 && dp_tile()) {  // x as it is: no fp32 copy
    const auto* x = p.a.const_data_ptr<c10::BFloat16>();
    const int64_t ldx = p.a.stride(0);
    run_tiles<kMrInt4>(p, nullptr, 0, nullptr, panel_bytes, panels,
                       [&](auto height, const TileArgs& args, int64_t q, const uint8_t* panel, const uint8_t* next,
                           int64_t phase, int64_t step) {
                         tile_int4_dp<decltype(height)::value>(args, x, ldx, words(panel), sz + q * groups * kNr,
                                                               group_size, x_sums.data() + args.row * groups,
                                                               words(next), phase, step);
                       });
    return p.out;
  }
#endif
  int64_t lda = 0;
  const float* a = fp32_rows(p.a, lda);
  run_tiles<kMrInt4>(p, a, lda, nullptr, panel_bytes, panels,
                     [&](auto height, const TileArgs& args, int64_t q, const uint8_t* panel, const uint8_t* next,
                         int64_t phase, int64_t step) {
                       tile_int4<decltype(height)::value>(args, words(panel), sz + q * groups * kNr, group_size,
                                                          x_sums.data() + args.row * groups,
                                                          words(next), phase, step);
                     });
  return p.out;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                       int64_t group_size, int64_t out_features, const std::optional<at::Tensor>& bias) {
  return int4_linear_impl("int4_linear", x, packed, scales_zeros, group_size, out_features, bias, 0);
}

// W4A8 for inputs of at most max_rows rows (-1: any number); more rows take int4_linear's float tiles, which
// measure faster there on some CPUs (AMX: the runtime's start-up measurement, int4_a8_max_rows in quant_linear.py).
at::Tensor int4_a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                          int64_t group_size, int64_t out_features, const std::optional<at::Tensor>& bias,
                          int64_t max_rows) {
  TORCH_CHECK_VALUE(max_rows >= -1, "int4_a8_linear: max_rows must be -1 (any) or >= 0, got ", max_rows);
  return int4_linear_impl("int4_a8_linear", x, packed, scales_zeros, group_size, out_features, bias, max_rows);
}

at::Tensor quant_linear_meta(const at::Tensor& x, int64_t out_features) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = c10::SymInt(out_features);
  return at::empty_symint(shape, x.options());
}

at::Tensor int8_linear_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, int64_t out_features,
                            const std::optional<at::Tensor>&) {
  return quant_linear_meta(x, out_features);
}

at::Tensor int8_a8_linear_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, int64_t out_features,
                               const std::optional<at::Tensor>&, int64_t) {
  return quant_linear_meta(x, out_features);
}

at::Tensor int8_logits_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, int64_t out_features) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = c10::SymInt(out_features);
  return at::empty_symint(shape, x.options().dtype(at::kFloat));
}

at::Tensor int8_a8_logits_meta(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                               int64_t out_features, int64_t, int64_t) {
  return int8_logits_meta(x, packed, scales, out_features);
}

at::Tensor int4_linear_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, int64_t, int64_t out_features,
                            const std::optional<at::Tensor>&) {
  return quant_linear_meta(x, out_features);
}

at::Tensor int4_a8_linear_meta(const at::Tensor& x, const at::Tensor&, const at::Tensor&, int64_t,
                               int64_t out_features, const std::optional<at::Tensor>&, int64_t) {
  return quant_linear_meta(x, out_features);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hpi_kernels, m) {
  m.def("pack_int8_weight(Tensor qweight, Tensor scales) -> (Tensor, Tensor)");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scales, int out_features, Tensor? bias=None) -> Tensor");
  m.def("int8_logits(Tensor x, Tensor packed, Tensor scales, int out_features) -> Tensor");
  m.def(
      "int8_a8_logits(Tensor x, Tensor packed, Tensor scales, int out_features, int max_rows=-1, "
      "int rescore=16) -> Tensor");
  m.def(
      "int8_a8_linear(Tensor x, Tensor packed, Tensor scales, int out_features, Tensor? bias=None, "
      "int max_rows=-1) -> Tensor");
  m.def("int8_a8_tile() -> str", &int8_a8_tile);
  m.def("pack_int4_weight(Tensor qweight, Tensor scales, Tensor zeros, int group_size) -> (Tensor, Tensor)");
  m.def(
      "int4_linear(Tensor x, Tensor packed, Tensor scales_zeros, int group_size, int out_features, "
      "Tensor? bias=None) -> Tensor");
  m.def(
      "int4_a8_linear(Tensor x, Tensor packed, Tensor scales_zeros, int group_size, int out_features, "
      "Tensor? bias=None, int max_rows=-1) -> Tensor");
  m.def("int4_a8_tile() -> str", &int4_a8_tile);
}

TORCH_LIBRARY_IMPL(hpi_kernels, CPU, m) {
  m.impl("pack_int8_weight", &pack_int8_weight);
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_logits", &int8_logits);
  m.impl("int8_a8_logits", &int8_a8_logits);
  m.impl("int8_a8_linear", &int8_a8_linear);
  m.impl("pack_int4_weight", &pack_int4_weight);
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_a8_linear", &int4_a8_linear);
}

TORCH_LIBRARY_IMPL(hpi_kernels, Meta, m) {
  m.impl("int8_linear", &int8_linear_meta);
  m.impl("int8_logits", &int8_logits_meta);
  m.impl("int8_a8_logits", &int8_a8_logits_meta);
  m.impl("int8_a8_linear", &int8_a8_linear_meta);
  m.impl("int4_linear", &int4_linear_meta);
  m.impl("int4_a8_linear", &int4_a8_linear_meta);
}
