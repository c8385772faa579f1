// Small at::vec helpers the CPU kernels share.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <cstdint>
#include <type_traits>

namespace hpi_vec {

using Vec = at::vec::Vectorized<float>;

template <typename T>
constexpr bool is_fp8 = std::is_same_v<T, c10::Float8_e4m3fn> || std::is_same_v<T, c10::Float8_e5m2>;

// Vec::size() fp8 values widened to fp32, exactly, with no subnormal float anywhere: a normal's exponent and mantissa
// are moved to the top of a float's and its exponent rebiased by an integer add; a subnormal (exponent 0) is its
// mantissa converted to float times 2^(1 - bias - mantissa bits); then the sign is put back. (Scaling the moved bits
// by 2^(127 - bias) in one multiply, as before, fed the multiply a subnormal float for every fp8 subnormal,
// and Intel CPUs take a microcode assist on each: attention over an fp8 cache ran 2.4-3.2x its time over a bf16 one,
// bench/results/kv_cache_dtype.md.) fp8's NaN/inf codes are never stored (writes saturate).
template <typename T>
inline Vec widen_fp8(const T* src) {
  constexpr int kMantissa = std::is_same_v<T, c10::Float8_e4m3fn> ? 3 : 2;
  constexpr int kBias = std::is_same_v<T, c10::Float8_e4m3fn> ? 7 : 15;
  constexpr int32_t kRebias = (127 - kBias) << 23;
  constexpr float kSubnormal = std::is_same_v<T, c10::Float8_e4m3fn> ? 0x1p-9f : 0x1p-16f;  // 2^(1 - bias - mantissa)
  const auto* bytes = reinterpret_cast<const uint8_t*>(src);
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m512i magnitude = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(magnitude, 23 - kMantissa), _mm512_set1_epi32(kRebias));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(magnitude), _mm512_set1_ps(kSubnormal));
  const __mmask16 is_normal = _mm512_cmpge_epi32_mask(magnitude, _mm512_set1_epi32(1 << kMantissa));
  const __m512i value = _mm512_mask_blend_epi32(is_normal, _mm512_castps_si512(subnormal), normal);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(value, sign));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  const __m256i magnitude = _mm256_and_si256(x, _mm256_set1_epi32(0x7f));
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(magnitude, 23 - kMantissa), _mm256_set1_epi32(kRebias));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(magnitude), _mm256_set1_ps(kSubnormal));
  const __m256i is_normal = _mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32((1 << kMantissa) - 1));
  const __m256i value = _mm256_blendv_epi8(_mm256_castps_si256(subnormal), normal, is_normal);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(value, sign));
#else
  float out[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) out[i] = static_cast<float>(src[i]);
  return Vec::loadu(out);
#endif
}

template <typename T>
inline Vec load_float(const T* src) {  // Vec::size() elements of src, widened to fp32
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(src);
  } else if constexpr (is_fp8<T>) {
    return widen_fp8(src);
  } else {
    Vec out;
    at::vec::load_to_float<T>(src, out);
    return out;
  }
}

}  // namespace hpi_vec
