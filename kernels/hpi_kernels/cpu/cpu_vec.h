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

// Vec::size() fp8 values widened to fp32: each byte's exponent and mantissa moved to the top of a float's
// (shifted left by 23 - mantissa bits) and scaled by 2^(127 - bias), which is exact for normals and
// subnormals alike, then the sign put back. fp8's NaN/inf codes are never stored (writes saturate).
template <typename T>
inline Vec widen_fp8(const T* src) {
  constexpr int kMantissa = std::is_same_v<T, c10::Float8_e4m3fn> ? 3 : 2;
  constexpr float kScale = std::is_same_v<T, c10::Float8_e4m3fn> ? 0x1p120f : 0x1p112f;  // 2^(127 - bias)
  const auto* bytes = reinterpret_cast<const uint8_t*>(src);
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  const __m512i bits = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x7f)), 23 - kMantissa);
  const __m512 magnitude = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(kScale));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude), sign));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  const __m256i bits = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7f)), 23 - kMantissa);
  const __m256 magnitude = _mm256_mul_ps(_mm256_castsi256_ps(bits), _mm256_set1_ps(kScale));
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(magnitude), sign));
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
