// A stage's decoder layers for decode-sized steps in one C++ call: hpi_kernels::DecodeStack.
//
// A one-request decode step of a small model spends as long around its weight reads as in them: each layer is a
// dozen ops (two RMSNorms, RoPE, the four linears, attention, SiLU x mul, two residual adds), and every one of
// them costs Python, Dynamo's and Inductor's wrapper code and a dispatch, whatever its size (~3 ms of a 7 ms int4
// step on SmolLM2-135M, bench/results/quant_llamacpp.md). Here the layers' weights are registered once, after
// loading and packing, and `forward` runs all of them per step: the linears through the ops the model itself
// calls (packed fp32/bf16 panels, int8 and int4 panels, or at::linear for weights left unpacked), attention
// through cached_paged_attention_cpu, the element-wise work in loops of its own.
//
// The layer is the models/decoder.py DecoderLayer with DecoderAttention and GatedMLP: Llama's pre-norm block, with
// what the other dense families set on it as parameters: Qwen3's per-head q/k norms, Gemma's sandwich norms,
// unit-offset norms, GELU gates and second RoPE table for sliding-window layers, sliding windows, soft-capped
// attention and partial rotation. The element-wise ops round where the eager model rounds (RMSNorm's
// output before the weight scales it, SiLU's before the multiply, each residual sum), so the result is the
// eager model's up to the order of RMSNorm's sum of squares. A linear with LoRA adapter slots adds each token's
// delta through hpi_kernels::lora_add_, as the model's LoRA hook does.

#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kVecSize = Vec::size();
constexpr int64_t kElementsPerTask = 16384;  // element-wise work below this many elements stays on one thread

using hpi_vec::load_float;

template <typename T>
inline T round_to(float x) {  // x in T (the rounding an eager op's output gets)
  return static_cast<T>(x);
}

// The linears' kinds: how the model's layer stores its weight, and the op that multiplies by it.
// kInt4A8, kInt8A8: W4A8, W8A8 (x quantized to int8 per group of k).
enum LinearKind : int64_t { kUnpacked = 0, kPacked = 1, kInt8 = 2, kInt4 = 3, kInt4A8 = 4, kInt8A8 = 5 };

struct Linear {
  int64_t kind = kUnpacked, out_features = 0, group_size = 0;
  int64_t a8_max_rows = -1;  // kInt4A8, kInt8A8: x in int8 up to this many rows, float x above (-1: at any count)
  at::Tensor weight, scales;  // scales: int8's per-channel scales, int4's (scale, zero) pairs; else undefined
  std::optional<at::Tensor> bias;
  // LoRA (runtime/hpi_runtime/lora/layers.py): the projection's adapter slots, A [S, W, in] and B transposed
  // [S, W, out], which slot loads rewrite in place, its parts' output columns, and the slots' AMX panels (or
  // none); undefined without adapters.
  at::Tensor lora_a, lora_bt;
  std::vector<int64_t> lora_part_cols;
  std::optional<at::Tensor> lora_amx;

  // y = x W^T (+ bias), plus each row's LoRA delta by its adapter slot (lora_slots: [rows] int64, -1 for the base
  // model; undefined or empty: no adapter in the step), as the model's linear and its LoRA hook compute it.
  at::Tensor operator()(const at::Tensor& x, const at::Tensor& lora_slots) const {
    at::Tensor y = base(x);
    if (lora_a.defined() && lora_slots.defined() && lora_slots.numel() > 0) {
      using LoRAOp = void(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, c10::IntArrayRef, const std::optional<at::Tensor>&);
      static const auto lora_add = c10::Dispatcher::singleton().findSchemaOrThrow("hpi_kernels::lora_add_", "")
                                       .typed<LoRAOp>();
      y = y.contiguous();
      lora_add.call(y, x.contiguous(), lora_a, lora_bt, lora_slots, lora_part_cols, lora_amx);
    }
    return y;
  }

  at::Tensor base(const at::Tensor& x) const {
    using Op3 = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&,
                           const std::optional<at::Tensor>&);
    using Op4 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                           const std::optional<at::Tensor>&);
    using Op5 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                           const std::optional<at::Tensor>&);
    using OpA8 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t,
                            const std::optional<at::Tensor>&, int64_t);
    static const auto packed = c10::Dispatcher::singleton().findSchemaOrThrow("hpi_kernels::packed_linear", "")
                                   .typed<Op3>();
    static const auto int8 = c10::Dispatcher::singleton().findSchemaOrThrow("hpi_kernels::int8_linear", "")
                                 .typed<Op4>();
    static const auto int4 = c10::Dispatcher::singleton().findSchemaOrThrow("hpi_kernels::int4_linear", "")
                                 .typed<Op5>();
    static const auto int4_a8 = c10::Dispatcher::singleton().findSchemaOrThrow("hpi_kernels::int4_a8_linear", "")
                                    .typed<OpA8>();
    using Op8A8 = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                             const std::optional<at::Tensor>&, int64_t);
    static const auto int8_a8 = c10::Dispatcher::singleton().findSchemaOrThrow("hpi_kernels::int8_a8_linear", "")
                                    .typed<Op8A8>();
    switch (kind) {
      case kPacked: return packed.call(x, weight, out_features, bias, std::nullopt);
      case kInt8: return int8.call(x, weight, scales, out_features, bias);
      case kInt4: return int4.call(x, weight, scales, group_size, out_features, bias);
      case kInt4A8: return int4_a8.call(x, weight, scales, group_size, out_features, bias, a8_max_rows);
      case kInt8A8: return int8_a8.call(x, weight, scales, out_features, bias, a8_max_rows);
      default: return at::linear(x, weight, bias);
    }
  }
};

// The gate's activation in GatedMLP (models/layers.py GATED_ACTIVATIONS).
enum Activation : int64_t { kSilu = 0, kGeluTanh = 1, kGelu = 2 };

struct Layer {
  at::Tensor input_norm, post_norm;  // [hidden] in the model's dtype (post_norm: post_attention_layernorm)
  at::Tensor pre_ff_norm, post_ff_norm;  // Gemma's sandwich norms around the MLP, or undefined
  Linear qkv, o, gate_up, down;
  at::Tensor k_cache, v_cache;  // [num_blocks, block_size, num_kv_heads, head_dim]
  at::Tensor q_norm, k_norm;    // [head_dim] per-head RMSNorm weights before RoPE (Qwen3), or undefined
  double scale = 1.0, logit_softcap = 0.0;
  int64_t sliding_window = 0;
  bool sliding_rope = false;  // RoPE from the stack's sliding-window table (Gemma 3's local layers)
};

// fn(begin, end) over rows 0..rows, on one thread unless the rows hold enough elements to split.
template <typename F>
inline void for_rows(int64_t rows, int64_t width, const F& fn) {
  const int64_t grain = std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(1, width));
  if (rows <= grain) {
    fn(0, rows);
  } else {
    at::parallel_for(0, rows, grain, fn);
  }
}

// out = RMSNorm(x) * w as models/layers.py's RMSNorm computes it: the sum of squares and the scaling in fp32,
// then (Llama) rounded to T before the weight scales it, or (Gemma, unit_offset) scaled by 1 + w in fp32.
template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t n, float eps, bool unit_offset) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kVecSize <= n; i += kVecSize) {
    const Vec v = load_float(x + i);
    acc = at::vec::fmadd(v, v, acc);
  }
  float sum = at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) sum += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  const float r = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) {
    const float normed = static_cast<float>(x[j]) * r;
    out[j] = unit_offset ? round_to<T>(normed * (1.f + static_cast<float>(w[j])))
                         : round_to<T>(static_cast<float>(w[j]) * static_cast<float>(round_to<T>(normed)));
  }
}

// hidden += delta (rounded to T, as an eager residual add), then normed = RMSNorm(hidden) when norm is given.
template <typename T>
void add_and_norm(T* hidden, const T* delta, const T* norm, T* normed, int64_t rows, int64_t n, float eps,
                  bool unit_offset) {
  for_rows(rows, n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* h = hidden + r * n;
      if (delta != nullptr) {
        const T* d = delta + r * n;
        for (int64_t j = 0; j < n; ++j) h[j] = round_to<T>(static_cast<float>(h[j]) + static_cast<float>(d[j]));
      }
      if (norm != nullptr) rms_norm_row(h, norm, normed + r * n, n, eps, unit_offset);
    }
  });
}

// q and k heads of each row of qkv rotated in place (rotate-half layout, fp32, the first `rotary` dims of a
// head), as models/rotary.py's apply_rotary does; cos/sin: [max_positions, rotary / 2] fp32 tables.
template <typename T>
void rotate(T* qkv, int64_t rows, int64_t row_stride, int64_t heads, int64_t head_dim, int64_t rotary,
            const int64_t* positions, const float* cos, const float* sin) {
  const int64_t half = rotary / 2;
  for_rows(rows, heads * head_dim, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* c = cos + positions[r] * half;
      const float* s = sin + positions[r] * half;
      for (int64_t h = 0; h < heads; ++h) {
        T* x = qkv + r * row_stride + h * head_dim;
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = static_cast<float>(x[j]), x2 = static_cast<float>(x[j + half]);
          x[j] = round_to<T>(x1 * c[j] - x2 * s[j]);
          x[j + half] = round_to<T>(x2 * c[j] + x1 * s[j]);
        }
      }
    }
  });
}

inline Vec activate(const Vec& x, int64_t activation) {
  switch (activation) {
    case kGeluTanh: {  // 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as torch's gelu(approximate="tanh")
      const Vec inner = Vec(0.7978845608028654f) * (x + Vec(0.044715f) * x * x * x);
      return Vec(0.5f) * x * (Vec(1.f) + inner.tanh());
    }
    case kGelu: return Vec(0.5f) * x * (Vec(1.f) + (x * Vec(0.7071067811865476f)).erf());
    default: return x / (Vec(1.f) + x.neg().exp());
  }
}

// out[r] = act(gate[r]) * up[r], gate_up[r] = [gate | up]; the activation's output rounded to T before the
// multiply, as the eager ops round it. Whole vectors of T (32 bf16 values with AVX512) go through at::vec's
// conversions, which round to nearest even as c10's scalar ones do; a row's tail, element by element.
template <typename T>
void gated_activation(const T* gate_up, T* out, int64_t rows, int64_t n, int64_t activation) {
  for_rows(rows, 2 * n, [&](int64_t r0, int64_t r1) {
    float gate[kVecSize], act[kVecSize];
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gate_up + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
      int64_t whole = 0;
      if constexpr (!std::is_same_v<T, float>) {
        using TVec = at::vec::Vectorized<T>;
        for (; whole + TVec::size() <= n; whole += TVec::size()) {
          const auto [g0, g1] = at::vec::convert_to_float<T>(TVec::loadu(g + whole));
          const auto [u0, u1] = at::vec::convert_to_float<T>(TVec::loadu(u + whole));
          const auto [a0, a1] = at::vec::convert_to_float<T>(
              at::vec::convert_from_float<T>(activate(g0, activation), activate(g1, activation)));
          at::vec::convert_from_float<T>(a0 * u0, a1 * u1).store(o + whole);
        }
      }
      for (int64_t j = whole; j < n; j += kVecSize) {
        const int64_t count = std::min<int64_t>(kVecSize, n - j);
        for (int64_t i = 0; i < count; ++i) gate[i] = static_cast<float>(g[j + i]);
        activate(Vec::loadu(gate, count), activation).store(act, count);
        for (int64_t i = 0; i < count; ++i) {
          o[j + i] = round_to<T>(static_cast<float>(round_to<T>(act[i])) * static_cast<float>(u[j + i]));
        }
      }
    }
  });
}

// Each row of x [rows, n] normed in place (Gemma's norms of the attention's and the MLP's outputs).
template <typename T>
void norm_rows(T* x, const T* weight, int64_t rows, int64_t n, float eps, bool unit_offset) {
  for_rows(rows, n, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) rms_norm_row(x + r * n, weight, x + r * n, n, eps, unit_offset);
  });
}

class DecodeStack : public torch::CustomClassHolder {
 public:
  // Shapes of this model's layers (this tensor-parallel rank's heads: all of them, since the stack serves one
  // rank only), its RMSNorm settings and RoPE tables ([max_positions, rotary_dim / 2] fp32).
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, bool unit_offset,
              at::Tensor cos, at::Tensor sin)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps),
        unit_offset_(unit_offset), cos_(std::move(cos)), sin_(std::move(sin)) {
    TORCH_CHECK_VALUE(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
                      "DecodeStack: bad head counts ", num_heads, " / ", num_kv_heads, " x ", head_dim);
    TORCH_CHECK_VALUE(cos_.dim() == 2 && cos_.sizes() == sin_.sizes() && cos_.scalar_type() == at::kFloat &&
                          cos_.is_contiguous() && sin_.is_contiguous() && 2 * cos_.size(1) <= head_dim &&
                          cos_.size(1) > 0,
                      "DecodeStack: cos and sin must be contiguous fp32 [max_positions, rotary_dim / 2] tables");
  }

  // The next linear of the layer being added, in the order qkv, o, gate_up, down: kind (LinearKind), its
  // weight as the model's layer holds it, int8 scales or int4 (scale, zero) pairs (an empty tensor for the
  // float kinds), the bias (an empty tensor for none), out_features, and int4's group size.
  void add_linear(int64_t kind, at::Tensor weight, at::Tensor scales, at::Tensor bias, int64_t out_features,
                  int64_t group_size) {
    TORCH_CHECK_VALUE(kind >= kUnpacked && kind <= kInt8A8, "DecodeStack: unknown linear kind ", kind);
    TORCH_CHECK_VALUE(pending_.size() < 4, "DecodeStack: a layer has four linears; call add_layer");
    Linear linear;
    linear.kind = kind;
    linear.weight = std::move(weight);
    linear.scales = std::move(scales);
    if (bias.numel() > 0) linear.bias = std::move(bias);
    linear.out_features = out_features;
    linear.group_size = group_size;
    pending_.push_back(std::move(linear));
  }

  // For the W4A8 or W8A8 linear (kInt4A8, kInt8A8) added last: x in int8 up to max_rows rows, the float tiles
  // above (-1: any count).
  void set_a8_max_rows(int64_t max_rows) {
    TORCH_CHECK_VALUE(!pending_.empty() && (pending_.back().kind == kInt4A8 || pending_.back().kind == kInt8A8),
                      "DecodeStack: set_a8_max_rows follows the add_linear of a W4A8 or W8A8 linear");
    TORCH_CHECK_VALUE(max_rows >= -1, "DecodeStack: max_rows must be -1 (any) or >= 0, got ", max_rows);
    pending_.back().a8_max_rows = max_rows;
  }

  // LoRA adapter slots for the linear added last (lora/layers.py's LoRAProjection): A [S, W, in], B transposed
  // [S, W, out] (held, not copied: slot loads write them in place), its parts' output columns from 0 to out, and
  // the slots' AMX panels (lora_pack_amx, also rewritten by slot loads) or None.
  void set_lora(at::Tensor a, at::Tensor bt, std::vector<int64_t> part_cols, std::optional<at::Tensor> amx) {
    TORCH_CHECK_VALUE(!pending_.empty(), "DecodeStack: set_lora follows the add_linear of its linear");
    Linear& linear = pending_.back();
    TORCH_CHECK_VALUE(a.dim() == 3 && bt.dim() == 3 && a.size(0) == bt.size(0) && a.size(1) == bt.size(1) &&
                          bt.size(2) == linear.out_features && a.is_contiguous() && bt.is_contiguous(),
                      "DecodeStack: LoRA slots must be contiguous A [S, W, in] and B transposed [S, W, ",
                      linear.out_features, "], got ", a.sizes(), " ", bt.sizes());
    linear.lora_a = std::move(a);
    linear.lora_bt = std::move(bt);
    linear.lora_part_cols = std::move(part_cols);
    linear.lora_amx = std::move(amx);
  }

  // A layer over the four linears added since the last one, with its input and post-attention norms' weights and
  // its KV cache. The set_* methods below add what some families have to the layer added last.
  void add_layer(at::Tensor input_norm, at::Tensor post_norm, at::Tensor k_cache, at::Tensor v_cache, double scale,
                 int64_t sliding_window, double logit_softcap) {
    TORCH_CHECK_VALUE(pending_.size() == 4, "DecodeStack: add_layer needs the layer's four linears, got ",
                      pending_.size());
    TORCH_CHECK_VALUE(input_norm.dim() == 1 && post_norm.sizes() == input_norm.sizes() && input_norm.is_contiguous() &&
                          post_norm.is_contiguous(),
                      "DecodeStack: norm weights must be contiguous [hidden] vectors");
    TORCH_CHECK_VALUE(k_cache.dim() == 4 && k_cache.size(2) == num_kv_heads_ && k_cache.size(3) == head_dim_,
                      "DecodeStack: the KV cache must be [blocks, block_size, ", num_kv_heads_, ", ", head_dim_,
                      "], got ", k_cache.sizes());
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    TORCH_CHECK_VALUE(pending_[0].out_features == q_size + 2 * kv_size && pending_[1].out_features ==
                          input_norm.size(0) && pending_[3].out_features == input_norm.size(0) &&
                          pending_[2].out_features % 2 == 0,
                      "DecodeStack: the linears' widths do not fit the layer's heads and hidden size");
    Layer layer;
    layer.input_norm = std::move(input_norm);
    layer.post_norm = std::move(post_norm);
    layer.qkv = std::move(pending_[0]);
    layer.o = std::move(pending_[1]);
    layer.gate_up = std::move(pending_[2]);
    layer.down = std::move(pending_[3]);
    layer.k_cache = std::move(k_cache);
    layer.v_cache = std::move(v_cache);
    layer.scale = scale;
    layer.sliding_window = sliding_window;
    layer.logit_softcap = logit_softcap;
    pending_.clear();
    layers_.push_back(std::move(layer));
  }

  // Qwen3: an RMSNorm over each q head and each k head before RoPE.
  void set_head_norms(at::Tensor q_norm, at::Tensor k_norm) {
    check_vector(q_norm, head_dim_, "q_norm");
    check_vector(k_norm, head_dim_, "k_norm");
    last_layer().q_norm = std::move(q_norm);
    last_layer().k_norm = std::move(k_norm);
  }

  // Gemma 2/3: the attention's output normed before the residual add (with the post-attention norm), the MLP's
  // input by pre_ff and its output by post_ff before theirs.
  void set_sandwich_norms(at::Tensor pre_ff, at::Tensor post_ff) {
    const int64_t n = last_layer().input_norm.size(0);
    check_vector(pre_ff, n, "pre_feedforward_layernorm");
    check_vector(post_ff, n, "post_feedforward_layernorm");
    last_layer().pre_ff_norm = std::move(pre_ff);
    last_layer().post_ff_norm = std::move(post_ff);
  }

  // Gemma 3: the RoPE table of the sliding-window layers (same shape as the global one), and the layers taking it.
  void set_sliding_rope(at::Tensor cos, at::Tensor sin) {
    TORCH_CHECK_VALUE(cos.sizes() == cos_.sizes() && sin.sizes() == sin_.sizes() && cos.scalar_type() == at::kFloat &&
                          sin.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
                      "DecodeStack: the sliding-window RoPE table must have the global one's shape, fp32");
    sliding_cos_ = std::move(cos);
    sliding_sin_ = std::move(sin);
  }
  void use_sliding_rope() {
    TORCH_CHECK_VALUE(sliding_cos_.defined(), "DecodeStack: set_sliding_rope first");
    last_layer().sliding_rope = true;
  }

  // The gate's activation of every layer's MLP (Activation; SiLU by default).
  void set_activation(int64_t activation) {
    TORCH_CHECK_VALUE(activation >= kSilu && activation <= kGelu, "DecodeStack: unknown activation ", activation);
    activation_ = activation;
  }

  // The final RMSNorm of the last pipeline stage, applied after the layers (none: the stage's raw output).
  void set_final_norm(at::Tensor weight) { final_norm_ = std::move(weight); }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [num_tokens, hidden] (the embeddings, or the previous stage's output) through every layer; the
  // attention inputs are the step's, as the model's attention op takes them; lora_slots: each token's LoRA adapter
  // slot ([num_tokens] int64, -1: the base model), or an empty tensor for none. Returns a new tensor.
  at::Tensor forward(at::Tensor hidden, at::Tensor positions, at::Tensor slot_mapping, at::Tensor block_tables,
                     at::Tensor query_start_loc, at::Tensor context_lens, at::Tensor lora_slots) {
    TORCH_CHECK_VALUE(!layers_.empty(), "DecodeStack: no layers added");
    const int64_t n = layers_[0].input_norm.size(0);
    TORCH_CHECK_VALUE(hidden.dim() == 2 && hidden.size(1) == n && hidden.device().is_cpu(),
                      "DecodeStack: hidden must be a CPU [num_tokens, ", n, "] tensor, got ", hidden.sizes());
    TORCH_CHECK_VALUE(hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16,
                      "DecodeStack runs fp32 or bf16 models, got ", hidden.scalar_type());
    TORCH_CHECK_VALUE(hidden.scalar_type() == layers_[0].input_norm.scalar_type(),
                      "DecodeStack: hidden's dtype differs from the model's");
    TORCH_CHECK_VALUE(positions.dim() == 1 && positions.size(0) == hidden.size(0) &&
                          positions.scalar_type() == at::kLong,
                      "DecodeStack: positions must be an int64 [num_tokens] vector");
    const at::Tensor pos = positions.contiguous();
    const int64_t* p = pos.const_data_ptr<int64_t>();
    for (int64_t i = 0; i < pos.size(0); ++i) {
      TORCH_CHECK_VALUE(p[i] >= 0 && p[i] < cos_.size(0), "DecodeStack: position ", p[i], " is past the RoPE table's ",
                        cos_.size(0));
    }
    TORCH_CHECK_VALUE(lora_slots.numel() == 0 || (lora_slots.dim() == 1 && lora_slots.size(0) == hidden.size(0) &&
                                                   lora_slots.scalar_type() == at::kLong),
                      "DecodeStack: lora_slots must be an int64 [num_tokens] vector or empty");
    at::Tensor x = hidden.contiguous().clone();
    const at::Tensor slots = lora_slots.contiguous();
    if (x.scalar_type() == at::kBFloat16) {
      run<c10::BFloat16>(x, pos, slot_mapping, block_tables, query_start_loc, context_lens, slots);
    } else {
      run<float>(x, pos, slot_mapping, block_tables, query_start_loc, context_lens, slots);
    }
    return x;
  }

 private:
  Layer& last_layer() {
    TORCH_CHECK_VALUE(!layers_.empty(), "DecodeStack: add_layer first");
    return layers_.back();
  }

  void check_vector(const at::Tensor& t, int64_t n, const char* name) const {
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == n && t.is_contiguous() && !layers_.empty() &&
                          t.scalar_type() == layers_.back().input_norm.scalar_type(),
                      "DecodeStack: ", name, " must be a contiguous [", n, "] vector in the model's dtype");
  }

  // Each q head of each row of qkv normed in place with the layer's q norm, each k head with its k norm.
  template <typename T>
  void head_norms(T* qkv, int64_t rows, int64_t row_stride, const Layer& layer, float eps) const {
    const T* q_weight = layer.q_norm.const_data_ptr<T>();
    const T* k_weight = layer.k_norm.const_data_ptr<T>();
    for_rows(rows, (num_heads_ + num_kv_heads_) * head_dim_, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t h = 0; h < num_heads_ + num_kv_heads_; ++h) {
          T* head = qkv + r * row_stride + h * head_dim_;
          rms_norm_row(head, h < num_heads_ ? q_weight : k_weight, head, head_dim_, eps, unit_offset_);
        }
      }
    });
  }

  template <typename T>
  void run(at::Tensor& x, const at::Tensor& positions, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
           const at::Tensor& query_start_loc, const at::Tensor& context_lens, const at::Tensor& lora_slots) {
    using AttentionOp = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                   const at::Tensor&, double, int64_t, double);
    static const auto attention =
        c10::Dispatcher::singleton().findSchemaOrThrow("hpi_kernels::cached_paged_attention_cpu", "")
            .typed<AttentionOp>();
    const int64_t rows = x.size(0), n = x.size(1);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const int64_t rotary = 2 * cos_.size(1);
    const float eps = static_cast<float>(eps_);
    at::Tensor normed = at::empty_like(x);
    T* h = x.mutable_data_ptr<T>();
    // The first layer's input norm; each later one's comes with the previous layer's last residual add.
    add_and_norm<T>(h, nullptr, layers_[0].input_norm.const_data_ptr<T>(), normed.mutable_data_ptr<T>(), rows, n,
                    eps, unit_offset_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      at::Tensor qkv = layer.qkv(normed, lora_slots);
      TORCH_CHECK(qkv.is_contiguous(), "DecodeStack: qkv projection returned a strided tensor");
      if (layer.q_norm.defined()) head_norms<T>(qkv.mutable_data_ptr<T>(), rows, qkv.size(1), layer, eps);
      const at::Tensor& cos = layer.sliding_rope ? sliding_cos_ : cos_;
      const at::Tensor& sin = layer.sliding_rope ? sliding_sin_ : sin_;
      rotate<T>(qkv.mutable_data_ptr<T>(), rows, qkv.size(1), num_heads_ + num_kv_heads_, head_dim_, rotary,
                positions.const_data_ptr<int64_t>(), cos.const_data_ptr<float>(), sin.const_data_ptr<float>());
      const at::Tensor q = qkv.narrow(1, 0, q_size).view({rows, num_heads_, head_dim_});
      const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, num_kv_heads_, head_dim_});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, num_kv_heads_, head_dim_});
      const at::Tensor attended =
          attention.call(q, k, v, layer.k_cache, layer.v_cache, slot_mapping, block_tables, query_start_loc,
                         context_lens, layer.scale, layer.sliding_window, layer.logit_softcap);
      const at::Tensor o = layer.o(attended.view({rows, q_size}), lora_slots).contiguous();
      const bool sandwich = layer.pre_ff_norm.defined();
      if (sandwich) norm_rows(o.mutable_data_ptr<T>(), layer.post_norm.const_data_ptr<T>(), rows, n, eps, unit_offset_);
      const at::Tensor& mlp_norm = sandwich ? layer.pre_ff_norm : layer.post_norm;
      add_and_norm<T>(h, o.const_data_ptr<T>(), mlp_norm.const_data_ptr<T>(), normed.mutable_data_ptr<T>(), rows, n,
                      eps, unit_offset_);
      const at::Tensor gate_up = layer.gate_up(normed, lora_slots).contiguous();
      const int64_t inner = gate_up.size(1) / 2;
      at::Tensor act = at::empty({rows, inner}, x.options());
      gated_activation<T>(gate_up.const_data_ptr<T>(), act.mutable_data_ptr<T>(), rows, inner, activation_);
      const at::Tensor down = layer.down(act, lora_slots).contiguous();
      if (sandwich) {
        norm_rows(down.mutable_data_ptr<T>(), layer.post_ff_norm.const_data_ptr<T>(), rows, n, eps, unit_offset_);
      }
      const bool last = i + 1 == layers_.size();
      const at::Tensor* next_norm = last ? (final_norm_.has_value() ? &*final_norm_ : nullptr)
                                         : &layers_[i + 1].input_norm;
      add_and_norm<T>(h, down.const_data_ptr<T>(), next_norm ? next_norm->const_data_ptr<T>() : nullptr,
                      normed.mutable_data_ptr<T>(), rows, n, eps, unit_offset_);
    }
    if (final_norm_.has_value()) x = normed;
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
  bool unit_offset_;
  at::Tensor cos_, sin_;
  at::Tensor sliding_cos_, sliding_sin_;  // Gemma 3's local layers' RoPE table, or undefined
  int64_t activation_ = kSilu;
  std::optional<at::Tensor> final_norm_;
  std::vector<Linear> pending_;
  std::vector<Layer> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(hpi_kernels, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, bool, at::Tensor, at::Tensor>())
      .def("add_linear", &DecodeStack::add_linear)
      .def("set_a8_max_rows", &DecodeStack::set_a8_max_rows)
      .def("set_lora", &DecodeStack::set_lora)
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_head_norms", &DecodeStack::set_head_norms)
      .def("set_sandwich_norms", &DecodeStack::set_sandwich_norms)
      .def("set_sliding_rope", &DecodeStack::set_sliding_rope)
      .def("use_sliding_rope", &DecodeStack::use_sliding_rope)
      .def("set_activation", &DecodeStack::set_activation)
      .def("set_final_norm", &DecodeStack::set_final_norm)
      .def("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward);
}
