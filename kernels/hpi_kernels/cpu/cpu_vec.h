// Small at::vec helpers the CPU kernels share.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <type_traits>

namespace hpi_vec {

using Vec = at::vec::Vectorized<float>;

template <typename T>
inline Vec load_float(const T* src) {  // Vec::size() elements of src, widened to fp32
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(src);
  } else {
    Vec out;
    at::vec::load_to_float<T>(src, out);
    return out;
  }
}

}  // namespace hpi_vec
