// The packed bf16 linear on AMX tiles (CPUs with AMX-BF16: Intel Xeon from Sapphire Rapids on), the third tile
// packed_linear_bf16.cpp can choose at start.
//
// The packed bf16 layout [panels, pairs, 32, 2] (packed_linear.h) is already the layout an AMX B tile reads: a tile
// row is 16 columns' pairs of one k pair (64 bytes), a panel row holds 32 columns' (128 bytes), so 16 pairs of k of
// a panel are two B tiles loaded with a 128-byte stride, without repacking. Per panel and block of 32 rows of x:
// four fp32 C tiles (two blocks of 16 rows x the panel's two halves), and per 32 k two A tiles (x's rows as they
// are, bf16) and two B tiles for four tdpbf16ps. A last block of fewer than 16 rows reads a copy in a whole tile. The
// sums are fp32 per C tile; the bias joins them and they are rounded to bf16 once (or returned unrounded for
// logits). A row's result depends on its own x only, so it does not change with the rows beside it.
//
// Without AMX, torch's bf16 GEMMs are oneDNN's over the plain weight, which it reorders for its tiles on every call:
// at 1-64 rows that reorder is most of the time (the linears of SmolLM2-135M: 16.6 ms at one row and 19.0 at 32
// with it, 6.8 and 10.1 here, 7.6 and 21.4 with the widen tile; bench/results/amx.md).
//
// The int8 and int4 panels (packed_linear_quant.cpp) run the same tiles, each panel dequantized into bf16 pairs of
// this layout in a thread-local scratch, one k step ahead of the tiles and once per call whatever the rows. int8
// codes become bf16 exactly and the channel scale multiplies the fp32 sums, so int8 differs from its vector tiles by
// summation order only; int4's (q - 8) * scale + zero is rounded to bf16 (to nearest even), as the prefill path's
// dequantized copy for oneDNN is. The weight streams at 1 or 0.5 bytes per value; the widening is the vector tiles'
// own, which they pay once per 12 (int8) or 4 (int4) rows. At one row the vector tiles stay faster (the served
// int8 model: 0.83-0.87x their tok/s at one client), from 8 rows on the AMX tiles are (1.7-1.8x at 32 clients;
// bench/results/quantization.md); one tile family serves every row count, so a row's result does not depend on
// its batch.
//
// Linux gives a process the AMX tile state only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM); each thread loads
// the tile configuration before its tiles and releases them after, since oneDNN on the same threads loads its own.

#include "packed_linear.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(CPU_CAPABILITY_AVX512)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace hpi_packed {

#if defined(CPU_CAPABILITY_AVX512)

namespace {

static_assert(kNr == 32, "a panel is two AMX B tiles of 16 columns");
constexpr int64_t kTileRows = 16;    // rows of x per A tile (and of the C tiles)
constexpr int64_t kTilePairs = 16;   // pairs of k per tile: an A tile row is 32 bf16, 64 bytes
constexpr int64_t kPanelRowBytes = kNr * 2 * 2;  // a panel's row of pairs: the B tiles' stride
constexpr int64_t kStepBytes = kTilePairs * kPanelRowBytes;  // a panel's pairs of one k step: two B tiles
// A quantized panel's fill prefetches the same lines of the panel this many ahead into L2, as it reads its own, and
// (int8) its own rows this many ahead into L1: the hardware prefetchers alone left one-row calls waiting on memory
// (int8, the 120 linears of the embedded model, 1 row: 70 us a call without, 54 with the L2 prefetch, 43-50 with
// both; 2 panels ahead measured better than 1 or 4. The vector tile: 32-40).
constexpr int64_t kPanelsAhead = 2;
constexpr int64_t kRowsAhead = 64;

struct alignas(64) TileConfig {  // ldtilecfg's 64-byte operand, palette 1
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

bool request_amx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  const bool tile = (edx >> 24) & 1u, bf16 = (edx >> 22) & 1u;
  // AVX512-BF16 (every AMX CPU has it): int4's rounding; HPI_CPU_AVX512_BF16=0 turns the AMX tiles off with it
  if (!tile || !bf16 || !hpi_packed::avx512_bf16()) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

// The panel's bias, widened: bf16 (the packed bf16 linear's, as x) or fp32 (the quantized linears'), ncols of kNr.
inline std::tuple<Vec, Vec> load_bias(const c10::BFloat16* bias, int64_t ncols) {
  using BVec = at::vec::Vectorized<c10::BFloat16>;
  return at::vec::convert_bfloat16_float(ncols == kNr ? BVec::loadu(bias) : BVec::loadu(bias, ncols));
}

inline std::tuple<Vec, Vec> load_bias(const float* bias, int64_t ncols) {
  if (ncols == kNr) return {Vec::loadu(bias), Vec::loadu(bias + kVecSize)};
  return {Vec::loadu(bias, std::min<int64_t>(ncols, kVecSize)),
          ncols > kVecSize ? Vec::loadu(bias + kVecSize, ncols - kVecSize) : Vec(0.f)};
}

// c[r, 0:ncols] = Out(sums[r] * scale + bias) for r < rows; sums [rows x kNr] fp32 (the panel's two C tiles side by
// side), scale the panel's kNr column factors (int8's channel scales, padded to whole panels) or nullptr for none.
// With `add` (bf16 out), c's own values join the fp32 sums before the one rounding: c[r] = bf16(c[r] + sums[r]).
template <typename Out, typename Bias>
inline void store_rows(const float* lo, const float* hi, int64_t rows, const float* scale, const Bias* bias, Out* c,
                       int64_t ldc, int64_t ncols, bool add) {
  Vec bias_lo(0.f), bias_hi(0.f), scale_lo(1.f), scale_hi(1.f);
  if (bias != nullptr) std::tie(bias_lo, bias_hi) = load_bias(bias, ncols);
  if (scale != nullptr) {
    scale_lo = Vec::loadu(scale);
    scale_hi = Vec::loadu(scale + kVecSize);
  }
  for (int64_t r = 0; r < rows; ++r) {
    Vec s_lo = at::vec::fmadd(Vec::loadu(lo + r * kVecSize), scale_lo, bias_lo);
    Vec s_hi = at::vec::fmadd(Vec::loadu(hi + r * kVecSize), scale_hi, bias_hi);
    Out* row = c + r * ldc;
    if constexpr (std::is_same_v<Out, c10::BFloat16>) {
      if (add) {
        const auto [c_lo, c_hi] = load_bias(row, ncols);  // the row's own values, widened
        s_lo = s_lo + c_lo;
        s_hi = s_hi + c_hi;
      }
    }
    if constexpr (std::is_same_v<Out, float>) {
      if (ncols == kNr) {
        s_lo.store(row);
        s_hi.store(row + kVecSize);
      } else {
        s_lo.store(row, std::min<int64_t>(ncols, kVecSize));
        if (ncols > kVecSize) s_hi.store(row + kVecSize, ncols - kVecSize);
      }
    } else {
      const auto rounded = at::vec::convert_float_bfloat16(s_lo, s_hi);
      if (ncols == kNr) {
        rounded.store(row);
      } else {
        rounded.store(row, ncols);
      }
    }
  }
}

using RowBlock = std::pair<const c10::BFloat16*, int64_t>;  // 16 rows of x: the first, and the row stride in bytes

// Where the tiles read a panel's bf16 pairs, per k step of kTilePairs pairs (kStepBytes): panel(p) gives panel p's
// first, and fill(p, s, step) writes step s at `step` before the tiles of the first block of rows read it (a no-op
// for the packed bf16 weight, whose panels are already pairs). The quantized panels are dequantized into the
// thread's scratch step by step: step s + 1 right after the tiles of step s are loaded (the loads, older than its
// stores, need not wait for them), so that the widening overlaps the products of step s. With more than two blocks
// of rows the steps fill a whole panel, which the later blocks read from L2; with one or two (decode steps), two
// alternating steps that stay in L1.
struct Bf16Source {
  static constexpr bool kDequantizes = false;
  const c10::BFloat16* packed;
  int64_t panel_size;  // elements
  const c10::BFloat16* panel(int64_t p) const { return packed + p * panel_size; }
  void fill(int64_t, int64_t, char*) const {}
};

// The thread's scratch panel of K / 2 pairs x kNr columns x 2 bf16.
c10::BFloat16* scratch_panel(int64_t K) {
  static thread_local std::vector<c10::BFloat16> panel;
  if (panel.size() < static_cast<size_t>(K * kNr)) panel.resize(static_cast<size_t>(K * kNr));
  return panel.data();
}

// int8 [panels, K, kNr] codes: codes k and k + 1 of 16 columns as bf16 pairs (int8_bf16_pairs, exact). The
// channel scales multiply the sums (Panels::scales).
struct Int8Source {
  static constexpr bool kDequantizes = true;
  const int8_t* packed;
  int64_t K, panels;
  c10::BFloat16* panel(int64_t) const { return scratch_panel(K); }
  void fill(int64_t p, int64_t s, char* step) const {
    const int8_t* codes = packed + p * K * kNr;
    const int8_t* ahead = p + kPanelsAhead < panels ? codes + kPanelsAhead * K * kNr : nullptr;
    auto* dst = reinterpret_cast<c10::BFloat16*>(step) - 2 * kTilePairs * s * kNr;  // indexed by k
    for (int64_t k = 2 * kTilePairs * s; k < 2 * kTilePairs * (s + 1); k += 2) {
      if (ahead != nullptr) __builtin_prefetch(ahead + k * kNr, 0, 2);  // a pair of rows: one line
      __builtin_prefetch(codes + (k + kRowsAhead) * kNr, 0, 3);  // past the panel's end: harmless, never faults
      for (int64_t v = 0; v < kNr / kVecSize; ++v) {
        _mm512_storeu_si512(dst + (k * kNr + v * kVecSize * 2),
                            int8_bf16_pairs(codes + k * kNr + v * kVecSize, codes + (k + 1) * kNr + v * kVecSize));
      }
    }
  }
};

// int4 (Int4Words of packed_linear_quant.cpp: [panels, K / 8, kNr] words, a word's 16-bit halves holding 4 codes
// of even and of odd k, and [panels, K / group_size, kNr] (scale, zero) bf16 pairs): (q - 8) * scale + zero, vpermw
// looking up q - 8 of a word's low nibbles as bf16 pairs, each pair's halves widened to fp32 for the group's FMAs,
// and vcvtne2ps2bf16 rounding them (to nearest even) back into pairs, reordered by one vpermw.
struct Int4Source {
  static constexpr bool kDequantizes = true;
  const int32_t* packed;
  const int32_t* scales_zeros;
  int64_t group_size, K, panels;
  c10::BFloat16* panel(int64_t) const { return scratch_panel(K); }
  __attribute__((target("avx512bf16"))) void fill(int64_t p, int64_t s, char* step) const {
    const __m512i codes = _mm512_load_si512(kInt4Bf16Codes), interleave = _mm512_load_si512(kBf16PairInterleave);
    const __m512i high = _mm512_set1_epi32(static_cast<int32_t>(0xffff0000u));
    const int32_t* words = packed + p * (K / 8) * kNr;
    const int32_t* ahead = p + kPanelsAhead < panels ? words + kPanelsAhead * (K / 8) * kNr : nullptr;
    const int32_t* pairs = scales_zeros + p * (K / group_size) * kNr;
    auto* dst = reinterpret_cast<c10::BFloat16*>(step) - 2 * kTilePairs * s * kNr;  // indexed by pairs of k
    for (int64_t k8 = kTilePairs / 4 * s; k8 < kTilePairs / 4 * (s + 1); ++k8) {
      if (ahead != nullptr) {  // a row of words: two lines
        __builtin_prefetch(ahead + k8 * kNr, 0, 2);
        __builtin_prefetch(ahead + k8 * kNr + kVecSize, 0, 2);
      }
      const int64_t g = 8 * k8 / group_size;
      for (int64_t v = 0; v < kNr / kVecSize; ++v) {
        const __m512i lanes = _mm512_loadu_si512(pairs + g * kNr + v * kVecSize);
        const __m512 scale = _mm512_castsi512_ps(_mm512_slli_epi32(lanes, 16));
        const __m512 zero = _mm512_castsi512_ps(_mm512_and_si512(lanes, high));
        __m512i word = _mm512_loadu_si512(words + k8 * kNr + v * kVecSize);
        for (int64_t i = 0; i < 4; ++i) {
          const __m512i q = _mm512_permutexvar_epi16(word, codes);
          word = _mm512_srli_epi16(word, 4);
          const __m512 even = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(q, 16)), scale, zero);
          const __m512 odd = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(q, high)), scale, zero);
          const __m512i rounded = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // [even | odd]
          _mm512_storeu_si512(dst + ((4 * k8 + i) * kNr + v * kVecSize) * 2,
                              _mm512_permutexvar_epi16(interleave, rounded));
        }
      }
    }
  }
};

// A GEMM's weight: its panels' source, scales (kNr column factors per panel: int8's channel scales) or nullptr,
// and bias [N] or nullptr.
template <typename Source, typename Bias>
struct Panels {
  Source source;
  const float* scales;
  const Bias* bias;
};

// Panels [p0, p1) of out [M, N] = a [M, K] @ the panels, x in `num_blocks` blocks of 16 rows (the last one maybe a
// copy in a whole tile).
template <typename Out, typename Source, typename Bias>
__attribute__((target("amx-tile,amx-bf16"))) void panels_amx(const RowBlock* blocks, int64_t num_blocks,
                                                             const Panels<Source, Bias>& w, int64_t M, int64_t pairs,
                                                             int64_t N, Out* out, int64_t p0, int64_t p1, bool add) {
  load_tile_config();
  alignas(64) float sums[4][kTileRows * kVecSize];
  const int64_t k_steps = pairs / kTilePairs;
  // Step s of the panel: where the tiles read it; a ring of two steps in the scratch for one or two blocks of rows.
  const bool ring = Source::kDequantizes && num_blocks <= 2;
  for (int64_t p = p0; p < p1; ++p) {
    char* panel = const_cast<char*>(reinterpret_cast<const char*>(w.source.panel(p)));
    auto step = [&](int64_t s) { return panel + (ring ? s % 2 : s) * kStepBytes; };
    const int64_t ncols = std::min(kNr, N - p * kNr);
    const float* scale = w.scales != nullptr ? w.scales + p * kNr : nullptr;
    const Bias* bias = w.bias != nullptr ? w.bias + p * kNr : nullptr;
    for (int64_t b = 0; b < num_blocks; b += 2) {
      const bool two = b + 1 < num_blocks, fill = Source::kDequantizes && b == 0;
      const char* a0 = reinterpret_cast<const char*>(blocks[b].first);
      const char* a1 = two ? reinterpret_cast<const char*>(blocks[b + 1].first) : nullptr;
      const int64_t lda0 = blocks[b].second, lda1 = two ? blocks[b + 1].second : 0;
      if (fill) w.source.fill(p, 0, step(0));
      _tile_zero(0);
      _tile_zero(1);
      if (two) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < k_steps; ++s) {
          const char* wk = step(s);
          _tile_loadd(6, wk, kPanelRowBytes);
          _tile_loadd(7, wk + 64, kPanelRowBytes);
          _tile_loadd(4, a0 + s * 64, lda0);
          _tile_loadd(5, a1 + s * 64, lda1);
          if (fill && s + 1 < k_steps) w.source.fill(p, s + 1, step(s + 1));
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(2, sums[2], kVecSize * 4);
        _tile_stored(3, sums[3], kVecSize * 4);
      } else {
        for (int64_t s = 0; s < k_steps; ++s) {
          const char* wk = step(s);
          _tile_loadd(6, wk, kPanelRowBytes);
          _tile_loadd(7, wk + 64, kPanelRowBytes);
          _tile_loadd(4, a0 + s * 64, lda0);
          if (fill && s + 1 < k_steps) w.source.fill(p, s + 1, step(s + 1));
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
        }
      }
      _tile_stored(0, sums[0], kVecSize * 4);
      _tile_stored(1, sums[1], kVecSize * 4);
      const int64_t m = b * kTileRows;
      store_rows(sums[0], sums[1], std::min(kTileRows, M - m), scale, bias, out + m * N + p * kNr, N, ncols, add);
      if (two) {
        store_rows(sums[2], sums[3], std::min(kTileRows, M - m - kTileRows), scale, bias,
                   out + (m + kTileRows) * N + p * kNr, N, ncols, add);
      }
    }
  }
  _tile_release();
}

template <typename Out, typename Source, typename Bias>
void gemm_amx(const c10::BFloat16* a, int64_t lda, const Panels<Source, Bias>& w, int64_t M, int64_t K, int64_t N,
              Out* out, bool add = false) {
  TORCH_CHECK(amx_fits(K), "the AMX tile needs in_features a multiple of 32 and a CPU with AMX, got ", K);
  const int64_t pairs = K / 2, n_panels = (N + kNr - 1) / kNr, whole = M / kTileRows;
  // The last rows, fewer than 16, copied into a whole A tile: the rows past them hold zeros or an earlier call's x
  // (a C row depends on its own A row only, and those rows' sums are never stored). Reused: a one-row decode step
  // makes ~120 such copies.
  static thread_local std::vector<c10::BFloat16> tail;
  std::vector<RowBlock> blocks;
  for (int64_t b = 0; b < whole; ++b) blocks.emplace_back(a + b * kTileRows * lda, lda * 2);
  if (const int64_t rest = M - whole * kTileRows; rest > 0) {
    if (tail.size() < static_cast<size_t>(kTileRows * K)) tail.resize(static_cast<size_t>(kTileRows * K));
    for (int64_t r = 0; r < rest; ++r) std::copy_n(a + (whole * kTileRows + r) * lda, K, tail.data() + r * K);
    blocks.emplace_back(tail.data(), K * 2);
  }
  // Chunks of kMc rows (x's chunk stays in L2 while the panels stream past), the panels split between threads.
  const int64_t num_blocks = static_cast<int64_t>(blocks.size()), blocks_per_chunk = kMc / kTileRows;
  for (int64_t b0 = 0; b0 < num_blocks; b0 += blocks_per_chunk) {
    const int64_t count = std::min(blocks_per_chunk, num_blocks - b0), m0 = b0 * kTileRows;
    at::parallel_for(0, n_panels, 1, [&](int64_t p0, int64_t p1) {
      panels_amx<Out>(blocks.data() + b0, count, w, M - m0, pairs, N, out + m0 * N, p0, p1, add);
    });
  }
}

}  // namespace

// Every tile 16 rows of 64 bytes (palette 1): what this file's tiles and the attention's AMX tile
// (paged_attention_amx.cpp) use. A constant in memory: GCC dropped the stores into a local config before
// ldtilecfg read it once the function was no longer inlined (its builtin is not known to read all 64 bytes).
constexpr TileConfig tile_config() {
  TileConfig config{};
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {  // tmm0-3 C [16 x 16 fp32], tmm4-5 A [16 x 32 bf16], tmm6-7 B [16 pairs x 16 cols]
    config.rows[t] = kTileRows;
    config.colsb[t] = 64;
  }
  return config;
}

__attribute__((target("amx-tile"))) void load_tile_config() {
  alignas(64) static constexpr TileConfig kConfig = tile_config();
  _tile_loadconfig(&kConfig);
}

bool amx_available() {
  static const bool available = request_amx();
  return available;
}

bool amx_fits(int64_t K) { return K % (2 * kTilePairs) == 0 && amx_available(); }

void gemm_bf16_amx(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* packed, const c10::BFloat16* bias,
                   int64_t M, int64_t K, int64_t N, c10::BFloat16* out) {
  gemm_amx(a, lda, Panels<Bf16Source, c10::BFloat16>{{packed, K * kNr}, nullptr, bias}, M, K, N, out);
}

void gemm_bf16_amx(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* packed, const c10::BFloat16* bias,
                   int64_t M, int64_t K, int64_t N, float* out) {
  gemm_amx(a, lda, Panels<Bf16Source, c10::BFloat16>{{packed, K * kNr}, nullptr, bias}, M, K, N, out);
}

void gemm_bf16_amx_add(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* packed, int64_t M, int64_t K,
                       int64_t N, c10::BFloat16* out) {
  gemm_amx(a, lda, Panels<Bf16Source, c10::BFloat16>{{packed, K * kNr}, nullptr, nullptr}, M, K, N, out, true);
}

void gemm_int8_amx(const c10::BFloat16* a, int64_t lda, const int8_t* packed, const float* scales, const float* bias,
                   int64_t M, int64_t K, int64_t N, c10::BFloat16* out) {
  gemm_amx(a, lda, Panels<Int8Source, float>{{packed, K, (N + kNr - 1) / kNr}, scales, bias}, M, K, N, out);
}

void gemm_int8_amx(const c10::BFloat16* a, int64_t lda, const int8_t* packed, const float* scales, const float* bias,
                   int64_t M, int64_t K, int64_t N, float* out) {
  gemm_amx(a, lda, Panels<Int8Source, float>{{packed, K, (N + kNr - 1) / kNr}, scales, bias}, M, K, N, out);
}

void gemm_int4_amx(const c10::BFloat16* a, int64_t lda, const int32_t* packed, const int32_t* scales_zeros,
                   int64_t group_size, const float* bias, int64_t M, int64_t K, int64_t N, c10::BFloat16* out) {
  const Int4Source source{packed, scales_zeros, group_size, K, (N + kNr - 1) / kNr};
  gemm_amx(a, lda, Panels<Int4Source, float>{source, nullptr, bias}, M, K, N, out);
}

#else  // AVX2 and generic builds: no AMX

bool amx_available() { return false; }

bool amx_fits(int64_t) { return false; }

void gemm_bf16_amx(const c10::BFloat16*, int64_t, const c10::BFloat16*, const c10::BFloat16*, int64_t, int64_t,
                   int64_t, c10::BFloat16*) {
  TORCH_CHECK(false, "the AMX tile needs the AVX512 build of the kernels");
}

void gemm_bf16_amx(const c10::BFloat16*, int64_t, const c10::BFloat16*, const c10::BFloat16*, int64_t, int64_t,
                   int64_t, float*) {
  TORCH_CHECK(false, "the AMX tile needs the AVX512 build of the kernels");
}

void gemm_bf16_amx_add(const c10::BFloat16*, int64_t, const c10::BFloat16*, int64_t, int64_t, int64_t,
                       c10::BFloat16*) {
  TORCH_CHECK(false, "the AMX tile needs the AVX512 build of the kernels");
}

void gemm_int8_amx(const c10::BFloat16*, int64_t, const int8_t*, const float*, const float*, int64_t, int64_t, int64_t,
                   c10::BFloat16*) {
  TORCH_CHECK(false, "the AMX tile needs the AVX512 build of the kernels");
}

void gemm_int8_amx(const c10::BFloat16*, int64_t, const int8_t*, const float*, const float*, int64_t, int64_t, int64_t,
                   float*) {
  TORCH_CHECK(false, "the AMX tile needs the AVX512 build of the kernels");
}

void gemm_int4_amx(const c10::BFloat16*, int64_t, const int32_t*, const int32_t*, int64_t, const float*, int64_t,
                   int64_t, int64_t, c10::BFloat16*) {
  TORCH_CHECK(false, "the AMX tile needs the AVX512 build of the kernels");
}

#endif

}  // namespace hpi_packed
