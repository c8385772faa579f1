// Batched LoRA on CPU: out[t] + B[s] (A[s] x[t]) for each token t of slot s = slots[t] (-1: no adapter), the
// punica / S-LoRA delta in one call per projection (runtime/hpi_runtime/lora/layers.py calls it from the
// compiled model step and eagerly alike). The step's tokens are grouped by slot here, then split into tiles of
// up to kTile tokens of one slot: a tile reads each row of A[s] and of B[s] once for all of its tokens, so a
// slot's matrices stream from cache once per kTile tokens instead of once per token (the gathered `bmm` form
// reads them per token and was 15-40x slower, docs/lora.md).
//
// Shapes: x [T, K]; a [S, W, K] (slot s's A, W = parts x max_rank, zero-padded); bt [S, W, N] (slot s's B
// transposed: W rows of N outputs, so the expand is W AXPYs over contiguous outputs, no horizontal sums);
// slots [T] int64; out [T, N]. float32 or bfloat16 (x, a, bt and out alike): bf16 is widened in registers,
// the sums (out[t] + the delta) are fp32, rounded once.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
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

inline void load_chunk(const c10::BFloat16* p, Vec& lo, Vec& hi) {
  std::tie(lo, hi) = at::vec::convert_bfloat16_float(at::vec::Vectorized<c10::BFloat16>::loadu(p));
}

inline void store_chunk(float* p, const Vec& lo, const Vec& hi) {
  lo.store(p);
  hi.store(p + kV);
}

inline void store_chunk(c10::BFloat16* p, const Vec& lo, const Vec& hi) {
  at::vec::convert_float_bfloat16(lo, hi).store(p);
}

// One tile: tokens rows[0:n] (all of slot s). h[r][w] = A[s][w] . x[rows[r]]; then
// result[rows[r]] = out[rows[r]] + sum_w h[r][w] * Bt[s][w].
// n is a template argument so that the accumulators stay in registers.
template <typename T, int n>
void tile(const T* x, const T* a, const T* bt, const T* out, T* result, const int64_t* rows, int64_t K, int64_t W,
          int64_t N, float* h) {
  const int64_t k_main = K / kChunk * kChunk;
  for (int64_t w = 0; w < W; ++w) {
    const T* arow = a + w * K;
    Vec acc[n];
#pragma GCC unroll 8
    for (int r = 0; r < n; ++r) acc[r] = Vec(0.f);
    for (int64_t k = 0; k < k_main; k += kChunk) {
      Vec alo, ahi;
      load_chunk(arow + k, alo, ahi);
#pragma GCC unroll 8
      for (int r = 0; r < n; ++r) {
        Vec xlo, xhi;
        load_chunk(x + rows[r] * K + k, xlo, xhi);
        acc[r] = at::vec::fmadd(alo, xlo, acc[r]);
        acc[r] = at::vec::fmadd(ahi, xhi, acc[r]);
      }
    }
    for (int r = 0; r < n; ++r) {
      float sum = at::vec::vec_reduce_all<float>([](const Vec& p, const Vec& q) { return p + q; }, acc[r]);
      for (int64_t k = k_main; k < K; ++k) sum += static_cast<float>(arow[k]) * static_cast<float>(x[rows[r] * K + k]);
      h[r * W + w] = sum;
    }
  }
  const int64_t n_main = N / kChunk * kChunk;
  for (int64_t j = 0; j < n_main; j += kChunk) {
    Vec lo[n], hi[n];
#pragma GCC unroll 8
    for (int r = 0; r < n; ++r) load_chunk(out + rows[r] * N + j, lo[r], hi[r]);
    for (int64_t w = 0; w < W; ++w) {
      Vec blo, bhi;
      load_chunk(bt + w * N + j, blo, bhi);
#pragma GCC unroll 8
      for (int r = 0; r < n; ++r) {
        const Vec hw(h[r * W + w]);
        lo[r] = at::vec::fmadd(hw, blo, lo[r]);
        hi[r] = at::vec::fmadd(hw, bhi, hi[r]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < n; ++r) store_chunk(result + rows[r] * N + j, lo[r], hi[r]);
  }
  for (int r = 0; r < n; ++r) {
    for (int64_t j = n_main; j < N; ++j) {
      float sum = static_cast<float>(out[rows[r] * N + j]);
      for (int64_t w = 0; w < W; ++w) sum += h[r * W + w] * static_cast<float>(bt[w * N + j]);
      result[rows[r] * N + j] = static_cast<T>(sum);
    }
  }
}

at::Tensor lora_add(const at::Tensor& x, const at::Tensor& a, const at::Tensor& bt, const at::Tensor& slots,
                    const at::Tensor& out) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK_VALUE((dtype == at::kFloat || dtype == at::kBFloat16) && x.dim() == 2 && x.device().is_cpu(),
                    "lora_add takes float32 or bfloat16 CPU x [T, K], got ", dtype, " ", x.sizes());
  TORCH_CHECK_VALUE(a.dim() == 3 && bt.dim() == 3 && a.size(0) == bt.size(0) && a.size(1) == bt.size(1) &&
                        a.size(2) == x.size(1),
                    "lora_add: a [S, W, K] and bt [S, W, N] must match x [T, K], got ", a.sizes(), " ", bt.sizes(),
                    " ", x.sizes());
  TORCH_CHECK_VALUE(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == bt.size(2),
                    "lora_add: out must be [T, N] = [", x.size(0), ", ", bt.size(2), "], got ", out.sizes());
  TORCH_CHECK_VALUE(slots.dim() == 1 && slots.size(0) == x.size(0) && slots.scalar_type() == at::kLong,
                    "lora_add: slots must be int64 [T], got ", slots.scalar_type(), " ", slots.sizes());
  TORCH_CHECK_VALUE(a.scalar_type() == dtype && bt.scalar_type() == dtype && out.scalar_type() == dtype,
                    "lora_add: x, a, bt and out must share one dtype");
  const int64_t T = x.size(0), S = a.size(0), W = a.size(1), K = a.size(2), N = bt.size(2);
  const at::Tensor xc = x.contiguous(), ac = a.contiguous(), bc = bt.contiguous(), oc = out.contiguous();
  const at::Tensor sc = slots.contiguous();
  at::Tensor result = oc.clone();
  // Tokens by slot, then tiles of up to kTile tokens of one slot.
  std::vector<std::vector<int64_t>> by_slot(static_cast<size_t>(S));
  const int64_t* slot_of = sc.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t s = slot_of[t];
    TORCH_CHECK_VALUE(s >= -1 && s < S, "lora_add: slot ", s, " of token ", t, " is not in [-1, ", S, ")");
    if (s >= 0) by_slot[s].push_back(t);
  }
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (slot, first index into by_slot[slot])
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t i = 0; i < static_cast<int64_t>(by_slot[s].size()); i += kTile) tiles.emplace_back(s, i);
  }
  const auto run = [&](auto* type_tag) {
    using scalar_t = std::remove_pointer_t<decltype(type_tag)>;
    const scalar_t* xp = xc.const_data_ptr<scalar_t>();
    const scalar_t* ap = ac.const_data_ptr<scalar_t>();
    const scalar_t* bp = bc.const_data_ptr<scalar_t>();
    const scalar_t* op = oc.const_data_ptr<scalar_t>();
    scalar_t* rp = result.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> h(static_cast<size_t>(kTile * W));  // the tile's shrunk tokens, [n, W]
      for (int64_t i = i0; i < i1; ++i) {
        const auto [s, first] = tiles[i];
        const auto& rows = by_slot[s];
        const int64_t n = std::min<int64_t>(kTile, static_cast<int64_t>(rows.size()) - first);
        const scalar_t *as = ap + s * W * K, *bs = bp + s * W * N;
        const int64_t* r = rows.data() + first;
        static_assert(kTile == 8, "one case per tile size");
        switch (n) {
          case 8: tile<scalar_t, 8>(xp, as, bs, op, rp, r, K, W, N, h.data()); break;
          case 7: tile<scalar_t, 7>(xp, as, bs, op, rp, r, K, W, N, h.data()); break;
          case 6: tile<scalar_t, 6>(xp, as, bs, op, rp, r, K, W, N, h.data()); break;
          case 5: tile<scalar_t, 5>(xp, as, bs, op, rp, r, K, W, N, h.data()); break;
          case 4: tile<scalar_t, 4>(xp, as, bs, op, rp, r, K, W, N, h.data()); break;
          case 3: tile<scalar_t, 3>(xp, as, bs, op, rp, r, K, W, N, h.data()); break;
          case 2: tile<scalar_t, 2>(xp, as, bs, op, rp, r, K, W, N, h.data()); break;
          default: tile<scalar_t, 1>(xp, as, bs, op, rp, r, K, W, N, h.data());
        }
      }
    });
  };
  if (dtype == at::kBFloat16) {
    run(static_cast<c10::BFloat16*>(nullptr));
  } else {
    run(static_cast<float*>(nullptr));
  }
  return result;
}

at::Tensor lora_add_meta(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor& out) {
  return at::empty_like(out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hpi_kernels, m) {
  m.def("lora_add(Tensor x, Tensor a, Tensor bt, Tensor slots, Tensor out) -> Tensor");
}

TORCH_LIBRARY_IMPL(hpi_kernels, CPU, m) {
  m.impl("lora_add", &lora_add);
}

TORCH_LIBRARY_IMPL(hpi_kernels, Meta, m) {
  m.impl("lora_add", &lora_add_meta);
}
