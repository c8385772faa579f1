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
  if (!tile || !bf16) return false;
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

__attribute__((target("amx-tile"))) void load_tile_config() {
  TileConfig config;
  std::memset(&config, 0, sizeof(config));
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {  // tmm0-3 C [16 x 16 fp32], tmm4-5 A [16 x 32 bf16], tmm6-7 B [16 pairs x 16 cols]
    config.rows[t] = kTileRows;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// c[r, 0:ncols] = Out(sums[r] + bias) for r < rows; sums [rows x kNr] fp32 (the panel's two C tiles side by side).
template <typename Out>
inline void store_rows(const float* lo, const float* hi, int64_t rows, const c10::BFloat16* bias, Out* c,
                       int64_t ldc, int64_t ncols) {
  using BVec = at::vec::Vectorized<c10::BFloat16>;
  Vec bias_lo(0.f), bias_hi(0.f);
  if (bias != nullptr) {
    std::tie(bias_lo, bias_hi) =
        at::vec::convert_bfloat16_float(ncols == kNr ? BVec::loadu(bias) : BVec::loadu(bias, ncols));
  }
  for (int64_t r = 0; r < rows; ++r) {
    const Vec s_lo = Vec::loadu(lo + r * kVecSize) + bias_lo, s_hi = Vec::loadu(hi + r * kVecSize) + bias_hi;
    Out* row = c + r * ldc;
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

// Panels [p0, p1) of out [M, N] = a [M, K] @ packed (+ bias), x in `num_blocks` blocks of 16 rows (the last one
// maybe a copy in a whole tile).
template <typename Out>
__attribute__((target("amx-tile,amx-bf16"))) void panels_amx(const RowBlock* blocks, int64_t num_blocks,
                                                             const c10::BFloat16* packed, const c10::BFloat16* bias,
                                                             int64_t M, int64_t pairs, int64_t N, Out* out, int64_t p0,
                                                             int64_t p1) {
  load_tile_config();
  alignas(64) float sums[4][kTileRows * kVecSize];
  const int64_t k_steps = pairs / kTilePairs;
  for (int64_t p = p0; p < p1; ++p) {
    const auto* panel = reinterpret_cast<const char*>(packed + p * pairs * kNr * 2);
    const int64_t ncols = std::min(kNr, N - p * kNr);
    for (int64_t b = 0; b < num_blocks; b += 2) {
      const bool two = b + 1 < num_blocks;
      const char* a0 = reinterpret_cast<const char*>(blocks[b].first);
      const char* a1 = two ? reinterpret_cast<const char*>(blocks[b + 1].first) : nullptr;
      const int64_t lda0 = blocks[b].second, lda1 = two ? blocks[b + 1].second : 0;
      _tile_zero(0);
      _tile_zero(1);
      if (two) {
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < k_steps; ++s) {
          const char* w = panel + s * kTilePairs * kPanelRowBytes;
          _tile_loadd(6, w, kPanelRowBytes);
          _tile_loadd(7, w + 64, kPanelRowBytes);
          _tile_loadd(4, a0 + s * 64, lda0);
          _tile_loadd(5, a1 + s * 64, lda1);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(2, sums[2], kVecSize * 4);
        _tile_stored(3, sums[3], kVecSize * 4);
      } else {
        for (int64_t s = 0; s < k_steps; ++s) {
          const char* w = panel + s * kTilePairs * kPanelRowBytes;
          _tile_loadd(6, w, kPanelRowBytes);
          _tile_loadd(7, w + 64, kPanelRowBytes);
          _tile_loadd(4, a0 + s * 64, lda0);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
        }
      }
      _tile_stored(0, sums[0], kVecSize * 4);
      _tile_stored(1, sums[1], kVecSize * 4);
      const c10::BFloat16* panel_bias = bias != nullptr ? bias + p * kNr : nullptr;
      const int64_t m = b * kTileRows;
      store_rows(sums[0], sums[1], std::min(kTileRows, M - m), panel_bias, out + m * N + p * kNr, N, ncols);
      if (two) {
        store_rows(sums[2], sums[3], std::min(kTileRows, M - m - kTileRows), panel_bias,
                   out + (m + kTileRows) * N + p * kNr, N, ncols);
      }
    }
  }
  _tile_release();
}

template <typename Out>
void gemm_amx(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* packed, const c10::BFloat16* bias, int64_t M,
              int64_t K, int64_t N, Out* out) {
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
      panels_amx<Out>(blocks.data() + b0, count, packed, bias, M - m0, pairs, N, out + m0 * N, p0, p1);
    });
  }
}

}  // namespace

bool amx_available() {
  static const bool available = request_amx();
  return available;
}

bool amx_fits(int64_t K) { return K % (2 * kTilePairs) == 0 && amx_available(); }

void gemm_bf16_amx(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* packed, const c10::BFloat16* bias,
                   int64_t M, int64_t K, int64_t N, c10::BFloat16* out) {
  gemm_amx(a, lda, packed, bias, M, K, N, out);
}

void gemm_bf16_amx(const c10::BFloat16* a, int64_t lda, const c10::BFloat16* packed, const c10::BFloat16* bias,
                   int64_t M, int64_t K, int64_t N, float* out) {
  gemm_amx(a, lda, packed, bias, M, K, N, out);
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

#endif

}  // namespace hpi_packed
