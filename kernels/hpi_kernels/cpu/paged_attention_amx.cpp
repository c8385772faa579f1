// Prefill/extend attention on AMX tiles: a bf16 model's (token, q head) rows of one kv head against a bf16 or fp8
// cache (fp8 keys and values widened to bf16, exactly, as they are read),
// the item paged_attention.cpp's vector tile_item would otherwise run with fp32 FMAs. On a CPU with AMX that tile
// reached the FMA units' peak and still left a 2,048-token prompt's attention at 67% of its prefill (bench/results/
// attention_cpu.md, "Prefill on AMX tiles").
//
// Per item (up to 64 rows: four row tiles of 16, which share each chunk's keys and V^T) and chunk of 32 keys:
//   - the scores transposed, S^T [keys x rows] = K Q^T: the chunk's keys are A tiles as they are (16 keys x 32 dims,
//     read in place where 16 keys share a block, else copied); Q^T is packed once per item into B tiles (pairs of
//     dims x rows). The rows sit in the lanes of the result, as in tile_item, so the online softmax needs no
//     horizontal reductions;
//   - the probabilities rounded to bf16 (as GPU flash attention rounds P) and paired by key into B tiles;
//   - O^T [dims x rows] += V^T P^T: V^T as A tiles (keys paired, dims transposed into rows), the products added to
//     the fp32 accumulator after it is rescaled by the softmax's correction, in tile_item's [dims x rows] layout.
// Scores, softmax and output are fp32; q and k are multiplied exactly (bf16 products, fp32 sums) and scaled after.
// Keys past the chunk's end are zeros (K and V alike: a zero probability times a stale value could be NaN).
//
// Used where the CPU has AMX-BF16 and hpi_kernels::prefill_attention_tile is "amx" (its default there), for head
// dims that are multiples of 32 up to 256, without a logit soft-cap (Gemma 2 keeps the vector tile).

#include "cpu_vec.h"
#include "packed_linear.h"
#include "paged_attention.h"

#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

namespace hpi_attention {

namespace {

std::atomic<int> g_choice{0};  // 0: not settled, 1: amx, 2: vector

int parse_choice(const std::string& choice) {
  TORCH_CHECK_VALUE(choice == "amx" || choice == "vector", "prefill_attention_tile must be amx or vector, got '",
                    choice, "'");
  TORCH_CHECK_VALUE(choice == "vector" || hpi_packed::amx_available(),
                    "prefill_attention_tile: this CPU (or build) has no AMX-BF16 tiles");
  return choice == "amx" ? 1 : 2;
}

// HPI_CPU_ATTENTION_TILE=amx|vector, else amx where the CPU has it.
int default_choice() {
  const char* env = std::getenv("HPI_CPU_ATTENTION_TILE");
  if (env != nullptr && *env != '\0') return parse_choice(env);
  return hpi_packed::amx_available() ? 1 : 2;
}

bool use_amx() {
  int choice = g_choice.load(std::memory_order_relaxed);
  if (choice == 0) {
    choice = default_choice();
    g_choice.store(choice);
  }
  return choice == 1;
}

// "" reads the choice; "amx" or "vector" sets it ("amx" only where the CPU has AMX-BF16).
std::string prefill_attention_tile(const std::string& choice) {
  if (!choice.empty()) g_choice.store(parse_choice(choice));
  return use_amx() ? "amx" : "vector";
}

#if defined(CPU_CAPABILITY_AVX512)

using BF16 = c10::BFloat16;
using Vec = at::vec::Vectorized<float>;
static_assert(Vec::size() == 16, "the AVX512 build: a vector is one row tile's 16 rows");

constexpr int64_t kRows = 16;          // rows per row tile (and keys per score tile, dims per output tile)
constexpr int64_t kMaxRowTiles = kAmxPrefillRows / 16;  // row tiles per item
constexpr int64_t kChunk = 32;         // keys per chunk: two score tiles, one k step of the P V^T product
constexpr int64_t kMaxDim = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// r[i] holds row i of a 16 x 16 matrix of 32-bit lanes; afterwards r[i] holds column i.
inline void transpose16x16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_i32x4(u[i], u[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(u[i], u[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(u[i + 8], u[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(u[i + 8], u[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

// 16-bit lanes of a | b, interleaved: (a[i], b[i]) for i in [0, 16) (kPairsLo) and [16, 32) (kPairsHi).
alignas(64) constexpr uint16_t kPairsLo[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                               8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr uint16_t kPairsHi[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                               24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};

// A thread's buffers, sized for the largest head dim.
struct Buffers {
  alignas(64) BF16 qt[kMaxRowTiles][kMaxDim / 32][kRows * kRows * 2];  // Q^T B tiles: [pair of dims][row][2]
  alignas(64) BF16 keys[kChunk * kMaxDim];                              // the chunk's keys, [key][dim]
  alignas(64) BF16 vt[kMaxDim / kRows][kRows * kChunk];                 // V^T A tiles: [dim][key pair][2]
  alignas(64) BF16 pt[kMaxRowTiles][kRows * kRows * 2];                 // P^T B tiles: [key pair][row][2]
  alignas(64) float scores[kChunk * kMaxRowTiles * kRows];              // S^T: [key][row]
  alignas(64) float acc[kMaxDim * kMaxRowTiles * kRows];                // O^T: [dim][row]
  alignas(64) float product[4][kRows * kRows];                          // four V^T P^T tiles
};

// Row j of a cache block's kv head, for key position j of request `req`.
template <typename C>
inline const C* key_row(const Problem<BF16, C>& p, const C* cache, int64_t req, int64_t kv_head, int64_t j) {
  return p.block_rows(cache, req, j / p.block_size, kv_head) + (j % p.block_size) * p.cache_token_stride();
}

// 32 values of a cache row as bf16 pairs' lanes: a bf16 cache's as they are, an fp8 cache's widened (exactly: every
// fp8 value is a bf16 value).
template <typename C>
__attribute__((target("avx512bf16"))) inline __m512i load_bf16x32(const C* src) {
  if constexpr (std::is_same_v<C, BF16>) {
    return _mm512_loadu_si512(src);
  } else {
    return (__m512i)_mm512_cvtne2ps_pbh(hpi_vec::load_float(src + 16), hpi_vec::load_float(src));
  }
}

// V^T of keys [c0, c0 + n) as A tiles: tile g's row d (dim 16 g + d) holds the 32 keys' values of that dim in pairs
// (keys 2i, 2i + 1): the pairs of two value rows interleaved, then each 16 x 16 block of pairs transposed.
template <typename C>
__attribute__((target("avx512bw,avx512bf16"))) void pack_values(const Problem<BF16, C>& p, int64_t req,
                                                                int64_t kv_head, int64_t c0, int64_t n,
                                                                BF16 (*vt)[kRows * kChunk]) {
  const int64_t D = p.head_dim;
  const __m512i lo = _mm512_load_si512(kPairsLo), hi = _mm512_load_si512(kPairsHi);
  for (int64_t span = 0; span < D / 32; ++span) {  // 32 dims: two tiles
    __m512i first[16], second[16];
    for (int64_t i = 0; i < kChunk / 2; ++i) {
      const __m512i even = 2 * i < n ? load_bf16x32(key_row(p, p.v_cache, req, kv_head, c0 + 2 * i) + span * 32)
                                     : _mm512_setzero_si512();
      const __m512i odd = 2 * i + 1 < n ? load_bf16x32(key_row(p, p.v_cache, req, kv_head, c0 + 2 * i + 1) + span * 32)
                                        : _mm512_setzero_si512();
      first[i] = _mm512_permutex2var_epi16(even, lo, odd);   // dims 0..15 of the span, pair i
      second[i] = _mm512_permutex2var_epi16(even, hi, odd);  // dims 16..31
    }
    transpose16x16(first);
    transpose16x16(second);
    for (int64_t d = 0; d < kRows; ++d) {
      _mm512_store_si512(vt[2 * span] + d * kChunk, first[d]);
      _mm512_store_si512(vt[2 * span + 1] + d * kChunk, second[d]);
    }
  }
}

template <typename C>
__attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512bw"))) void run_item(const Problem<BF16, C>& p,
                                                                                const WorkItem& w, Buffers& b) {
  const int64_t D = p.head_dim, G = p.group_size, D2 = D / 2;
  const auto [q_start, prefix_len, first_pos, kv_end, first_key] = tile_span(p, w);
  const int64_t r0 = w.first, num_rows = w.count, row_tiles = (num_rows + kRows - 1) / kRows;
  const int64_t R = row_tiles * kRows;  // lanes of the [key][row] and [dim][row] buffers

  // Q^T: word (pair i of dims, row n) of row tile t, d-chunk c at qt[t][c][(i % 16) * 32 + n * 2].
  float pos[kMaxRowTiles * kRows];
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = r / kRows, n = r % kRows;
    auto* words = reinterpret_cast<uint32_t*>(b.qt[t][0]);
    constexpr int64_t kTileWords = kRows * kRows;
    if (r < num_rows) {
      const int64_t token = (r0 + r) / G, head = w.kv_head * G + (r0 + r) % G;
      const auto* src = reinterpret_cast<const uint32_t*>(p.q + (q_start + token) * p.q_token_stride +
                                                          head * p.q_head_stride);
      for (int64_t i = 0; i < D2; ++i) words[(i / kRows) * kTileWords + (i % kRows) * kRows + n] = src[i];
      pos[r] = static_cast<float>(prefix_len + token);
    } else {
      for (int64_t i = 0; i < D2; ++i) words[(i / kRows) * kTileWords + (i % kRows) * kRows + n] = 0;
      pos[r] = std::numeric_limits<float>::max();
    }
  }
  std::fill(b.acc, b.acc + D * R, 0.f);
  Vec row_max[kMaxRowTiles], row_sum[kMaxRowTiles], pos_v[kMaxRowTiles];
  for (int64_t t = 0; t < row_tiles; ++t) {
    row_max[t] = Vec(kNegInf);
    row_sum[t] = Vec(0.f);
    pos_v[t] = Vec::loadu(pos + t * kRows);
  }
  const int64_t W = p.sliding_window;
  const Vec scale(p.scale);
  const __m512i interleave = _mm512_load_si512(hpi_packed::kBf16PairInterleave);

  // O^T = O^T * alpha + V^T P^T of the chunk: four 16-dim tiles at a time, then added to the rescaled accumulator.
  // (Tried, not kept: a chunk's products after the next chunk's softmax, two buffers: 10% slower.)
  const auto products = [&](const Vec* alpha) {
    for (int64_t t = 0; t < row_tiles; ++t) {
      _tile_loadd(6, b.pt[t], 64);
      for (int64_t g0 = 0; g0 < D / kRows; g0 += 4) {
        const int64_t groups = std::min<int64_t>(4, D / kRows - g0);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(4, b.vt[g0], 64);
        _tile_dpbf16ps(0, 4, 6);
        if (groups > 1) {
          _tile_loadd(5, b.vt[g0 + 1], 64);
          _tile_dpbf16ps(1, 5, 6);
        }
        if (groups > 2) {
          _tile_loadd(4, b.vt[g0 + 2], 64);
          _tile_dpbf16ps(2, 4, 6);
        }
        if (groups > 3) {
          _tile_loadd(5, b.vt[g0 + 3], 64);
          _tile_dpbf16ps(3, 5, 6);
        }
        _tile_stored(0, b.product[0], kRows * sizeof(float));
        if (groups > 1) _tile_stored(1, b.product[1], kRows * sizeof(float));
        if (groups > 2) _tile_stored(2, b.product[2], kRows * sizeof(float));
        if (groups > 3) _tile_stored(3, b.product[3], kRows * sizeof(float));
        for (int64_t i = 0; i < groups; ++i) {
          for (int64_t d = 0; d < kRows; ++d) {
            float* a = b.acc + ((g0 + i) * kRows + d) * R + t * kRows;
            at::vec::fmadd(Vec::loadu(a), alpha[t], Vec::loadu(b.product[i] + d * kRows)).store(a);
          }
        }
      }
    }
  };
  hpi_packed::load_tile_config();  // tmm0-3: S^T or O^T; tmm4-5: A (keys or V^T); tmm6-7: B (Q^T or P^T)
  for (int64_t c0 = first_key; c0 < kv_end; c0 += kChunk) {
    const int64_t n = std::min(kChunk, kv_end - c0);
    // The keys' A tiles: read in place where each half is 16 rows of one block; else copied, zeros past n.
    const BF16* keys[2];
    int64_t key_stride = D;
    if (std::is_same_v<C, BF16> && n == kChunk && c0 % kRows == 0 && p.block_size % kRows == 0) {
      keys[0] = reinterpret_cast<const BF16*>(key_row(p, p.k_cache, w.req, w.kv_head, c0));
      keys[1] = reinterpret_cast<const BF16*>(key_row(p, p.k_cache, w.req, w.kv_head, c0 + kRows));
      key_stride = p.cache_token_stride();
    } else {  // copied (an fp8 cache's widened to bf16)
      for (int64_t j = 0; j < kChunk; ++j) {
        BF16* dst = b.keys + j * D;
        const C* src = j < n ? key_row(p, p.k_cache, w.req, w.kv_head, c0 + j) : nullptr;
        for (int64_t c = 0; c < D; c += 32) {
          _mm512_store_si512(dst + c, src != nullptr ? load_bf16x32(src + c) : _mm512_setzero_si512());
        }
      }
      keys[0] = b.keys;
      keys[1] = b.keys + kRows * D;
    }
    pack_values(p, w.req, w.kv_head, c0, n, b.vt);

    // S^T = K Q^T, each row tile's 16 lanes of the [key][row] scores: two row tiles at a time, four independent
    // accumulators (a tile stored right after its one product waits for it: 13% of the item's time).
    for (int64_t t = 0; t < row_tiles; t += 2) {
      const bool two = t + 1 < row_tiles;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t c = 0; c < D / 32; ++c) {
        _tile_loadd(4, keys[0] + c * 32, key_stride * sizeof(BF16));
        _tile_loadd(5, keys[1] + c * 32, key_stride * sizeof(BF16));
        _tile_loadd(6, b.qt[t][c], 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        if (two) {
          _tile_loadd(7, b.qt[t + 1][c], 64);
          _tile_dpbf16ps(2, 4, 7);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      _tile_stored(0, b.scores + t * kRows, R * sizeof(float));
      _tile_stored(1, b.scores + kRows * R + t * kRows, R * sizeof(float));
      if (two) {
        _tile_stored(2, b.scores + (t + 1) * kRows, R * sizeof(float));
        _tile_stored(3, b.scores + kRows * R + (t + 1) * kRows, R * sizeof(float));
      }
    }

    // Scale, mask (causal, the window, keys past the chunk's end) and the online softmax, per row tile.
    const bool window_cut = W > 0 && c0 + W <= kv_end - 1;
    const bool causal_cut = c0 + n - 1 > first_pos;  // the chunk reaches past some row's position
    Vec alpha[kMaxRowTiles];
    for (int64_t t = 0; t < row_tiles; ++t) {
      Vec block_max = row_max[t];
      for (int64_t j = 0; j < kChunk; ++j) {
        float* s = b.scores + j * R + t * kRows;
        Vec x(kNegInf);
        if (j < n) {
          x = Vec::loadu(s) * scale;
          if (causal_cut || window_cut) {
            Vec masked = Vec(static_cast<float>(c0 + j)) > pos_v[t];
            if (window_cut) masked = masked | (Vec(static_cast<float>(c0 + j + W)) <= pos_v[t]);
            x = Vec::blendv(x, Vec(kNegInf), masked);
          }
        }
        x.store(s);
        block_max = at::vec::maximum(block_max, x);
      }
      // A row that sees no key yet (a window's first chunks) keeps -inf; 0 is subtracted instead (exp(-inf) = 0).
      const Vec safe_max = Vec::blendv(block_max, Vec(0.f), block_max == Vec(kNegInf));
      alpha[t] = (row_max[t] - safe_max).exp_u20();
      row_max[t] = block_max;
      Vec sum(0.f);
      for (int64_t i = 0; i < kChunk / 2; ++i) {
        const Vec e0 = (Vec::loadu(b.scores + 2 * i * R + t * kRows) - safe_max).exp_u20();
        const Vec e1 = (Vec::loadu(b.scores + (2 * i + 1) * R + t * kRows) - safe_max).exp_u20();
        sum = sum + e0 + e1;
        const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);  // [16 of key 2i | 16 of key 2i + 1]
        _mm512_store_si512(b.pt[t] + i * kRows * 2, _mm512_permutexvar_epi16(interleave, pair));
      }
      row_sum[t] = row_sum[t] * alpha[t] + sum;
    }

    products(alpha);
  }
  _tile_release();

  float inv[kMaxRowTiles * kRows];
  for (int64_t t = 0; t < row_tiles; ++t) (Vec(1.f) / row_sum[t]).store(inv + t * kRows);
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t token = (r0 + r) / G, head = w.kv_head * G + (r0 + r) % G;
    BF16* dst = p.out + (q_start + token) * p.num_heads * D + head * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<BF16>(b.acc[d * R + r] * inv[r]);
  }
}

#endif  // CPU_CAPABILITY_AVX512

}  // namespace

bool amx_prefill_applies(bool bf16, int64_t head_dim, double logit_softcap) {
#if defined(CPU_CAPABILITY_AVX512)
  return bf16 && head_dim % 32 == 0 && head_dim <= kMaxDim && logit_softcap <= 0 && use_amx();
#else
  (void)bf16, (void)head_dim, (void)logit_softcap;
  return false;
#endif
}

template <typename C>
void amx_prefill_item(const Problem<c10::BFloat16, C>& p, const WorkItem& w) {
#if defined(CPU_CAPABILITY_AVX512)
  TORCH_CHECK(!w.decode && w.count <= kMaxRowTiles * kRows && p.head_dim % 32 == 0 && p.head_dim <= kMaxDim,
              "amx_prefill_item: an item the AMX tile does not take (", w.count, " rows, head_dim ", p.head_dim, ")");
  static thread_local std::unique_ptr<Buffers> buffers;
  if (!buffers) buffers = std::make_unique<Buffers>();
  run_item(p, w, *buffers);
#else
  TORCH_CHECK(false, "amx_prefill_item: this build has no AMX tiles");
  (void)p, (void)w;
#endif
}

template void amx_prefill_item(const Problem<c10::BFloat16, c10::BFloat16>&, const WorkItem&);
template void amx_prefill_item(const Problem<c10::BFloat16, c10::Float8_e4m3fn>&, const WorkItem&);
template void amx_prefill_item(const Problem<c10::BFloat16, c10::Float8_e5m2>&, const WorkItem&);

}  // namespace hpi_attention

TORCH_LIBRARY_FRAGMENT(hpi_kernels, m) {
  m.def("prefill_attention_tile(str choice='') -> str", &hpi_attention::prefill_attention_tile);
}
