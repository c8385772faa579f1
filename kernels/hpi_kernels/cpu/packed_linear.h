// What packed_linear.cpp (fp32, and the ops) and packed_linear_bf16.cpp (bf16) share: the panel geometry, which
// follows the width of ATen's Vectorized<float> in this build.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace hpi_packed {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVecSize = Vec::size();
constexpr int kNrVecs = 2;                    // vectors per panel row
constexpr int64_t kNr = kNrVecs * kVecSize;   // panel width: 32 columns with AVX512, 16 with AVX2
constexpr int kMr = kVecSize >= 16 ? 12 : 6;  // rows per register tile: 24 (of 32) or 12 (of 16) accumulators
constexpr int64_t kMc = 256;                  // rows per chunk of x kept in L2
constexpr int64_t kPrefetch = 8;              // panel rows ahead, within the current panel

// f(std::integral_constant<int, rows>{}) for a runtime rows in 1..R: the register tile of exactly that height.
template <int R, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (R == 1) {
    f(std::integral_constant<int, 1>{});
  } else if (rows == R) {
    f(std::integral_constant<int, R>{});
  } else {
    with_rows<R - 1>(rows, f);
  }
}

// A tile's prefetches at panel row k (a panel row is kNr 32-bit lanes in either dtype): row k + kPrefetch of
// its own panel into L1, and every `step`-th row (counting down from the tile's phase) row k of the thread's
// next panel (`next`, nullptr for none) into L2, so that the panel's tiles share the next one's stream.
template <typename T>
__attribute__((always_inline)) inline void prefetch_rows(const T* panel, const T* next, int64_t k, int64_t& countdown,
                                                        int64_t step) {
  static_assert(sizeof(T) == 4, "panel rows of 32-bit lanes");
  __builtin_prefetch(panel + (k + kPrefetch) * kNr, 0, 3);
  __builtin_prefetch(panel + (k + kPrefetch) * kNr + kNr / 2, 0, 3);
  if (next != nullptr && --countdown < 0) {
    countdown = step - 1;
    __builtin_prefetch(next + k * kNr, 0, 2);
    __builtin_prefetch(next + k * kNr + kNr / 2, 0, 2);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// What the int8/int4 vdpbf16ps tiles (packed_linear_quant.cpp) and the AMX tiles' dequantization
// (packed_linear_amx.cpp) share. 16 columns' int8 codes at k (`even`) and k + 1 (`odd`) as bf16 pairs, one 32-bit
// lane per column: widened to fp32 (exact), the fp32's high halves (their bf16, exact for integers of 8 bits)
// interleaved by a shift and a 16-bit blend.
inline __m512i int8_bf16_pairs(const int8_t* even, const int8_t* odd) {
  const __m512i w_even = _mm512_castps_si512(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(even)))));
  const __m512i w_odd = _mm512_castps_si512(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(odd)))));
  return _mm512_mask_blend_epi16(0xaaaaaaaau, _mm512_srli_epi32(w_even, 16), w_odd);
}

// bf16 of int4's q - 8, for vpermw, which reads the low 5 bits of each 16-bit lane: the nibble, and one bit of the
// next (the table repeats).
alignas(64) inline constexpr uint16_t kInt4Bf16Codes[32] = {
    0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80,  // -8 .. -1
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,  // 0 .. 7
    0xc100, 0xc0e0, 0xc0c0, 0xc0a0, 0xc080, 0xc040, 0xc000, 0xbf80,
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0};

// vpermw's indices from vcvtne2ps2bf16's [16 a | 16 b] order to 16 (a[i], b[i]) bf16 pairs.
alignas(64) inline constexpr uint16_t kBf16PairInterleave[32] = {
    0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
#endif

// bf16 panels: [panels, ceil(K / 2), kNr, 2], the pair (k, k + 1) of each column adjacent: one int32 lane
// per column, widened to two fp32 lanes by a shift and a mask (packed_linear_bf16.cpp).
at::Tensor pack_bf16(const at::Tensor& weight);  // [N, K] bfloat16, any strides
// The packed bf16 weight widened back to fp32 [K, N] (row-major) into dst: for MKL's sgemm on prefill-sized x.
void unpack_bf16(const c10::BFloat16* packed, int64_t K, int64_t N, float* dst);
// The same as bf16 [K, N]: for at::mm in bf16 (oneDNN) on prefill-sized x, where bf16_prefill_gemm() says so.
void unpack_bf16(const c10::BFloat16* packed, int64_t K, int64_t N, c10::BFloat16* dst);
// Prefill-sized GEMMs with bf16 x (the packed bf16 linear's, and the int8/int4 ones over their dequantized
// weight): true runs at::mm in bf16 over a bf16 copy of the weight (oneDNN: vdpbf16ps or AMX where the CPU has
// them, fp32 sums, bf16 out), false widens x and the weight to fp32 for MKL's sgemm. Chosen per machine by
// measurement at the first call (prefill_gemm_choice); HPI_CPU_PREFILL_GEMM=bf16|fp32 forces one.
bool bf16_prefill_gemm();
// Whether the CPU has AVX512-BF16 and this is the AVX512 build; HPI_CPU_AVX512_BF16=0 says no on such a CPU too, so
// that the tests run the paths of a CPU without it (Cascade Lake: the widen tiles and no AMX ones, LoRA's stores
// rounded in integers).
bool avx512_bf16();
// Whether decode-sized GEMMs with bf16 x run vdpbf16ps tiles (packed bf16, int8 and int4 alike) rather than the
// tiles that widen to fp32: measured at the first call where the CPU has AVX512-BF16 (bf16_tile op), false else.
bool dp_tile();
// Whether the packed bf16 GEMMs of a weight of in_features K run AMX tiles (packed_linear_amx.cpp), at every
// row count up to prefill size: measured at the first call where the CPU has AMX-BF16 (bf16_tile op), false else.
// The int8/int4 linears with bf16 x follow it.
bool amx_tile(int64_t K);
// out [M, N] (contiguous) = a [M, K] (row stride lda) @ the packed weight, + bias [N] (or nullptr), accumulated
// in fp32 and rounded to bf16 once.
void gemm_bf16(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* packed, const c10::BFloat16* bias,
               int64_t M, int64_t K, int64_t N, c10::BFloat16* out);
// The same, the fp32 sums stored unrounded (an LM head's logits: packed_logits).
void gemm_bf16(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* packed, const c10::BFloat16* bias,
               int64_t M, int64_t K, int64_t N, float* out);
// out [M, N] (contiguous, fp32) = fp32 a [M, K] (row stride lda) @ the packed bf16 weight, fp32 sums: an fp32
// model whose weights are bf16 values (a bf16 checkpoint) keeps them packed as bf16, half of fp32's bytes; the
// widen tile computes exactly what fp32 panels of the same values do (the same products, summed in k order).
void gemm_bf16_weight(const float* a, int64_t lda, const c10::BFloat16* packed, int64_t M, int64_t K, int64_t N,
                      float* out);
// AMX tiles over the same packed weight (packed_linear_amx.cpp): whether this CPU has AMX-BF16, the build is
// AVX512's and Linux granted the process the tile state;
bool amx_available();
// whether a weight of in_features K takes them (whole tiles of k: K a multiple of 32, and amx_available);
bool amx_fits(int64_t K);
#if defined(CPU_CAPABILITY_AVX512)
// The calling thread's tile configuration: all eight tiles 16 rows of 64 bytes (amx_available() required; release
// them with _tile_release() when done, as oneDNN on the same threads loads its own).
__attribute__((target("amx-tile"))) void load_tile_config();
#endif
// and gemm_bf16 on them, for any M (amx_fits(K) required).
void gemm_bf16_amx(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* packed, const c10::BFloat16* bias,
                   int64_t M, int64_t K, int64_t N, c10::BFloat16* out);
void gemm_bf16_amx(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* packed, const c10::BFloat16* bias,
                   int64_t M, int64_t K, int64_t N, float* out);
// out [M, N] (contiguous) += a @ the packed weight: out's own values join the fp32 sums, rounded to bf16 once (the
// LoRA delta's expand, lora_delta.cpp).
void gemm_bf16_amx_add(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* packed, int64_t M, int64_t K,
                       int64_t N, c10::BFloat16* out);
// The int8 and int4 panels of packed_linear_quant.cpp on the same tiles, each panel dequantized into bf16 pairs a
// k step ahead of them (amx_fits(K) required; bias fp32 [N] or nullptr): int8 [panels, K, kNr] codes with
// per-column scales [panels * kNr] fp32,
void gemm_int8_amx(const c10::BFloat16* a, int64_t lda, const int8_t* packed, const float* scales, const float* bias,
                   int64_t M, int64_t K, int64_t N, c10::BFloat16* out);
void gemm_int8_amx(const c10::BFloat16* a, int64_t lda, const int8_t* packed, const float* scales, const float* bias,
                   int64_t M, int64_t K, int64_t N, float* out);
// and int4 [panels, K / 8, kNr] words with [panels, K / group_size, kNr] (scale, zero) bf16 pairs.
void gemm_int4_amx(const c10::BFloat16* a, int64_t lda, const int32_t* packed, const int32_t* scales_zeros,
                   int64_t group_size, const float* bias, int64_t M, int64_t K, int64_t N, c10::BFloat16* out);

}  // namespace hpi_packed
