// Batched LoRA on CPU: out[t] += B[s] (A[s] x[t]) in place, for each token t of slot s = slots[t] (-1: no
// adapter), the punica / S-LoRA delta in one call per projection (runtime/hpi_runtime/lora/layers.py calls it from the
// compiled model step and eagerly alike). The step's tokens are grouped by slot here, then split into tiles of
// up to kTile tokens of one slot: a tile reads each row of A[s] and of B[s] once for all of its tokens, so a
// slot's matrices stream from cache once per kTile tokens instead of once per token (the gathered `bmm` form
// reads them per token and was 15-40x slower, docs/lora.md).
//
// Shapes: x [T, K]; a [S, W, K] (slot s's A, W = parts x max_rank, zero-padded); bt [S, W, N] (slot s's B
// transposed: W rows of N outputs, so the expand is AXPYs over contiguous outputs, no horizontal sums); slots [T]
// int64; out [T, N], contiguous; part_cols: a fused projection's parts (q, k, v; gate, up), each with its own
// W / parts rows of A and Bt and its own columns of out: Bt is block-diagonal, and only its blocks are read (a
// third of qkv's Bt, half of gate_up's; reading the zeros too cost a quarter of the kernel's time). float32 or
// bfloat16 (x, a, bt and out alike; or bf16 slots under fp32 x and out, `--lora-dtype bfloat16`, half the bytes
// a step reads): bf16 is widened in registers, the sums (out[t] + the delta) are fp32, rounded once. Where the
// packed bf16 linears' start-up measurement chose vdpbf16ps (hpi_packed::dp_tile), the bf16 shrink multiplies x's
// and A's pairs with it instead, and the expand multiplies pairs of ranks: the shrunk tokens rounded to bf16, as a
// bf16 model's lora_A output is (13% less time than the widened expand at a 374-token prefill,
// bench/results/lora.md run 15). Where the packed bf16 linears run AMX tiles, a prefill chunk's runs of one slot
// take them too, over panels packed at slot load (amx_pieces, below).

#include "packed_linear.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kV = Vec::size();
constexpr int64_t kChunk = 2 * kV;  // elements per step: one Vectorized<BFloat16> widened into two of float
constexpr int kTile = 8;            // tokens of one slot per tile: 16 accumulators, 2 weight vectors

inline void load_chunk(const float* p, Vec& lo, Vec& hi) {
  lo = Vec::loadu(p);
  hi = Vec::loadu(p + kV);
}

// A chunk of bf16 is widened by its pairs: lo takes the even elements, hi the odd ones (a bf16 is the high half
// of its fp32: one shift or one mask per vector, no cross-lane shuffle). Every chunk-wise operation here pairs
// chunks of the same positions (an A row with x, an out row with a B row) and the dot products sum all of a
// chunk, so this order is as good as the natural one; store_chunk puts the pairs back.
using IVec = at::vec::Vectorized<int32_t>;
static_assert(IVec::size() == kV, "a chunk of bf16 is one vector of int32 pairs");

inline void load_chunk(const c10::BFloat16* p, Vec& lo, Vec& hi) {
  const IVec lanes = IVec::loadu(p);
  lo = at::vec::cast<float>(lanes << IVec(16));
  hi = at::vec::cast<float>(lanes & IVec(static_cast<int32_t>(0xffff0000u)));
}

inline void store_chunk(float* p, const Vec& lo, const Vec& hi) {
  lo.store(p);
  hi.store(p + kV);
}

// The bf16 nearest each lane of v (ties to even; NaN stays NaN) in the lane's high half.
inline IVec round_to_bf16_high(const Vec& v) {
  const IVec bits = at::vec::cast<int32_t>(v);
  const IVec rounded = bits + IVec(0x7fff) + ((bits >> IVec(16)) & IVec(1));
  return IVec::blendv(rounded, bits | IVec(0x00400000), at::vec::cast<int32_t>(v.isnan()));
}

inline void store_chunk(c10::BFloat16* p, const Vec& lo, const Vec& hi) {  // lo, hi: even, odd (load_chunk)
  const IVec high(static_cast<int32_t>(0xffff0000u));
  const IVec even = (round_to_bf16_high(lo) >> IVec(16)) & IVec(0xffff);
  (even | (round_to_bf16_high(hi) & high)).store(p);
}

// A chunk of weights (A or Bt, TW) widened to pair with a chunk of x or out (T) loaded by load_chunk: in the
// order load_chunk gives where the two share a type; bf16 slots under fp32 x and out in their natural order,
// since an fp32 chunk is loaded as it is.
template <typename T, typename TW>
inline void load_weights(const TW* p, Vec& lo, Vec& hi) {
  if constexpr (std::is_same_v<T, float> && std::is_same_v<TW, c10::BFloat16>) {
    std::tie(lo, hi) = at::vec::convert_to_float<c10::BFloat16>(at::vec::Vectorized<c10::BFloat16>::loadu(p));
  } else {
    load_chunk(p, lo, hi);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// store_chunk with AVX512-BF16's conversion (the same rounding: to nearest, ties to even, NaN stays NaN): both
// vectors rounded by one instruction, then their halves interleaved back into pairs, 3 instructions where the
// integer rounding above takes about 20 (the expand's stores were a third of its time at 4 tokens a tile).
__attribute__((target("avx512bf16"))) inline void store_chunk_cvt(c10::BFloat16* p, const Vec& lo, const Vec& hi) {
  const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lo's 16 bf16, then hi's
  _mm512_storeu_si512(p, _mm512_permutexvar_epi16(_mm512_load_si512(hpi_packed::kBf16PairInterleave), halves));
}
#endif

// The shrink of one tile for WB rows of A at once: h[r][w0 + b] = A[s][w0 + b] . xf[r] for r < n, b < WB, with
// xf the tile's rows of x already widened to fp32 (each A chunk is widened once for n tokens, each x chunk
// loaded once for WB rows of A; n * WB accumulators stay in registers). xf came from x of type T, A is TW.
template <typename T, typename TW, int n, int WB>
inline void shrink_block(const float* xf, const TW* a, int64_t w0, int64_t K, int64_t W, float* h) {
  const int64_t k_main = K / kChunk * kChunk;
  Vec acc[n][WB];
#pragma GCC unroll 8
  for (int r = 0; r < n; ++r) {
#pragma GCC unroll 4
    for (int b = 0; b < WB; ++b) acc[r][b] = Vec(0.f);
  }
  for (int64_t k = 0; k < k_main; k += kChunk) {
    Vec alo[WB], ahi[WB];
#pragma GCC unroll 4
    for (int b = 0; b < WB; ++b) load_weights<T>(a + (w0 + b) * K + k, alo[b], ahi[b]);
#pragma GCC unroll 8
    for (int r = 0; r < n; ++r) {
      const Vec xlo = Vec::loadu(xf + r * K + k), xhi = Vec::loadu(xf + r * K + k + kV);
#pragma GCC unroll 4
      for (int b = 0; b < WB; ++b) {
        acc[r][b] = at::vec::fmadd(alo[b], xlo, acc[r][b]);
        acc[r][b] = at::vec::fmadd(ahi[b], xhi, acc[r][b]);
      }
    }
  }
  for (int r = 0; r < n; ++r) {
    for (int b = 0; b < WB; ++b) {
      const TW* arow = a + (w0 + b) * K;
      float sum = at::vec::vec_reduce_all<float>([](const Vec& p, const Vec& q) { return p + q; }, acc[r][b]);
      for (int64_t k = k_main; k < K; ++k) sum += static_cast<float>(arow[k]) * xf[r * K + k];
      h[r * W + w0 + b] = sum;
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
constexpr int64_t kShrinkAhead = 256;  // elements of an A row (512 bytes) ahead of the one read

// shrink_block with vdpbf16ps for bf16 (where the measured bf16 tile is dpbf16, hpi_packed::dp_tile): x's rows and
// A's as they are in memory, 32 elements of k per instruction in pairs, products exact, fp32 sums (the same
// values as shrink_block's but for the order of the additions).
template <int n, int WB>
__attribute__((target("avx512bf16"))) void shrink_block_dp(const c10::BFloat16* x, const int64_t* rows,
                                                           const c10::BFloat16* a, int64_t w0, int64_t K, int64_t W,
                                                           float* h) {
  constexpr int64_t kStep = 32;
  const int64_t k_main = K / kStep * kStep;
  __m512 acc[n][WB];
  for (int r = 0; r < n; ++r) {
    for (int b = 0; b < WB; ++b) acc[r][b] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < k_main; k += kStep) {
    __m512bh av[WB];
#pragma GCC unroll 4
    for (int b = 0; b < WB; ++b) {
      if (k + kShrinkAhead < K) __builtin_prefetch(a + (w0 + b) * K + k + kShrinkAhead, 0, 3);
      av[b] = (__m512bh)_mm512_loadu_si512(a + (w0 + b) * K + k);
    }
#pragma GCC unroll 8
    for (int r = 0; r < n; ++r) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + rows[r] * K + k);
#pragma GCC unroll 4
      for (int b = 0; b < WB; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], av[b], xv);
    }
  }
  for (int r = 0; r < n; ++r) {
    for (int b = 0; b < WB; ++b) {
      const c10::BFloat16* arow = a + (w0 + b) * K;
      float sum = _mm512_reduce_add_ps(acc[r][b]);
      for (int64_t k = k_main; k < K; ++k) sum += static_cast<float>(arow[k]) * static_cast<float>(x[rows[r] * K + k]);
      h[r * W + w0 + b] = sum;
    }
  }
}
#endif

// The shrink with fp32 FMAs: the tile's x rows widened to fp32 once (xf), then WB rows of A at a time. x is T,
// A is TW (T, or bf16 slots under fp32 x).
template <typename T, typename TW, int n, int WB>
void shrink_widened(const T* x, const TW* a, const int64_t* rows, int64_t K, int64_t W, float* h, float* xf) {
  const int64_t k_main = K / kChunk * kChunk;
  for (int r = 0; r < n; ++r) {
    const T* xr = x + rows[r] * K;
    for (int64_t k = 0; k < k_main; k += kChunk) {
      Vec lo, hi;
      load_chunk(xr + k, lo, hi);
      store_chunk(xf + r * K + k, lo, hi);
    }
    for (int64_t k = k_main; k < K; ++k) xf[r * K + k] = static_cast<float>(xr[k]);
  }
  int64_t w0 = 0;
  for (; w0 + WB <= W; w0 += WB) shrink_block<T, TW, n, WB>(xf, a, w0, K, W, h);
  for (; w0 < W; ++w0) shrink_block<T, TW, n, 1>(xf, a, w0, K, W, h);
}

constexpr int64_t kExpandAhead = 4;  // chunks

// Both cache lines of a chunk (64 bytes of bf16, 128 of fp32) into L1.
template <typename T>
inline void prefetch_chunk(const T* p) {
  for (size_t b = 0; b < kChunk * sizeof(T); b += 64) __builtin_prefetch(reinterpret_cast<const char*>(p) + b, 0, 3);
}

// The expand of one part: out[rows[r]][j] += sum_w h[r][w] * bt[w][j] for its Wp rows of Bt and its columns j <
// cols (bt, out and h already offset to the part's first row, column and rank), fp32 sums over out's own values,
// rounded once. Row strides: N of bt and out, W of h. out is T, Bt is TW (T, or bf16 slots under fp32 out).
// Cvt: out's chunks are stored by store_chunk_cvt (expand_cvt, below).
template <typename T, typename TW, int n, bool Cvt = false>
__attribute__((always_inline)) inline void expand(const TW* bt, T* out, const int64_t* rows, int64_t Wp,
                                                  int64_t cols, int64_t N, int64_t W, const float* h) {
  const int64_t n_main = cols / kChunk * kChunk;
  for (int64_t j = 0; j < n_main; j += kChunk) {
    Vec lo[n], hi[n];
#pragma GCC unroll 8
    for (int r = 0; r < n; ++r) load_chunk(out + rows[r] * N + j, lo[r], hi[r]);
    for (int64_t w = 0; w < Wp; ++w) {
      Vec blo, bhi;
      // Wp rows of Bt are read side by side, a chunk of each: more streams than the hardware prefetcher follows,
      // so each row's chunk kExpandAhead steps on is asked for here.
      if (j + kExpandAhead * kChunk < n_main) prefetch_chunk(bt + w * N + j + kExpandAhead * kChunk);
      load_weights<T>(bt + w * N + j, blo, bhi);
#pragma GCC unroll 8
      for (int r = 0; r < n; ++r) {
        const Vec hw(h[r * W + w]);
        lo[r] = at::vec::fmadd(hw, blo, lo[r]);
        hi[r] = at::vec::fmadd(hw, bhi, hi[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < n; ++r) {
#if defined(CPU_CAPABILITY_AVX512)
      if constexpr (Cvt) {
        store_chunk_cvt(out + rows[r] * N + j, lo[r], hi[r]);
        continue;
      }
#endif
      store_chunk(out + rows[r] * N + j, lo[r], hi[r]);
    }
  }
  for (int r = 0; r < n; ++r) {
    for (int64_t j = n_main; j < cols; ++j) {
      float sum = static_cast<float>(out[rows[r] * N + j]);
      for (int64_t w = 0; w < Wp; ++w) sum += h[r * W + w] * static_cast<float>(bt[w * N + j]);
      out[rows[r] * N + j] = static_cast<T>(sum);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// expand for bf16 on a CPU with AVX512-BF16 (cvt: lora_add_'s check), out's chunks stored by store_chunk_cvt.
template <int n>
__attribute__((target("avx512bf16"))) void expand_cvt(const c10::BFloat16* bt, c10::BFloat16* out,
                                                      const int64_t* rows, int64_t Wp, int64_t cols, int64_t N,
                                                      int64_t W, const float* h) {
  expand<c10::BFloat16, c10::BFloat16, n, true>(bt, out, rows, Wp, cols, N, W, h);
}
#endif

constexpr int64_t kMaxDpPairs = 64;  // expand_dp's ranks per part, at most twice this (above: the widened expand)

#if defined(CPU_CAPABILITY_AVX512)
// expand with vdpbf16ps for bf16 (where the shrink takes it too): the tile's shrunk tokens rounded to bf16 (as a
// bf16 model computes B (A x): peft's lora_A output is bf16), paired along the rank, and each pair of Bt rows
// interleaved per column in registers, so one instruction does two ranks' multiply-adds for 16 columns where the
// widened FMAs did one. out's chunks keep load_chunk's even / odd order: the even columns' pairs are each 32-bit
// lane's low halves of the two rows, the odd ones' their high halves. fp32 sums over out's own values, rounded once.
template <int n>
__attribute__((target("avx512bf16"))) void expand_dp(const c10::BFloat16* bt, c10::BFloat16* out,
                                                     const int64_t* rows, int64_t Wp, int64_t cols, int64_t N,
                                                     int64_t W, const float* h) {
  const int64_t pairs = (Wp + 1) / 2;
  uint32_t hp[n][kMaxDpPairs];  // (bf16 h[r][2q], bf16 h[r][2q + 1]) in one 32-bit word: low, high
  float hr[n][2 * kMaxDpPairs];  // the same values as floats, for the scalar tail
  for (int r = 0; r < n; ++r) {
    for (int64_t w = 0; w < 2 * pairs; ++w) {
      const c10::BFloat16 v(w < Wp ? h[r * W + w] : 0.f);
      hr[r][w] = static_cast<float>(v);
      const uint32_t bits = v.x;
      hp[r][w / 2] = w % 2 ? (hp[r][w / 2] | bits << 16) : bits;
    }
  }
  const __m512i low = _mm512_set1_epi32(0xffff), high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
  const int64_t n_main = cols / kChunk * kChunk;
  for (int64_t j = 0; j < n_main; j += kChunk) {
    Vec lo[n], hi[n];
#pragma GCC unroll 8
    for (int r = 0; r < n; ++r) load_chunk(out + rows[r] * N + j, lo[r], hi[r]);
    __m512 even[n], odd[n];
#pragma GCC unroll 8
    for (int r = 0; r < n; ++r) {
      even[r] = lo[r];
      odd[r] = hi[r];
    }
    for (int64_t q = 0; q < pairs; ++q) {
      const int64_t w = 2 * q;
      if (j + kExpandAhead * kChunk < n_main) {
        prefetch_chunk(bt + w * N + j + kExpandAhead * kChunk);
        if (w + 1 < Wp) prefetch_chunk(bt + (w + 1) * N + j + kExpandAhead * kChunk);
      }
      const __m512i b0 = _mm512_loadu_si512(bt + w * N + j);
      const __m512i b1 = w + 1 < Wp ? _mm512_loadu_si512(bt + (w + 1) * N + j) : _mm512_setzero_si512();
      // Per 32-bit lane i: row w's and row w + 1's column 2i (even), and their column 2i + 1 (odd).
      const __m512bh be = (__m512bh)_mm512_or_si512(_mm512_and_si512(b0, low), _mm512_slli_epi32(b1, 16));
      const __m512bh bo = (__m512bh)_mm512_or_si512(_mm512_srli_epi32(b0, 16), _mm512_and_si512(b1, high));
#pragma GCC unroll 8
      for (int r = 0; r < n; ++r) {
        const __m512bh hv = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(hp[r][q]));
        even[r] = _mm512_dpbf16_ps(even[r], be, hv);
        odd[r] = _mm512_dpbf16_ps(odd[r], bo, hv);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < n; ++r) store_chunk_cvt(out + rows[r] * N + j, Vec(even[r]), Vec(odd[r]));
  }
  for (int r = 0; r < n; ++r) {
    for (int64_t j = n_main; j < cols; ++j) {
      float sum = static_cast<float>(out[rows[r] * N + j]);
      for (int64_t w = 0; w < Wp; ++w) sum += hr[r][w] * static_cast<float>(bt[w * N + j]);
      out[rows[r] * N + j] = static_cast<c10::BFloat16>(sum);
    }
  }
}
#endif

// A projection's parts (one for a plain projection; q, k, v or gate, up for a fused one): part p owns rows
// [p * W / count, (p + 1) * W / count) of A and Bt and the output columns [cols[p], cols[p + 1]); Bt's entries
// outside its parts' blocks are not read.
struct Parts {
  const int64_t* cols;  // count + 1 column offsets, from 0 to N
  int64_t count;
};

// One tile: tokens rows[0:n] (all of slot s). h[r][w] = A[s][w] . x[rows[r]]; then, part by part,
// out[rows[r]][part's columns] += sum_{w of the part} h[r][w] * Bt[s][w][part's columns].
// n is a template argument so that the accumulators stay in registers. xf: room for n rows of K floats. dp: the
// shrink with vdpbf16ps (bf16 only).
template <typename T, typename TW, int n>
void tile(const T* x, const TW* a, const TW* bt, T* out, const int64_t* rows, int64_t K, int64_t W,
          int64_t N, Parts parts, float* h, float* xf, bool dp, bool cvt) {
  constexpr int WB = n <= 4 ? 4 : 2;  // WB rows of A per pass: n * WB accumulators + WB A vectors + x's
  bool shrunk = false;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<TW, c10::BFloat16>) {
    if (dp) {
      int64_t w0 = 0;
      for (; w0 + WB <= W; w0 += WB) shrink_block_dp<n, WB>(x, rows, a, w0, K, W, h);
      for (; w0 < W; ++w0) shrink_block_dp<n, 1>(x, rows, a, w0, K, W, h);
      shrunk = true;
    }
  }
#endif
  if (!shrunk) shrink_widened<T, TW, n, WB>(x, a, rows, K, W, h, xf);
  const int64_t Wp = W / parts.count;
  for (int64_t p = 0; p < parts.count; ++p) {
    const int64_t c0 = parts.cols[p], cols = parts.cols[p + 1] - c0;
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<TW, c10::BFloat16>) {
      if (dp && Wp <= 2 * kMaxDpPairs) {
        expand_dp<n>(bt + p * Wp * N + c0, out + c0, rows, Wp, cols, N, W, h + p * Wp);
        continue;
      }
      if (cvt) {
        expand_cvt<n>(bt + p * Wp * N + c0, out + c0, rows, Wp, cols, N, W, h + p * Wp);
        continue;
      }
    }
#endif
    expand<T, TW, n>(bt + p * Wp * N + c0, out + c0, rows, Wp, cols, N, W, h + p * Wp);
  }
}

// a [S, W, K], bt [S, W, N] and part_cols: the parts (lora_add_'s and lora_pack_amx's checks).
Parts checked_parts(const at::Tensor& a, const at::Tensor& bt, at::IntArrayRef part_cols) {
  TORCH_CHECK_VALUE(a.dim() == 3 && bt.dim() == 3 && a.size(0) == bt.size(0) && a.size(1) == bt.size(1),
                    "lora_add: a [S, W, K] and bt [S, W, N] must share S and W, got ", a.sizes(), " ", bt.sizes());
  const int64_t W = a.size(1), N = bt.size(2), count = static_cast<int64_t>(part_cols.size()) - 1;
  TORCH_CHECK_VALUE(count >= 1 && W % count == 0 && part_cols.front() == 0 && part_cols.back() == N &&
                        std::is_sorted(part_cols.begin(), part_cols.end()),
                    "lora_add: part_cols must rise from 0 to N = ", N, " in parts that split W = ", W,
                    " evenly, got ", part_cols);
  return Parts{part_cols.data(), count};
}

// Runs of at least kAmxRun consecutive tokens of one slot (a prefill chunk's) take AMX tiles where the bf16 packed
// linears do (amx_tile(K)) and the slots are packed for them (lora_pack_amx, at slot load): the shrink and the
// expand become two small GEMMs on packed_linear_amx.cpp's tiles, h = bf16(x A[s]^T) (as the dp expand rounds it),
// then out += h Bt[s], out's own values joining the fp32 sums before the one rounding. A slot's panels: A as the
// shrink's weight [Wpad, K] (W rows padded with zeros to a whole tile of k for the expand, Wpad a multiple of 32),
// then Bt as one block-diagonal weight [N, Wpad] (a part's columns take its ranks only; the zeros cost the tiles
// little). A 374-token chunk's delta on an AMX Xeon: 0.47 of the packed base linears' time on the vector tiles,
// 0.22 on these (bench/results/lora.md run 17); packing per call instead of per load cost as much as the GEMMs.
constexpr int64_t kAmxRun = 16;

inline int64_t amx_width(int64_t W) { return (W + 31) / 32 * 32; }

// Elements of one slot's panels: A's Wpad x K, then Bt's N (whole panels) x Wpad.
inline int64_t amx_slot_size(int64_t W, int64_t K, int64_t N) {
  using hpi_packed::kNr;
  return amx_width(W) * K + (N + kNr - 1) / kNr * kNr * amx_width(W);
}

// One slot's panels into dst (amx_slot_size elements), every element written (the padding's zeros too).
void pack_amx_slot(const c10::BFloat16* a, const c10::BFloat16* bt, int64_t W, int64_t K, int64_t N, Parts parts,
                   c10::BFloat16* dst) {
  using hpi_packed::kNr;
  const int64_t Wpad = amx_width(W), Wp = W / parts.count, a_pairs = K / 2, b_pairs = Wpad / 2;
  std::fill_n(dst, amx_slot_size(W, K, N), c10::BFloat16(0.f));
  // A: row w is column w of the shrink's weight, its pair (k, k + 1) one 32-bit word in either layout.
  auto* a_words = reinterpret_cast<uint32_t*>(dst);
  const auto* a_src = reinterpret_cast<const uint32_t*>(a);
  for (int64_t w = 0; w < W; ++w) {
    uint32_t* column = a_words + w / kNr * a_pairs * kNr + w % kNr;
    for (int64_t q = 0; q < a_pairs; ++q) column[q * kNr] = a_src[w * a_pairs + q];
  }
  // B: element (n, w) is Bt[w][n] where rank w is of column n's part; the rest stays zero.
  c10::BFloat16* b_dst = dst + Wpad * K;
  for (int64_t p = 0; p < parts.count; ++p) {
    const int64_t c0 = parts.cols[p], c1 = parts.cols[p + 1];
    for (int64_t w = p * Wp; w < (p + 1) * Wp; ++w) {
      for (int64_t n0 = c0; n0 < c1;) {  // the part's columns panel by panel: a panel's row of pairs is contiguous
        const int64_t n1 = std::min(c1, (n0 / kNr + 1) * kNr);
        c10::BFloat16* pairs = b_dst + ((n0 / kNr * b_pairs + w / 2) * kNr) * 2 + w % 2;
        const c10::BFloat16* row = bt + w * N;
        for (int64_t n = n0; n < n1; ++n) pairs[(n % kNr) * 2] = row[n];
        n0 = n1;
      }
    }
  }
}

// Pieces of the runs, each up to kAmxPiece tokens of one slot: out[t0:t0 + m] += bf16(x A^T) Bt for each, the
// threads taking pieces (the shrink's weight is one or two panels wide, which the GEMM's own split by panels would
// leave to one thread; one parallel region for every run of the call).
constexpr int64_t kAmxPiece = 32;

struct AmxPiece {
  const c10::BFloat16* panels;  // the slot's
  int64_t t0, m;
};

void amx_pieces(const std::vector<AmxPiece>& pieces, const c10::BFloat16* x, c10::BFloat16* out, int64_t K,
                int64_t W, int64_t N) {
  const int64_t Wpad = amx_width(W);
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t i0, int64_t i1) {
    static thread_local std::vector<c10::BFloat16> h;  // a piece's shrunk tokens, [m, Wpad]
    if (h.size() < static_cast<size_t>(kAmxPiece * Wpad)) h.resize(static_cast<size_t>(kAmxPiece * Wpad));
    for (int64_t i = i0; i < i1; ++i) {
      const AmxPiece& piece = pieces[i];
      hpi_packed::gemm_bf16_amx(x + piece.t0 * K, K, piece.panels, nullptr, piece.m, K, Wpad, h.data());
      hpi_packed::gemm_bf16_amx_add(h.data(), Wpad, piece.panels + Wpad * K, piece.m, Wpad, N, out + piece.t0 * N);
    }
  });
}

// Below this many multiply-adds per thread (~15 us) tiles run on the calling thread: an OpenMP region costs
// microseconds on idle cores and milliseconds when other processes hold them (bench/results/lora.md). A decode
// step's larger projections still split their tiles over the threads (1.5x faster on 2 idle cores).
constexpr int64_t kMinWorkPerThread = int64_t{1} << 19;

// out[t] += B[s] (A[s] x[t]) in place: out is the projection's output, which nothing else holds yet, so the
// compiled step (Inductor reinplaces the functionalized call) and eager runs alike write it without a copy.
void lora_add_(const at::Tensor& out, const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt,
               const at::Tensor& slots, at::IntArrayRef part_cols, const std::optional<at::Tensor>& amx) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK_VALUE((dtype == at::kFloat || dtype == at::kBFloat16) && x.dim() == 2 && x.device().is_cpu(),
                    "lora_add takes float32 or bfloat16 CPU x [T, K], got ", dtype, " ", x.sizes());
  const Parts parts = checked_parts(a, bt, part_cols);
  TORCH_CHECK_VALUE(a.size(2) == x.size(1), "lora_add: a [S, W, K] must match x [T, K], got ", a.sizes(), " ",
                    x.sizes());
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == bt.size(2),
                    "lora_add: out must be [T, N] = [", x.size(0), ", ", bt.size(2), "], got ", out.sizes());
  TORCH_CHECK_VALUE(out.is_contiguous(), "lora_add: out must be contiguous (it is written in place)");
  TORCH_CHECK_VALUE(slots.dim() == 1 && slots.size(0) == x.size(0) && slots.scalar_type() == at::kLong,
                    "lora_add: slots must be int64 [T], got ", slots.scalar_type(), " ", slots.sizes());
  const auto slot_dtype = a.scalar_type();
  TORCH_CHECK_VALUE(out.scalar_type() == dtype && bt.scalar_type() == slot_dtype &&
                        (slot_dtype == dtype || (dtype == at::kFloat && slot_dtype == at::kBFloat16)),
                    "lora_add: x and out must share one dtype, and a and bt x's or, under float32 x, bfloat16; got x ",
                    dtype, ", out ", out.scalar_type(), ", a ", slot_dtype, ", bt ", bt.scalar_type());
  const int64_t T = x.size(0), S = a.size(0), W = a.size(1), K = a.size(2), N = out.size(1), count = parts.count;
  const at::Tensor sc = slots.contiguous();
  const int64_t* slot_of = sc.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK_VALUE(slot_of[t] >= -1 && slot_of[t] < S, "lora_add: slot ", slot_of[t], " of token ", t,
                      " is not in [-1, ", S, ")");
  }
  const at::Tensor xc = x.contiguous(), ac = a.contiguous(), bc = bt.contiguous();
  // Runs of one slot long enough for the AMX tiles take them where the slots are packed for them; the rest below.
  std::vector<bool> on_amx(static_cast<size_t>(T), false);
  if (amx.has_value() && amx->size(1) > 0 && dtype == at::kBFloat16 && T >= kAmxRun && hpi_packed::amx_tile(K)) {
    TORCH_CHECK_VALUE(amx->dim() == 2 && amx->size(0) == S && amx->size(1) == amx_slot_size(W, K, N) &&
                          amx->scalar_type() == at::kBFloat16 && amx->is_contiguous(),
                      "lora_add: amx must be lora_pack_amx's panels of these slots, [", S, ", ",
                      amx_slot_size(W, K, N), "] bfloat16, got ", amx->scalar_type(), " ", amx->sizes());
    std::vector<AmxPiece> pieces;
    for (int64_t t0 = 0, t1 = 0; t0 < T; t0 = t1) {
      for (t1 = t0 + 1; t1 < T && slot_of[t1] == slot_of[t0];) ++t1;
      const int64_t s = slot_of[t0];
      if (s < 0 || t1 - t0 < kAmxRun) continue;
      for (int64_t p = t0; p < t1; p += kAmxPiece) {
        pieces.push_back({amx->const_data_ptr<c10::BFloat16>() + s * amx->size(1), p, std::min(kAmxPiece, t1 - p)});
      }
      std::fill(on_amx.begin() + t0, on_amx.begin() + t1, true);
    }
    amx_pieces(pieces, xc.const_data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), K, W, N);
  }
  // The other tokens by slot, then tiles of up to kTile tokens of one slot; none left: nothing to do.
  std::vector<std::vector<int64_t>> by_slot(static_cast<size_t>(S));
  for (int64_t t = 0; t < T; ++t) {
    if (slot_of[t] >= 0 && !on_amx[t]) by_slot[slot_of[t]].push_back(t);
  }
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (slot, first index into by_slot[slot])
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t i = 0; i < static_cast<int64_t>(by_slot[s].size()); i += kTile) tiles.emplace_back(s, i);
  }
  if (tiles.empty()) return;
  int64_t adapted = 0;
  for (const auto& rows : by_slot) adapted += static_cast<int64_t>(rows.size());
  const int64_t tile_work = adapted / static_cast<int64_t>(tiles.size()) * (W * K + W / count * N);  // mean tile
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(1, tile_work));
  // bf16: the shrink takes the bf16 tile the packed linears measured at start (hpi_packed::dp_tile), settled here,
  // outside the parallel region.
  const bool dp = dtype == at::kBFloat16 && hpi_packed::dp_tile();
  const bool cvt = dtype == at::kBFloat16 && hpi_packed::avx512_bf16();  // the bf16 stores by vcvtne2ps2bf16
  const auto run = [&](auto* type_tag, auto* slot_type_tag) {
    using scalar_t = std::remove_pointer_t<decltype(type_tag)>;
    using slot_t = std::remove_pointer_t<decltype(slot_type_tag)>;
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    const slot_t* ap = ac.const_data_ptr<slot_t>();
    const slot_t* bp = bc.const_data_ptr<slot_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(tiles.size()), grain, [&](int64_t i0, int64_t i1) {
      std::vector<float> h(static_cast<size_t>(kTile * W));   // the tile's shrunk tokens, [n, W]
      std::vector<float> xf(static_cast<size_t>(kTile * K));  // the tile's x rows in fp32, [n, K]
      for (int64_t i = i0; i < i1; ++i) {
        const auto [s, first] = tiles[i];
        const auto& rows = by_slot[s];
        const int64_t n = std::min<int64_t>(kTile, static_cast<int64_t>(rows.size()) - first);
        const slot_t *as = ap + s * W * K, *bs = bp + s * W * N;
        const int64_t* r = rows.data() + first;
        static_assert(kTile == 8, "one case per tile size");
        switch (n) {
          case 8: tile<scalar_t, slot_t, 8>(xp, as, bs, op, r, K, W, N, parts, h.data(), xf.data(), dp, cvt); break;
          case 7: tile<scalar_t, slot_t, 7>(xp, as, bs, op, r, K, W, N, parts, h.data(), xf.data(), dp, cvt); break;
          case 6: tile<scalar_t, slot_t, 6>(xp, as, bs, op, r, K, W, N, parts, h.data(), xf.data(), dp, cvt); break;
          case 5: tile<scalar_t, slot_t, 5>(xp, as, bs, op, r, K, W, N, parts, h.data(), xf.data(), dp, cvt); break;
          case 4: tile<scalar_t, slot_t, 4>(xp, as, bs, op, r, K, W, N, parts, h.data(), xf.data(), dp, cvt); break;
          case 3: tile<scalar_t, slot_t, 3>(xp, as, bs, op, r, K, W, N, parts, h.data(), xf.data(), dp, cvt); break;
          case 2: tile<scalar_t, slot_t, 2>(xp, as, bs, op, r, K, W, N, parts, h.data(), xf.data(), dp, cvt); break;
          default: tile<scalar_t, slot_t, 1>(xp, as, bs, op, r, K, W, N, parts, h.data(), xf.data(), dp, cvt);
        }
      }
    });
  };
  if (dtype == at::kBFloat16) {
    run(static_cast<c10::BFloat16*>(nullptr), static_cast<c10::BFloat16*>(nullptr));
  } else if (slot_dtype == at::kBFloat16) {  // bf16 slots under an fp32 model (--lora-dtype bfloat16)
    run(static_cast<float*>(nullptr), static_cast<c10::BFloat16*>(nullptr));
  } else {
    run(static_cast<float*>(nullptr), static_cast<float*>(nullptr));
  }
}

// Every slot's AMX panels, lora_add_'s `amx`: [S, amx_slot_size] bfloat16 where runs of one slot take AMX tiles here
// (bf16 slots, amx_tile(K)), else [S, 0].
at::Tensor lora_pack_amx(const at::Tensor& a, const at::Tensor& bt, at::IntArrayRef part_cols) {
  const Parts parts = checked_parts(a, bt, part_cols);
  TORCH_CHECK_VALUE(a.scalar_type() == bt.scalar_type(), "lora_pack_amx: a and bt must share one dtype");
  const int64_t S = a.size(0), W = a.size(1), K = a.size(2), N = bt.size(2);
  if (a.scalar_type() != at::kBFloat16 || !a.device().is_cpu() || !hpi_packed::amx_tile(K)) {
    return at::empty({S, 0}, a.options());
  }
  const int64_t size = amx_slot_size(W, K, N);
  at::Tensor packed = at::empty({S, size}, a.options());
  const at::Tensor ac = a.contiguous(), bc = bt.contiguous();
  for (int64_t s = 0; s < S; ++s) {
    pack_amx_slot(ac.const_data_ptr<c10::BFloat16>() + s * W * K, bc.const_data_ptr<c10::BFloat16>() + s * W * N, W,
                  K, N, parts, packed.data_ptr<c10::BFloat16>() + s * size);
  }
  return packed;
}

// Slot s of lora_pack_amx's panels packed again from a[s] and bt[s], in place (the runtime's slot load, after it
// writes the slot's A and Bt); nothing to do where the panels are [S, 0].
void lora_pack_amx_slot_(const at::Tensor& panels, const at::Tensor& a, const at::Tensor& bt, int64_t slot,
                         at::IntArrayRef part_cols) {
  const Parts parts = checked_parts(a, bt, part_cols);
  const int64_t S = a.size(0), W = a.size(1), K = a.size(2), N = bt.size(2);
  TORCH_CHECK_VALUE(slot >= 0 && slot < S, "lora_pack_amx_slot_: slot ", slot, " is not in [0, ", S, ")");
  TORCH_CHECK_VALUE(panels.dim() == 2 && panels.size(0) == S && panels.is_contiguous(),
                    "lora_pack_amx_slot_: panels must be lora_pack_amx's [", S, ", size], got ", panels.sizes());
  if (panels.size(1) == 0) return;
  TORCH_CHECK_VALUE(panels.size(1) == amx_slot_size(W, K, N) && panels.scalar_type() == at::kBFloat16 &&
                        a.scalar_type() == at::kBFloat16 && bt.scalar_type() == at::kBFloat16,
                    "lora_pack_amx_slot_: panels must be lora_pack_amx's [", S, ", ", amx_slot_size(W, K, N),
                    "] bfloat16 of bfloat16 slots, got ", panels.scalar_type(), " ", panels.sizes());
  const at::Tensor as = a.select(0, slot).contiguous(), bs = bt.select(0, slot).contiguous();
  pack_amx_slot(as.const_data_ptr<c10::BFloat16>(), bs.const_data_ptr<c10::BFloat16>(), W, K, N, parts,
                panels.data_ptr<c10::BFloat16>() + slot * panels.size(1));
}

void lora_add_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                   at::IntArrayRef, const std::optional<at::Tensor>&) {}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hpi_kernels, m) {
  m.def(
      "lora_add_(Tensor(a!) out, Tensor x, Tensor a, Tensor bt, Tensor slots, int[] part_cols, Tensor? amx=None) -> "
      "()");
  m.def("lora_pack_amx(Tensor a, Tensor bt, int[] part_cols) -> Tensor");
  m.def("lora_pack_amx_slot_(Tensor(a!) panels, Tensor a, Tensor bt, int slot, int[] part_cols) -> ()");
}

TORCH_LIBRARY_IMPL(hpi_kernels, CPU, m) {
  m.impl("lora_add_", &lora_add_);
  m.impl("lora_pack_amx", &lora_pack_amx);
  m.impl("lora_pack_amx_slot_", &lora_pack_amx_slot_);
}

TORCH_LIBRARY_IMPL(hpi_kernels, Meta, m) {
  m.impl("lora_add_", &lora_add_meta);
}
