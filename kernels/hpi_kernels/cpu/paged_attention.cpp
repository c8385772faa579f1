// Paged attention on CPU that reads K/V in place from the paged cache (no per-layer gather).
//
// One op, hpi_kernels::paged_attention_cpu, covers a mixed batch: request r's query rows are
// query_start_loc[r]..query_start_loc[r + 1] and sit at the last positions of its context_lens[r]
// cached tokens (the new tokens' K/V are already in the cache); each query attends causally. With a
// sliding window W > 0, a query at position p attends keys p - W + 1 .. p only, and blocks wholly before
// every query's window are never read (they may be a shared placeholder); with a soft-cap C > 0, scores
// become C * tanh(score / C) before the mask and softmax (Gemma 2).
//
// Work is cut into items that share one kv head of one request, sorted longest first and claimed by
// the threads of one at::parallel_for region from an atomic counter, so a few long contexts do not
// leave the other threads idle:
//   - decode (one query token): the token's q heads of one kv head (at most kMaxDecodeHeads); per head,
//     the dot products with Vec::size() keys at a time, reduced in one shuffle tree; P @ V for all the heads
//     in groups of head-dim vectors, one FMA chain per head and vector (decode_item, add_values);
//   - prefill/extend chunks: a tile of up to kMaxTileVecs * Vec::size() (token, q head) rows, stored
//     transposed so that the rows sit in vector lanes: scores, the online softmax and the P @ V update
//     all run across rows without horizontal reductions (tile_item).
// Math is fp32 (bf16/fp16 inputs are widened on load), the softmax is the streaming (online) one. The cache
// holds q's dtype, bf16 (`--kv-cache-dtype bfloat16`: half an fp32 model's bytes), or fp8 (e4m3fn or e5m2,
// `--kv-cache-dtype fp8*`: half the bytes of a bf16 cache to read per step and to keep), written saturated and
// unscaled; either is widened to fp32 as it is read (cpu_vec.h).
//
// Built by hpi_kernels/cpu/_extension.py with the flags of torch's own CPU capability (AVX512, AVX2 or
// none), so at::vec::Vectorized<float> is 16, 8 (or 4 on aarch64) lanes wide.

#include "cpu_vec.h"
#include "paged_attention.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using hpi_attention::Problem;
using hpi_attention::WorkItem;

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVecSize = Vec::size();
constexpr int64_t kMaxDecodeHeads = 8;  // q heads per decode item: their accumulators fit in registers
constexpr int64_t kMaxTileVecs = 4;     // row vectors per prefill tile (64 rows with AVX512, 32 with AVX2)
constexpr int64_t kMaxTileRows = kMaxTileVecs * kVecSize;
static_assert(kMaxTileRows <= hpi_attention::kAmxPrefillRows, "an AMX prefill item takes any tile item's rows");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using hpi_vec::load_float;

// Horizontal sum / max through at::vec's shuffle trees (Vectorized::reduce_add does not compile in
// torch's generic DEFAULT build).
inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, v);
}
inline float max_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); }, v);
}

// sums[i] = the sum of v[i]'s lanes, for kVecSize vectors v: one transposing shuffle tree for all of them
// (about a third of the shuffles of kVecSize separate reductions).
inline Vec sum_lanes_each(const Vec* v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 w[8], x[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of v[2i] = a, v[2i+1] = b
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: partial sums of v[4i .. 4i + 3]
    x[i] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Sum the four 128-bit lanes of each x[i] into lane i.
  const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 w[4], x[2];
  for (int i = 0; i < 4; ++i) {
    w[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 2; ++i) {
    x[i] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(x[0], x[1], 0x20), _mm256_permute2f128_ps(x[0], x[1], 0x31));
#else
  float sums[kVecSize];
  for (int64_t i = 0; i < kVecSize; ++i) sums[i] = sum_lanes(v[i]);
  return Vec::loadu(sums);
#endif
}

// scores[j] = q . (key j) for keys j < n, `stride` elements apart: kVecSize keys at a time, reduced together.
template <typename T>
inline void score_keys(const float* q, const T* k, int64_t n, int64_t stride, int64_t head_dim, float* scores) {
  int64_t j = 0;
  for (; j + kVecSize <= n; j += kVecSize) {
    Vec part[kVecSize];
    for (int64_t i = 0; i < kVecSize; ++i) part[i] = Vec(0.f);
    for (int64_t c = 0; c < head_dim; c += kVecSize) {
      const Vec qv = Vec::loadu(q + c);
      for (int64_t i = 0; i < kVecSize; ++i) part[i] = at::vec::fmadd(qv, load_float(k + (j + i) * stride + c), part[i]);
    }
    sum_lanes_each(part).store(scores + j);
  }
  for (; j < n; ++j) {
    Vec part(0.f);
    for (int64_t c = 0; c < head_dim; c += kVecSize) {
      part = at::vec::fmadd(Vec::loadu(q + c), load_float(k + j * stride + c), part);
    }
    scores[j] = sum_lanes(part);
  }
}

// Brings rows [0, n) of a block's kv head (row stride `stride` elements) towards L1 ahead of use: blocks
// sit at random places in the cache, so the hardware prefetchers cannot see the next one coming.
template <typename T>
inline void prefetch_rows(const T* rows, int64_t n, int64_t stride, int64_t head_dim) {
  constexpr int64_t kLine = 64 / sizeof(T);
  for (int64_t j = 0; j < n; ++j) {
    for (int64_t c = 0; c < head_dim; c += kLine) __builtin_prefetch(rows + j * stride + c, 0, 3);
  }
}

// Head-dim vectors a decode item's P @ V pass updates at once for its GB heads: GB x NC accumulators, each an
// FMA chain over the block's keys, so that GB * NC chains (not GB) hide the FMA latency; as many as the registers
// hold beside GB broadcast scores and a value vector (AVX2's 16: 12 accumulators; AVX512's 32: 24), a power of
// two up to 4.
constexpr int decode_value_chunks(int GB) {
  const int fit = (kVecSize >= 16 ? 24 : 12) / GB;
  return fit >= 4 ? 4 : fit >= 2 ? 2 : 1;
}

// acc[g, c .. c + NC vectors) = acc * alpha[g] + sum_j scores[g, j] * value j, for the block's n keys.
template <int GB, int NC, typename C>
inline void add_values(float* acc, const float* alpha, const float* scores, const C* v, int64_t n, int64_t BS,
                       int64_t token_stride, int64_t D, int64_t c) {
  Vec a[GB][NC];
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < NC; ++i) a[g][i] = Vec::loadu(acc + g * D + c + i * kVecSize) * Vec(alpha[g]);
  for (int64_t j = 0; j < n; ++j) {
    Vec s[GB];
    for (int g = 0; g < GB; ++g) s[g] = Vec(scores[g * BS + j]);
    for (int i = 0; i < NC; ++i) {
      const Vec vv = load_float(v + j * token_stride + c + i * kVecSize);
      for (int g = 0; g < GB; ++g) a[g][i] = at::vec::fmadd(s[g], vv, a[g][i]);
    }
  }
  for (int g = 0; g < GB; ++g)
    for (int i = 0; i < NC; ++i) a[g][i].store(acc + g * D + c + i * kVecSize);
}

// One decode token, q heads [first, first + GB) of one kv head's group, over all its cached keys.
template <typename T, typename C, int GB>
void decode_item(const Problem<T, C>& p, const WorkItem& w, float* scratch) {
  const int64_t D = p.head_dim, BS = p.block_size, token_stride = p.cache_token_stride();
  const int64_t token = p.query_start_loc[w.req];
  const int64_t context_len = p.context_lens[w.req];
  const int64_t head0 = w.kv_head * p.group_size + w.first;
  float* q = scratch;            // [GB, D] query rows times scale
  float* acc = q + GB * D;       // [GB, D] unnormalised output
  float* scores = acc + GB * D;  // [GB, BS] one block's scores, then probabilities
  float* keys = scores + GB * BS;  // [BS, D] one block's keys in fp32 (fp8 caches only)
  for (int g = 0; g < GB; ++g) {
    const T* src = p.q + token * p.q_token_stride + (head0 + g) * p.q_head_stride;
    for (int64_t d = 0; d < D; ++d) q[g * D + d] = static_cast<float>(src[d]) * p.scale;
  }
  std::fill(acc, acc + GB * D, 0.f);
  float row_max[GB], row_sum[GB], alpha[GB];
  std::fill(row_max, row_max + GB, kNegInf);
  std::fill(row_sum, row_sum + GB, 0.f);
  // The window's first key; its block is the first one read, and it always holds that (visible) key.
  const int64_t first_key = p.sliding_window > 0 ? std::max<int64_t>(0, context_len - p.sliding_window) : 0;

  for (int64_t b = first_key / BS, start = b * BS; start < context_len; start += BS, ++b) {
    const int64_t n = std::min(BS, context_len - start);
    const C* k = p.block_rows(p.k_cache, w.req, b, w.kv_head);
    const C* v = p.block_rows(p.v_cache, w.req, b, w.kv_head);
    if (start + BS < context_len) {
      const int64_t next_n = std::min(BS, context_len - start - BS);
      prefetch_rows(p.block_rows(p.k_cache, w.req, b + 1, w.kv_head), next_n, token_stride, D);
      prefetch_rows(p.block_rows(p.v_cache, w.req, b + 1, w.kv_head), next_n, token_stride, D);
    }
    if constexpr (hpi_vec::is_fp8<C>) {  // widened once for the GB heads: widening fp8 costs more than the FMAs
      for (int64_t j = 0; j < n; ++j)
        for (int64_t c = 0; c < D; c += kVecSize) load_float(k + j * token_stride + c).store(keys + j * D + c);
      for (int g = 0; g < GB; ++g) score_keys(q + g * D, keys, n, D, D, scores + g * BS);
    } else {
      for (int g = 0; g < GB; ++g) score_keys(q + g * D, k, n, token_stride, D, scores + g * BS);
    }
    if (p.logit_softcap > 0.f) {
      for (int g = 0; g < GB; ++g)
        for (int64_t j = 0; j < n; ++j)
          scores[g * BS + j] = p.logit_softcap * std::tanh(scores[g * BS + j] / p.logit_softcap);
    }
    for (int64_t j = 0; j < first_key - start; ++j) {  // keys of the first block before the window
      for (int g = 0; g < GB; ++g) scores[g * BS + j] = kNegInf;
    }
    for (int g = 0; g < GB; ++g) {
      float* s = scores + g * BS;
      Vec block_max(kNegInf);
      for (int64_t j = 0; j < n; j += kVecSize) {
        const int64_t count = std::min(kVecSize, n - j);
        block_max = at::vec::maximum(block_max, Vec::set(Vec(kNegInf), Vec::loadu(s + j, count), count));
      }
      const float new_max = std::max(row_max[g], max_lanes(block_max));
      alpha[g] = std::exp(row_max[g] - new_max);  // 0 on the first block (row_max = -inf)
      row_max[g] = new_max;
      Vec sum(0.f);
      for (int64_t j = 0; j < n; j += kVecSize) {
        const int64_t count = std::min(kVecSize, n - j);
        const Vec x = Vec::set(Vec(kNegInf), Vec::loadu(s + j, count), count);
        const Vec e = (x - Vec(new_max)).exp_u20();  // lanes past n: exp(-inf) = 0
        e.store(s + j, count);
        sum = sum + e;
      }
      row_sum[g] = row_sum[g] * alpha[g] + sum_lanes(sum);
    }
    constexpr int NC = decode_value_chunks(GB);
    int64_t c = 0;
    for (; c + NC * kVecSize <= D; c += NC * kVecSize) {
      add_values<GB, NC>(acc, alpha, scores, v, n, BS, token_stride, D, c);
    }
    for (; c < D; c += kVecSize) add_values<GB, 1>(acc, alpha, scores, v, n, BS, token_stride, D, c);
  }
  for (int g = 0; g < GB; ++g) {
    T* dst = p.out + token * p.num_heads * D + (head0 + g) * D;
    const float inv = 1.f / row_sum[g];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[g * D + d] * inv);
  }
}

// Keys and head-dim columns handled per pass of the tile kernel's inner loops: each loaded vector of rows
// feeds this many FMAs. Four with AVX512's 32 registers, two with AVX2's 16 (NV <= 4 accumulators each).
constexpr int kTileUnroll = kVecSize >= 16 ? 4 : 2;

// scores[j + u, rows] = sum_d keys[j + u, d] * qt[d, rows] for u < NK; qt: [D, NV * kVecSize].
template <int NK, int NV>
inline void score_keys(const float* qt, const float* keys, int64_t key_stride, int64_t D, float* scores) {
  constexpr int64_t RT = NV * kVecSize;
  Vec s[NK][NV];
  for (int u = 0; u < NK; ++u)
    for (int vi = 0; vi < NV; ++vi) s[u][vi] = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    Vec key[NK];
    for (int u = 0; u < NK; ++u) key[u] = Vec(keys[u * key_stride + d]);
    for (int vi = 0; vi < NV; ++vi) {
      const Vec qv = Vec::loadu(qt + d * RT + vi * kVecSize);
      for (int u = 0; u < NK; ++u) s[u][vi] = at::vec::fmadd(qv, key[u], s[u][vi]);
    }
  }
  for (int u = 0; u < NK; ++u)
    for (int vi = 0; vi < NV; ++vi) s[u][vi].store(scores + u * RT + vi * kVecSize);
}

// acc[d + u, rows] = acc[d + u, rows] * alpha + sum_j values[j, d + u] * probs[j, rows] for u < ND.
template <int ND, int NV>
inline void accumulate_values(const float* probs, const float* values, int64_t value_stride, int64_t n,
                              const Vec (&alpha)[NV], float* acc) {
  constexpr int64_t RT = NV * kVecSize;
  Vec a[ND][NV];
  for (int u = 0; u < ND; ++u)
    for (int vi = 0; vi < NV; ++vi) a[u][vi] = Vec::loadu(acc + u * RT + vi * kVecSize) * alpha[vi];
  for (int64_t j = 0; j < n; ++j) {
    Vec value[ND];
    for (int u = 0; u < ND; ++u) value[u] = Vec(values[j * value_stride + u]);
    for (int vi = 0; vi < NV; ++vi) {
      const Vec pv = Vec::loadu(probs + j * RT + vi * kVecSize);
      for (int u = 0; u < ND; ++u) a[u][vi] = at::vec::fmadd(pv, value[u], a[u][vi]);
    }
  }
  for (int u = 0; u < ND; ++u)
    for (int vi = 0; vi < NV; ++vi) a[u][vi].store(acc + u * RT + vi * kVecSize);
}

// Rows [first, first + count) of one request's (token, q head) rows of one kv head, over the keys up to
// the last row's position. Row r is token r / group_size, q head r % group_size of the group.
template <typename T, typename C, int NV>
void tile_item(const Problem<T, C>& p, const WorkItem& w, float* scratch) {
  constexpr int64_t RT = NV * kVecSize;  // rows in lanes, padded
  const int64_t D = p.head_dim, BS = p.block_size, G = p.group_size, token_stride = p.cache_token_stride();
  const auto [q_start, prefix_len, first_pos, kv_end, first_key] = hpi_attention::tile_span(p, w);
  const int64_t r0 = w.first, num_rows = w.count;
  float* qt = scratch;            // [D, RT] query rows times scale, transposed
  float* acc = qt + D * RT;       // [D, RT] unnormalised output, transposed
  float* scores = acc + D * RT;   // [BS, RT] one block's scores, then probabilities
  float* pos = scores + BS * RT;  // [RT] position of each row; pad rows see every key
  float* kbuf = pos + RT;         // [BS, D] a block's keys in fp32 (16- and 8-bit caches only)
  float* vbuf = kbuf + BS * D;    // [BS, D] a block's values in fp32 (16- and 8-bit caches only)

  for (int64_t r = 0; r < RT; ++r) {
    if (r < num_rows) {
      const int64_t token = (r0 + r) / G, head = w.kv_head * G + (r0 + r) % G;
      const T* src = p.q + (q_start + token) * p.q_token_stride + head * p.q_head_stride;
      for (int64_t d = 0; d < D; ++d) qt[d * RT + r] = static_cast<float>(src[d]) * p.scale;
      pos[r] = static_cast<float>(prefix_len + token);
    } else {
      for (int64_t d = 0; d < D; ++d) qt[d * RT + r] = 0.f;
      pos[r] = std::numeric_limits<float>::max();
    }
  }
  std::fill(acc, acc + D * RT, 0.f);
  Vec row_max[NV], row_sum[NV], alpha[NV], pos_v[NV];
  for (int v = 0; v < NV; ++v) {
    row_max[v] = Vec(kNegInf);
    row_sum[v] = Vec(0.f);
    pos_v[v] = Vec::loadu(pos + v * kVecSize);
  }
  const int64_t W = p.sliding_window;

  for (int64_t b = first_key / BS, start = b * BS; start < kv_end; start += BS, ++b) {
    const int64_t n = std::min(BS, kv_end - start);
    const C* k = p.block_rows(p.k_cache, w.req, b, w.kv_head);
    const C* v = p.block_rows(p.v_cache, w.req, b, w.kv_head);
    if (start + BS < kv_end) {
      const int64_t next_n = std::min(BS, kv_end - start - BS);
      prefetch_rows(p.block_rows(p.k_cache, w.req, b + 1, w.kv_head), next_n, token_stride, D);
      prefetch_rows(p.block_rows(p.v_cache, w.req, b + 1, w.kv_head), next_n, token_stride, D);
    }
    const float* kf;
    const float* vf;
    int64_t kv_stride;
    if constexpr (std::is_same_v<C, float>) {
      kf = k, vf = v, kv_stride = token_stride;
    } else {  // widen once per block; every row of the tile reuses it
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t c = 0; c < D; c += kVecSize) {
          load_float(k + j * token_stride + c).store(kbuf + j * D + c);
          load_float(v + j * token_stride + c).store(vbuf + j * D + c);
        }
      }
      kf = kbuf, vf = vbuf, kv_stride = D;
    }

    int64_t j = 0;
    for (; j + kTileUnroll <= n; j += kTileUnroll) {
      score_keys<kTileUnroll, NV>(qt, kf + j * kv_stride, kv_stride, D, scores + j * RT);
    }
    for (; j < n; ++j) score_keys<1, NV>(qt, kf + j * kv_stride, kv_stride, D, scores + j * RT);
    if (p.logit_softcap > 0.f) {
      const Vec cap(p.logit_softcap), inv_cap(1.f / p.logit_softcap);
      for (int64_t i = 0; i < n * RT; i += kVecSize) (cap * (Vec::loadu(scores + i) * inv_cap).tanh()).store(scores + i);
    }
    const bool causal_cut = start + n - 1 > first_pos;  // the block reaches past some row's position
    const bool window_cut = W > 0 && start + W <= kv_end - 1;  // ... or lies before some row's window
    if (causal_cut || window_cut) {
      for (int64_t jj = 0; jj < n; ++jj) {
        const Vec key_pos(static_cast<float>(start + jj)), window_end(static_cast<float>(start + jj + W));
        for (int vi = 0; vi < NV; ++vi) {
          float* s = scores + jj * RT + vi * kVecSize;
          Vec masked = key_pos > pos_v[vi];
          if (window_cut) masked = masked | (window_end <= pos_v[vi]);
          Vec::blendv(Vec::loadu(s), Vec(kNegInf), masked).store(s);
        }
      }
    }

    // Online softmax, per row (lane). Without a window every row has key 0 unmasked, so row_max is finite
    // after block 0; with one, a row may see no key of the first blocks: its max stays -inf and 0 is
    // subtracted instead (exp(-inf) = 0, never -inf - -inf = NaN).
    for (int vi = 0; vi < NV; ++vi) {
      Vec block_max = row_max[vi];
      for (int64_t jj = 0; jj < n; ++jj)
        block_max = at::vec::maximum(block_max, Vec::loadu(scores + jj * RT + vi * kVecSize));
      const Vec safe_max = Vec::blendv(block_max, Vec(0.f), block_max == Vec(kNegInf));
      alpha[vi] = (row_max[vi] - safe_max).exp_u20();
      row_max[vi] = block_max;
      Vec sum(0.f);
      for (int64_t jj = 0; jj < n; ++jj) {
        float* s = scores + jj * RT + vi * kVecSize;
        const Vec e = (Vec::loadu(s) - safe_max).exp_u20();
        e.store(s);
        sum = sum + e;
      }
      row_sum[vi] = row_sum[vi] * alpha[vi] + sum;
    }

    // head_dim is a multiple of 16, so of kTileUnroll.
    for (int64_t d = 0; d < D; d += kTileUnroll) {
      accumulate_values<kTileUnroll, NV>(scores, vf + d, kv_stride, n, alpha, acc + d * RT);
    }
  }

  float inv[RT];
  for (int vi = 0; vi < NV; ++vi) (Vec(1.f) / row_sum[vi]).store(inv + vi * kVecSize);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t token = (r0 + r) / G, head = w.kv_head * G + (r0 + r) % G;
    T* dst = p.out + (q_start + token) * p.num_heads * D + head * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[d * RT + r] * inv[r]);
  }
}

template <typename T, typename C>
void run_item(const Problem<T, C>& p, const WorkItem& w, float* scratch) {
  if (w.decode) {
    switch (w.count) {
      case 1: return decode_item<T, C, 1>(p, w, scratch);
      case 2: return decode_item<T, C, 2>(p, w, scratch);
      case 3: return decode_item<T, C, 3>(p, w, scratch);
      case 4: return decode_item<T, C, 4>(p, w, scratch);
      case 5: return decode_item<T, C, 5>(p, w, scratch);
      case 6: return decode_item<T, C, 6>(p, w, scratch);
      case 7: return decode_item<T, C, 7>(p, w, scratch);
      default: return decode_item<T, C, 8>(p, w, scratch);
    }
  }
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (p.amx_prefill) return hpi_attention::amx_prefill_item(p, w);
  }
  switch ((w.count + kVecSize - 1) / kVecSize) {
    case 1: return tile_item<T, C, 1>(p, w, scratch);
    case 2: return tile_item<T, C, 2>(p, w, scratch);
    case 3: return tile_item<T, C, 3>(p, w, scratch);
    default: return tile_item<T, C, 4>(p, w, scratch);
  }
}

// Floats of per-thread scratch that any item needs.
int64_t scratch_floats(int64_t head_dim, int64_t block_size) {
  const int64_t decode = 2 * kMaxDecodeHeads * head_dim + kMaxDecodeHeads * block_size + block_size * head_dim;
  const int64_t tile =
      2 * head_dim * kMaxTileRows + block_size * kMaxTileRows + kMaxTileRows + 2 * block_size * head_dim;
  return std::max(decode, tile);
}

// The op's arguments, validated by check_args.
struct OpArgs {
  const at::Tensor& out;              // [num_tokens, num_heads, head_dim] contiguous, written in place
  const at::Tensor& q;                // [num_tokens, num_heads, head_dim], last dim contiguous
  const at::Tensor& k_cache;          // [num_blocks, block_size, num_kv_heads, head_dim] contiguous
  const at::Tensor& v_cache;          // [num_blocks, block_size, num_kv_heads, head_dim] contiguous
  const at::Tensor& block_tables;     // [num_reqs, max_blocks] int32, contiguous rows
  const at::Tensor& query_start_loc;  // [num_reqs + 1] int32
  const at::Tensor& context_lens;     // [num_reqs] int32, tokens in the cache incl. this step's
  double scale;
  int64_t sliding_window;  // 0: none
  double logit_softcap;    // 0: none

  int64_t num_reqs() const { return block_tables.size(0); }
  int64_t group_size() const { return q.size(1) / k_cache.size(2); }
};

bool is_fp8_dtype(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

// A cache holds q's dtype, bf16 (`--kv-cache-dtype bfloat16`: half an fp32 model's bytes) or fp8.
bool cache_dtype_ok(at::ScalarType cache, at::ScalarType q) {
  return cache == q || cache == at::kBFloat16 || is_fp8_dtype(cache);
}

void check_int32_vector(const at::Tensor& t, const char* name, int64_t length) {
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == length && t.scalar_type() == at::kInt && t.is_contiguous(), name,
                    " must be a contiguous int32 vector of length ", length, ", got ", t.scalar_type(), " ", t.sizes());
}

// Shapes, dtypes and layouts; the per-request lengths are checked by plan_work, block ids as they are read.
void check_args(const OpArgs& a) {
  for (const at::Tensor* t :
       {&a.out, &a.q, &a.k_cache, &a.v_cache, &a.block_tables, &a.query_start_loc, &a.context_lens}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "paged_attention_cpu takes CPU tensors, got one on ", t->device());
  }
  TORCH_CHECK_VALUE(a.q.dim() == 3 && a.q.stride(2) == 1,
                    "q must be [num_tokens, num_heads, head_dim] with a contiguous last dim, got ", a.q.sizes(),
                    " strides ", a.q.strides());
  TORCH_CHECK_VALUE(a.k_cache.dim() == 4 && a.k_cache.is_contiguous(),
                    "k_cache must be a contiguous [num_blocks, block_size, num_kv_heads, head_dim], got ",
                    a.k_cache.sizes());
  TORCH_CHECK_VALUE(a.v_cache.sizes() == a.k_cache.sizes() && a.v_cache.is_contiguous(),
                    "v_cache must be contiguous and shaped as k_cache ", a.k_cache.sizes(), ", got ",
                    a.v_cache.sizes());
  const auto dtype = a.q.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
                    "q must be float32, bfloat16 or float16, got ", dtype);
  const auto cache_dtype = a.k_cache.scalar_type();
  TORCH_CHECK_VALUE(cache_dtype_ok(cache_dtype, dtype) && a.v_cache.scalar_type() == cache_dtype,
                    "k_cache and v_cache must both have q's dtype ", dtype, " or both bfloat16, float8_e4m3fn or "
                    "float8_e5m2, got ", cache_dtype, " and ", a.v_cache.scalar_type());
  TORCH_CHECK_VALUE(a.out.sizes() == a.q.sizes() && a.out.scalar_type() == dtype && a.out.is_contiguous(),
                    "out must be a contiguous tensor of q's shape and dtype");
  const int64_t num_heads = a.q.size(1), head_dim = a.q.size(2), num_kv_heads = a.k_cache.size(2);
  TORCH_CHECK_VALUE(a.k_cache.size(3) == head_dim, "cache head_dim ", a.k_cache.size(3), " != q head_dim ", head_dim);
  TORCH_CHECK_VALUE(head_dim % 16 == 0, "head_dim must be a multiple of 16, got ", head_dim);
  TORCH_CHECK_VALUE(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "num_heads (", num_heads,
                    ") must be a multiple of num_kv_heads (", num_kv_heads, ")");
  TORCH_CHECK_VALUE(
      a.block_tables.dim() == 2 && a.block_tables.scalar_type() == at::kInt && a.block_tables.stride(1) == 1,
      "block_tables must be [num_reqs, max_blocks] int32 with contiguous rows, got ", a.block_tables.scalar_type(), " ",
      a.block_tables.sizes());
  check_int32_vector(a.query_start_loc, "query_start_loc", a.num_reqs() + 1);
  check_int32_vector(a.context_lens, "context_lens", a.num_reqs());
  TORCH_CHECK_VALUE(a.sliding_window >= 0, "sliding_window must be >= 0 (0: none), got ", a.sliding_window);
  TORCH_CHECK_VALUE(a.logit_softcap >= 0, "logit_softcap must be >= 0 (0: none), got ", a.logit_softcap);
}

// Validates each request's lengths and cuts the batch into work items, longest first (a request's items of equal
// cost stay next to each other: plan_runs groups a decode's).
std::vector<WorkItem> plan_work(const OpArgs& a) {
  const int32_t* query_start_loc = a.query_start_loc.const_data_ptr<int32_t>();
  const int32_t* context_lens = a.context_lens.const_data_ptr<int32_t>();
  const int64_t num_tokens = a.q.size(0), num_kv_heads = a.k_cache.size(2), group_size = a.group_size();
  const int64_t max_context_len = a.block_tables.size(1) * a.k_cache.size(1);
  TORCH_CHECK_VALUE(a.num_reqs() == 0 || query_start_loc[0] >= 0, "query_start_loc[0] must be >= 0");
  // Decodes split their q heads evenly into chunks of at most kMaxDecodeHeads.
  const int64_t decode_chunks = (group_size + kMaxDecodeHeads - 1) / kMaxDecodeHeads;
  const int64_t decode_chunk = (group_size + decode_chunks - 1) / decode_chunks;
  std::vector<WorkItem> items;
  for (int64_t r = 0; r < a.num_reqs(); ++r) {
    const int64_t query_len = query_start_loc[r + 1] - query_start_loc[r];
    const int64_t context_len = context_lens[r];
    TORCH_CHECK_VALUE(query_len >= 0 && query_start_loc[r + 1] <= num_tokens,
                      "query_start_loc must be non-decreasing and <= num_tokens (", num_tokens,
                      "), got query_start_loc[", r, ":", r + 2, "] = ", query_start_loc[r], ", ",
                      query_start_loc[r + 1]);
    TORCH_CHECK_VALUE(query_len <= context_len, "request ", r, ": context_lens (", context_len,
                      ") must count the query's own ", query_len, " tokens");
    TORCH_CHECK_VALUE(context_len <= max_context_len, "request ", r, ": context_lens (", context_len,
                      ") exceeds block_tables' ", max_context_len, " slots");
    if (query_len == 0) continue;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      if (query_len == 1) {
        for (int64_t g = 0; g < group_size; g += decode_chunk) {
          const int64_t count = std::min(decode_chunk, group_size - g);
          const int64_t keys = a.sliding_window > 0 ? std::min(context_len, a.sliding_window) : context_len;
          items.push_back({keys * (count + 4), int32_t(r), int32_t(h), int32_t(g), int32_t(count), true});
        }
        continue;
      }
      const int64_t num_rows = query_len * group_size, prefix_len = context_len - query_len;
      for (int64_t r0 = 0; r0 < num_rows; r0 += kMaxTileRows) {
        const int64_t count = std::min(kMaxTileRows, num_rows - r0);
        const int64_t kv_end = prefix_len + (r0 + count - 1) / group_size + 1;
        const int64_t padded = (count + kVecSize - 1) / kVecSize * kVecSize;
        const int64_t first_pos = prefix_len + r0 / group_size;
        const int64_t first_key = a.sliding_window > 0 ? std::max<int64_t>(0, first_pos - a.sliding_window + 1) : 0;
        items.push_back({(kv_end - first_key) * padded, int32_t(r), int32_t(h), int32_t(r0), int32_t(count), false});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& x, const WorkItem& y) { return x.cost > y.cost; });
  return items;
}

// Runs of consecutive items, each taken by one thread in turn, as [runs[i], runs[i + 1]): a decoding request's
// items (its kv heads) together, so that one thread reads each of its K and V blocks whole, where up to three
// threads each read one kv head's third of every row (a decode step's attention over 32 requests on an AVX2 Zen 2:
// 17% less time, bench/results/attention_cpu.md); but each item alone where its request's run would exceed a
// thread's fair share of the work (one request, or a long one among short ones: its kv heads are shared out).
// HPI_CPU_ATTENTION_RUNS=0 keeps every item alone, as before (read once; bench/attention_runs_cpu.py compares).
std::vector<int64_t> plan_runs(const std::vector<WorkItem>& items, int64_t num_threads) {
  static const bool grouped = [] {
    const char* setting = std::getenv("HPI_CPU_ATTENTION_RUNS");
    return !(setting != nullptr && std::strcmp(setting, "0") == 0);
  }();
  int64_t total = 0;
  for (const WorkItem& w : items) total += w.cost;
  const int64_t fair_share = total / std::max<int64_t>(1, num_threads);
  std::vector<int64_t> runs;
  for (int64_t i = 0, n = static_cast<int64_t>(items.size()); i < n;) {
    int64_t end = i + 1, cost = items[i].cost;
    if (items[i].decode) {
      for (; end < n && items[end].decode && items[end].req == items[i].req; ++end) cost += items[end].cost;
    }
    if (!grouped || cost > fair_share) end = i + 1;
    runs.push_back(i);
    i = end;
  }
  runs.push_back(static_cast<int64_t>(items.size()));
  return runs;
}

template <typename T, typename C>
void launch(const OpArgs& a, const std::vector<WorkItem>& items, bool amx) {
  const Problem<T, C> problem{.out = a.out.data_ptr<T>(),
                              .q = a.q.const_data_ptr<T>(),
                              .k_cache = a.k_cache.const_data_ptr<C>(),
                              .v_cache = a.v_cache.const_data_ptr<C>(),
                              .block_tables = a.block_tables.const_data_ptr<int32_t>(),
                              .query_start_loc = a.query_start_loc.const_data_ptr<int32_t>(),
                              .context_lens = a.context_lens.const_data_ptr<int32_t>(),
                              .q_token_stride = a.q.stride(0),
                              .q_head_stride = a.q.stride(1),
                              .block_table_stride = a.block_tables.stride(0),
                              .num_heads = a.q.size(1),
                              .num_kv_heads = a.k_cache.size(2),
                              .head_dim = a.q.size(2),
                              .group_size = a.group_size(),
                              .block_size = a.k_cache.size(1),
                              .num_blocks = a.k_cache.size(0),
                              .scale = static_cast<float>(a.scale),
                              .sliding_window = a.sliding_window,
                              .logit_softcap = static_cast<float>(a.logit_softcap),
                              .amx_prefill = amx};
  const std::vector<int64_t> runs = plan_runs(items, at::get_num_threads());
  const int64_t num_runs = static_cast<int64_t>(runs.size()) - 1;
  const int64_t scratch_size = scratch_floats(problem.head_dim, problem.block_size);
  std::atomic<int64_t> next{0};
  // One task per thread, each claiming runs of items (sorted longest first) until none are left: dynamic
  // balancing that at::parallel_for's static chunks would not give for skewed context lengths.
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_runs), 1, [&](int64_t, int64_t) {
    std::vector<float> scratch(scratch_size);
    for (int64_t r = next.fetch_add(1); r < num_runs; r = next.fetch_add(1)) {
      for (int64_t i = runs[r]; i < runs[r + 1]; ++i) run_item(problem, items[i], scratch.data());
    }
  });
}

template <typename T>
void launch_for_cache(const OpArgs& a, const std::vector<WorkItem>& items, bool amx) {
  switch (a.k_cache.scalar_type()) {
    case at::kFloat8_e4m3fn: return launch<T, c10::Float8_e4m3fn>(a, items, amx);
    case at::kFloat8_e5m2: return launch<T, c10::Float8_e5m2>(a, items, amx);
    case at::kBFloat16: return launch<T, c10::BFloat16>(a, items, amx);
    default: return launch<T, T>(a, items, amx);
  }
}

void paged_attention_cpu(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                         const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& query_start_loc,
                         const at::Tensor& context_lens, double scale, int64_t sliding_window, double logit_softcap) {
  const OpArgs args{out,          q,     k_cache,        v_cache,      block_tables, query_start_loc,
                    context_lens, scale, sliding_window, logit_softcap};
  check_args(args);
  const bool amx = hpi_attention::amx_prefill_applies(q.scalar_type() == at::kBFloat16, q.size(2), logit_softcap);
  const std::vector<WorkItem> items = plan_work(args);
  if (items.empty()) return;
  switch (q.scalar_type()) {
    case at::kBFloat16: return launch_for_cache<at::BFloat16>(args, items, amx);
    case at::kHalf: return launch_for_cache<at::Half>(args, items, false);
    default: return launch_for_cache<float>(args, items, false);
  }
}

// x rounded to nearest even on fp8's grid and saturated at its largest finite value (M mantissa bits, exponent
// bias B), as fp8 bits: written without branches (GCC vectorises the row loop below) instead of c10's scalar
// conversion, which cost 1.6 ns an element (1.3 ms of a 2048-token prefill's layer). |x| + 2^(e - M + 23), less
// the same, leaves |x| rounded to a whole ulp of its binade e (subnormals: of the smallest normal binade); the
// rounded value is then exactly representable and its bits are moved into place. Bit for bit torch's
// conversion (tests/kernels/test_cpu_attention.py), except that NaN saturates too.
template <int M, int B>
inline uint8_t fp8_bits(float x, float limit) {
  uint32_t u, ua, ur;
  std::memcpy(&u, &x, 4);
  float a = std::fabs(x);
  a = a < limit ? a : limit;
  std::memcpy(&ua, &a, 4);
  const int32_t e = std::max<int32_t>(static_cast<int32_t>(ua >> 23), 128 - B);
  const uint32_t magic_bits = static_cast<uint32_t>(e - M + 23) << 23;
  float magic;
  std::memcpy(&magic, &magic_bits, 4);
  const float r = (a + magic) - magic;
  std::memcpy(&ur, &r, 4);
  constexpr float kMinNormal = 1.f / static_cast<float>(1 << (B - 1));  // 2^(1 - B)
  constexpr float kSubnormalSteps = static_cast<float>(1 << (B + M - 1));  // subnormal ulps per unit
  const uint32_t normal = (ur >> (23 - M)) - (static_cast<uint32_t>(127 - B) << M);
  const uint32_t subnormal = static_cast<uint32_t>(static_cast<int32_t>(r * kSubnormalSteps));  // < 2^M: exact
  return static_cast<uint8_t>((r >= kMinNormal ? normal : subnormal) | ((u >> 24) & 0x80));
}

template <bool kE4M3>
void fp8_row(const float* __restrict x, uint8_t* __restrict out, int64_t n, float limit) {
  for (int64_t i = 0; i < n; ++i) out[i] = kE4M3 ? fp8_bits<3, 7>(x[i], limit) : fp8_bits<2, 15>(x[i], limit);
}

// Rows [0, num_tokens) of src [rows, num_kv_heads, head_dim] written to the slots of a cache of a narrower type C:
// fp8 rounded to nearest (even) and saturated at the format's largest finite value (448 for e4m3fn, 57344 for
// e5m2), with no scale (vLLM's default k/v scale of 1.0); bf16 rounded to nearest even, as torch's `.to()`.
// Tokens are split over the threads (a prefill's rows are many).
template <typename T, typename C>
void write_narrowed_rows_as(const at::Tensor& src, const at::Tensor& cache, const int64_t* slots,
                            int64_t num_tokens) {
  const int64_t heads = cache.size(2), D = cache.size(3);
  const T* from = src.const_data_ptr<T>();
  C* to = static_cast<C*>(cache.data_ptr());
  const int64_t token_stride = src.stride(0), head_stride = src.stride(1);
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> widened(D);  // head_dim is a multiple of 16
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const T* row = from + t * token_stride + h * head_stride;
        C* dst = to + (slots[t] * heads + h) * D;
        for (int64_t d = 0; d < D; d += kVecSize) load_float(row + d).store(widened.data() + d);
        if constexpr (hpi_vec::is_fp8<C>) {
          constexpr bool kE4M3 = std::is_same_v<C, c10::Float8_e4m3fn>;
          const float limit = static_cast<float>(std::numeric_limits<C>::max());
          fp8_row<kE4M3>(widened.data(), reinterpret_cast<uint8_t*>(dst), D, limit);
        } else {
          at::vec::convert(widened.data(), dst, D);
        }
      }
    }
  });
}

template <typename T>
void write_narrowed_rows_from(const at::Tensor& src, const at::Tensor& cache, const int64_t* slots,
                              int64_t num_tokens) {
  switch (cache.scalar_type()) {
    case at::kFloat8_e4m3fn: return write_narrowed_rows_as<T, c10::Float8_e4m3fn>(src, cache, slots, num_tokens);
    case at::kFloat8_e5m2: return write_narrowed_rows_as<T, c10::Float8_e5m2>(src, cache, slots, num_tokens);
    default: return write_narrowed_rows_as<T, c10::BFloat16>(src, cache, slots, num_tokens);
  }
}

void write_narrowed_rows(const at::Tensor& src, const at::Tensor& cache, const int64_t* slots, int64_t num_tokens) {
  switch (src.scalar_type()) {
    case at::kBFloat16: return write_narrowed_rows_from<at::BFloat16>(src, cache, slots, num_tokens);
    case at::kHalf: return write_narrowed_rows_from<at::Half>(src, cache, slots, num_tokens);
    default: return write_narrowed_rows_from<float>(src, cache, slots, num_tokens);
  }
}

// The step's new K/V rows written into their cache slots, then attention over the cache: what the model's
// attention layer does in one call (one dispatch instead of three). Rows of q past slot_mapping's length
// (pad rows) get zeros and write nothing.
at::Tensor cached_paged_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& k_cache, const at::Tensor& v_cache,
                                      const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                      const at::Tensor& query_start_loc, const at::Tensor& context_lens, double scale,
                                      int64_t sliding_window, double logit_softcap) {
  const int64_t num_tokens = slot_mapping.size(0);
  for (const at::Tensor* t : {&k, &v, &slot_mapping}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "cached_paged_attention_cpu takes CPU tensors, got one on ", t->device());
  }
  TORCH_CHECK_VALUE(slot_mapping.dim() == 1 && slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
                    "slot_mapping must be a contiguous int64 vector");
  TORCH_CHECK_VALUE(k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) >= num_tokens && k.size(1) == k_cache.size(2) &&
                        k.size(2) == k_cache.size(3) && k.scalar_type() == q.scalar_type() &&
                        v.scalar_type() == q.scalar_type() && k.stride(2) == 1 && v.stride(2) == 1,
                    "k and v must be [num_rows >= ", num_tokens, ", num_kv_heads, head_dim] rows of the caches' shape "
                    "in q's dtype, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), "k_cache and v_cache must be contiguous");
  TORCH_CHECK_VALUE(cache_dtype_ok(k_cache.scalar_type(), q.scalar_type()) &&
                        v_cache.scalar_type() == k_cache.scalar_type(),
                    "k_cache and v_cache must both have q's dtype ", q.scalar_type(), " or both bfloat16, "
                    "float8_e4m3fn or float8_e5m2, got ", k_cache.scalar_type(), " and ", v_cache.scalar_type());
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row = k_cache.size(2) * k_cache.size(3), bytes = row * k_cache.element_size();
  const int64_t* slots = slot_mapping.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK_VALUE(slots[t] >= 0 && slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t],
                      " is outside the cache's ", num_slots, " slots");
  }
  auto write = [&](const at::Tensor& src, const at::Tensor& cache) {
    if (cache.scalar_type() != src.scalar_type()) return write_narrowed_rows(src, cache, slots, num_tokens);
    const auto* from = static_cast<const char*>(src.const_data_ptr());
    auto* to = static_cast<char*>(cache.data_ptr());
    const int64_t token_stride = src.stride(0) * src.element_size(), head_stride = src.stride(1) * src.element_size();
    const int64_t head_bytes = k_cache.size(3) * k_cache.element_size();
    for (int64_t t = 0; t < num_tokens; ++t) {
      char* dst = to + slots[t] * bytes;
      if (head_stride == head_bytes) {
        std::memcpy(dst, from + t * token_stride, bytes);
      } else {
        for (int64_t h = 0; h < k_cache.size(2); ++h)
          std::memcpy(dst + h * head_bytes, from + t * token_stride + h * head_stride, head_bytes);
      }
    }
  };
  write(k, k_cache);
  write(v, v_cache);
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (num_tokens < q.size(0)) out.narrow(0, num_tokens, q.size(0) - num_tokens).zero_();
  paged_attention_cpu(out, q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, sliding_window,
                      logit_softcap);
  return out;
}

}  // namespace

TORCH_LIBRARY(hpi_kernels, m) {
  m.def(
      "paged_attention_cpu(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor query_start_loc, Tensor context_lens, float scale, int sliding_window=0, float logit_softcap=0.0) -> ()");
  m.def(
      "cached_paged_attention_cpu(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, Tensor block_tables, Tensor query_start_loc, Tensor context_lens, float scale, "
      "int sliding_window=0, float logit_softcap=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(hpi_kernels, CPU, m) {
  m.impl("paged_attention_cpu", &paged_attention_cpu);
  m.impl("cached_paged_attention_cpu", &cached_paged_attention_cpu);
}

// Fake/meta tensors (torch.compile tracing): paged_attention_cpu only writes `out`; the cached variant
// returns a tensor of q's shape (empty_like keeps symbolic sizes).
TORCH_LIBRARY_IMPL(hpi_kernels, Meta, m) {
  m.impl("paged_attention_cpu", [](const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, double) {});
  m.impl("cached_paged_attention_cpu",
         [](const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t,
            double) { return at::empty_like(q); });
}
