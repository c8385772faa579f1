// What paged_attention.cpp (the op, its vector tiles) and paged_attention_amx.cpp (a prefill tile on AMX) share:
// one call's problem and its work items.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

namespace hpi_attention {

template <typename T, typename C>
struct Problem {
  T* out;                          // [num_tokens, num_heads, head_dim] contiguous
  const T* q;                      // [num_tokens, num_heads, head_dim], last dim contiguous
  const C* k_cache;                // [num_blocks, block_size, num_kv_heads, head_dim] contiguous
  const C* v_cache;                // [num_blocks, block_size, num_kv_heads, head_dim] contiguous
  const int32_t* block_tables;     // [num_reqs, max_blocks], row stride block_table_stride
  const int32_t* query_start_loc;  // [num_reqs + 1]
  const int32_t* context_lens;     // [num_reqs]
  int64_t q_token_stride;          // elements between tokens of q
  int64_t q_head_stride;           // elements between heads of q
  int64_t block_table_stride;      // elements between rows of block_tables
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t group_size;  // q heads per kv head
  int64_t block_size;
  int64_t num_blocks;
  float scale;
  int64_t sliding_window;  // 0: none
  float logit_softcap;     // 0: none
  bool amx_prefill = false;  // prefill/extend items run on AMX tiles (amx_prefill_applies, settled per call)

  int64_t cache_token_stride() const { return num_kv_heads * head_dim; }

  // Keys (or values) of the kv head at cache block block_table[req][b]: row j at + j * cache_token_stride().
  const C* block_rows(const C* cache, int64_t req, int64_t b, int64_t kv_head) const {
    const int64_t block = block_tables[req * block_table_stride + b];
    TORCH_CHECK_VALUE(block >= 0 && block < num_blocks, "block_tables[", req, "][", b, "] = ", block,
                      " is outside the cache's ", num_blocks, " blocks");
    return cache + (block * block_size * num_kv_heads + kv_head) * head_dim;
  }
};

struct WorkItem {
  int64_t cost;  // ~ keys x rows, for longest-first ordering
  int32_t req;
  int32_t kv_head;
  int32_t first;  // decode: first q head within the kv head's group; tile: first row
  int32_t count;  // decode: q heads; tile: rows (row = token * group_size + q head within the group)
  bool decode;
};

// A prefill/extend item's rows and keys: its request's first q row and cached prefix, the first row's position, and
// the keys it attends, [first_key, kv_end): causal up to its last row, from the first row's window (if any).
struct TileSpan {
  int64_t q_start, prefix_len, first_pos, kv_end, first_key;
};

template <typename T, typename C>
TileSpan tile_span(const Problem<T, C>& p, const WorkItem& w) {
  const int64_t q_start = p.query_start_loc[w.req];
  const int64_t prefix_len = p.context_lens[w.req] - (p.query_start_loc[w.req + 1] - q_start);
  const int64_t first_pos = prefix_len + w.first / p.group_size;
  const int64_t kv_end = prefix_len + (w.first + w.count - 1) / p.group_size + 1;
  const int64_t W = p.sliding_window;
  return {q_start, prefix_len, first_pos, kv_end, W > 0 ? std::max<int64_t>(0, first_pos - W + 1) : 0};
}

// The most rows an AMX prefill item holds: four row tiles, which share each chunk's keys and values, as many rows as
// paged_attention.cpp's items have with AVX512. (Tried, not kept: items of eight, 1.04x faster on a 4,096-token
// prompt and 1.07x slower at 512 and 2,048 tokens, the fewer items less evenly shared by the threads.)
constexpr int64_t kAmxPrefillRows = 64;

// Whether one call's prefill/extend items run on AMX tiles: a bf16 model, head_dim a multiple of 32 up to 256, no
// soft-cap, and the AMX tile chosen (prefill_attention_tile) on a CPU that has it. Settled once per call, so that
// the items planned for it are the items run.
bool amx_prefill_applies(bool bf16, int64_t head_dim, double logit_softcap);

// A prefill/extend item of a bf16 model over a bf16 or fp8 cache (C: c10::BFloat16, Float8_e4m3fn or Float8_e5m2)
// on AMX tiles (paged_attention_amx.cpp), for calls where amx_prefill_applies; up to kAmxPrefillRows rows.
template <typename C>
void amx_prefill_item(const Problem<c10::BFloat16, C>& p, const WorkItem& w);

}  // namespace hpi_attention
