// One Llama decoder layer of a step in one call, for GGML block-quantized or int8 weights
// and a float32/float16/bfloat16 paged KV cache (the default engine on a GGUF): the ops LlamaLayer.forward runs, in
// its order, on the same functions, so the results are bit-identical to it; what goes is
// the Python between them (~25 us a layer, ~0.7 ms of a 6 ms single-stream step here) and,
// since the layer runs on raw buffers kept by the calling thread, torch's per-op allocation
// and dispatch inside it (~12 us a layer at one decode token: ~0.35 ms of a 3 ms step on
// an AMD EPYC family 26; the step 1.10-1.15x faster, BENCHMARKS.md).
//
//   decoder_layer(x [T, hidden], in_norm, post_norm, eps, qkv, qkv_scale, qkv_type, o, o_scale,
//                 o_type, gate_up, gate_up_scale, gate_up_type, down, down_scale, down_type,
//                 cos [T, 1, D], sin [T, 1, D], H, Hkv, D,
//                 k_cache, v_cache [pages, block, Hkv, D], slot_mapping [T], seq_info, block_tables,
//                 scale, window=0, sinks=0, sink_cos=None, sink_sin=None) -> x' [T, hidden] (window:
//                 the layer's sliding window, 0 = none; sinks: leading positions every row also
//                 sees; sink_cos/sin [T, 1, D]: the rotation of each row's rotated q that scores
//                 the sinks, as LlamaLayer.forward's sink_tables)
//
// h = rms_norm(x); qkv = h W_qkv^T; RoPE on q, k (in place); k, v -> pages at slot_mapping;
// a = paged_attention(q); x += a W_o^T; h = rms_norm(x); x += silu_and_mul(h W_gu^T) W_down^T.
// A weight is GGMLWeight.packed blocks with their ggml type and no scale (ggml_linear.cpp),
// GGMLA8Weight.packed with its ggml type + 256 (int8 activations, ggml_a8_linear.cpp), or
// Int8Weight's int8 values with their per-channel scales (int8_linear.cpp).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include "ops.h"

#include <cstring>
#include <vector>

namespace pagedkv {
namespace {

constexpr int64_t kA8 = 256;  // a weight type with this bit: GGMLA8Weight.packed, int8 activations

// One weight of a layer: its tensor, per-channel scales (int8 weights) and type.
struct Weight {
  const at::Tensor& w;
  const c10::optional<at::Tensor>& scale;
  int64_t type;
};

// Input features K of a weight: int8 [N, K]; GGML blocks [N, K / 32 * block bytes]; the A8
// layout's panels hold 16 channels' blocks of 32 weights per row.
int64_t in_features(const Weight& w) {
  if (w.scale.has_value()) return w.w.size(1);
  const int64_t block_bytes = (w.type & ~kA8) == 3 ? 20 : 34;
  return w.w.size(1) / (w.type & kA8 ? 16 * block_bytes : block_bytes) * 32;
}

// Output channels of a weight: the A8 layout pads its panels, so it is told them (a8_n).
int64_t out_features(const Weight& w, int64_t a8_n) { return w.type & kA8 && !w.scale ? a8_n : w.w.size(0); }

// y [T, n] = x [T, K] . W^T. GGML blocks with int8 activations run straight on the buffers;
// the other kinds through their ops (ggml_linear.cpp, int8_linear.cpp) and a copy.
void product(const float* x, int64_t T, int64_t K, const Weight& w, int64_t n, float* y) {
  if (!w.scale.has_value() && (w.type & kA8)) {
#if defined(__AVX2__)
    ggml_a8_linear_into(x, T, K, w.w, w.type & ~kA8, n, y);
    return;
#else
    TORCH_CHECK(false, "decoder_layer: int8 activations need the AVX2 build of the kernels");
#endif
  }
  const at::Tensor xt = at::from_blob(const_cast<float*>(x), {T, K}, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor r = w.scale.has_value() ? int8_linear_fn(xt, w.w, *w.scale) : ggml_linear_fn(xt, w.w, w.type);
  TORCH_CHECK(r.dim() == 2 && r.size(0) == T && r.size(1) == n && r.is_contiguous(), "decoder_layer: a weight has ",
              r.size(1), " output channels, not ", n);
  std::memcpy(y, r.data_ptr<float>(), T * n * sizeof(float));
}

// k, v rows (float32, heads contiguous, rows `stride` apart, `width` = Hkv * D values) into
// the pages' slots, converted to the pages' dtype as KVCacheStorage.write's index_copy_ does
// (round to nearest even): the same bits, without ~9 us of index_copy_ dispatch a layer.
template <typename T>
void write_rows(const float* src, int64_t stride, int64_t width, T* pages, const int64_t* slots, int64_t rows) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < width; ++i) pages[slots[t] * width + i] = static_cast<T>(src[t * stride + i]);
}

void write_kv(const float* k, const float* v, int64_t stride, int64_t T, int64_t Hkv, int64_t D, at::Tensor k_cache,
              at::Tensor v_cache, const at::Tensor& slot_mapping) {
  const int64_t slots_total = k_cache.numel() / (Hkv * D);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "decoder_layer: slot_mapping must be contiguous int64 [T]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(-1) == D && k_cache.size(-2) == Hkv &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "decoder_layer: pages [.., Hkv, D] like k and v, contiguous, and contiguous heads");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < slots_total, "decoder_layer: slot ", slots[t], " is outside the ",
                slots_total, " slots of the pages");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "write_kv", [&] {
    write_rows<scalar_t>(k, stride, Hkv * D, k_cache.data_ptr<scalar_t>(), slots, T);
    write_rows<scalar_t>(v, stride, Hkv * D, v_cache.data_ptr<scalar_t>(), slots, T);
  });
}

// What every layer of a step shares: shapes, the RoPE tables, the pages' addressing.
struct Step {
  int64_t T, hidden, H, Hkv, D;
  double eps, scale;
  const float *cos, *sin, *sink_cos, *sink_sin;  // [T, D]; sink tables or null
  const at::Tensor &slot_mapping, &seq_info, &block_tables;
  int64_t sinks;
};

// This thread's buffers for a step's intermediates, kept between steps: a fresh allocation of
// each (~25 a layer) cost more than the elementwise math at one decode token, and buffers
// past malloc's mmap threshold pay first-touch page faults every step.
float* scratch(size_t floats) {
  thread_local std::vector<float> buf;
  if (buf.size() < floats) buf.resize(floats);
  return buf.data();
}

// One layer on x [T, hidden] in place: h = rms_norm(x); qkv = h W_qkv^T; RoPE on q, k; k, v
// -> pages at slot_mapping; a = paged_attention(q); y = x + a W_o^T; h = rms_norm(y);
// x = y + silu_and_mul(h W_gu^T) W_down^T. w: qkv, o, gate_up, down. buf: see run_stack.
void layer(const Step& s, float* x, const at::Tensor& in_norm, const at::Tensor& post_norm, const Weight* w,
           const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t window, bool check, float* buf, int64_t inter) {
  const int64_t T = s.T, hidden = s.hidden, q_size = s.H * s.D, kv_size = s.Hkv * s.D, qkv_n = q_size + 2 * kv_size;
  TORCH_CHECK(in_norm.numel() == hidden && post_norm.numel() == hidden && in_norm.is_contiguous() &&
                  post_norm.is_contiguous() && in_norm.scalar_type() == at::kFloat &&
                  post_norm.scalar_type() == at::kFloat,
              "decoder_layer: norm weights must be contiguous float32 [hidden]");
  float *h = buf, *proj = h + T * hidden, *q = proj + T * qkv_n, *sink_q = q + T * q_size, *attn = sink_q + T * q_size;
  float *gu = attn + T * q_size, *act = gu + T * 2 * inter;
  rms_norm_rows(x, in_norm.data_ptr<float>(), h, T, hidden, s.eps);
  product(h, T, hidden, w[0], qkv_n, proj);  // [T, (H + 2 Hkv) D]
  rope_rotate_rows(proj, T, s.H + s.Hkv, s.D, qkv_n, s.cos, s.sin);
  write_kv(proj + q_size, proj + q_size + kv_size, qkv_n, T, s.Hkv, s.D, k_cache, v_cache, s.slot_mapping);
  for (int64_t t = 0; t < T; ++t) std::memcpy(q + t * q_size, proj + t * qkv_n, q_size * sizeof(float));
  const bool sink_rows = s.sink_cos != nullptr;
  if (sink_rows) {  // as LlamaLayer.forward: q rotated again, for the sinks
    std::memcpy(sink_q, q, T * q_size * sizeof(float));
    rope_rotate_rows(sink_q, T, s.H, s.D, q_size, s.sink_cos, s.sink_sin);
  }
  paged_attention_into(q, attn, T, s.H, s.D, k_cache, v_cache, s.seq_info, s.block_tables, s.scale, window, s.sinks,
                       sink_rows ? sink_q : nullptr, check);
  product(attn, T, q_size, w[1], hidden, h);
  for (int64_t i = 0; i < T * hidden; ++i) x[i] = x[i] + h[i];  // y, in x
  rms_norm_rows(x, post_norm.data_ptr<float>(), h, T, hidden, s.eps);
  product(h, T, hidden, w[2], 2 * inter, gu);
  silu_and_mul_rows(gu, act, T, inter);
  product(act, T, inter, w[3], hidden, h);
  for (int64_t i = 0; i < T * hidden; ++i) x[i] = x[i] + h[i];
}

// Layers 0 .. L - 1 on x, the weights of layer i at weights/scales/types[4 i .. 4 i + 3].
at::Tensor run_stack(const Step& s, const at::Tensor& x, at::TensorList in_norms, at::TensorList post_norms,
                     at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& scales, at::IntArrayRef types,
                     at::TensorList k_caches, at::TensorList v_caches, at::IntArrayRef windows) {
  const int64_t T = s.T, hidden = s.hidden, q_size = s.H * s.D, qkv_n = q_size + 2 * s.Hkv * s.D;
  at::Tensor out = x.clone(at::MemoryFormat::Contiguous);
  for (size_t i = 0; i < in_norms.size(); ++i) {
    const size_t b = 4 * i;
    const c10::optional<at::Tensor> sc[4] = {scales.get(b), scales.get(b + 1), scales.get(b + 2), scales.get(b + 3)};
    const Weight w[4] = {{weights[b], sc[0], types[b]}, {weights[b + 1], sc[1], types[b + 1]},
                         {weights[b + 2], sc[2], types[b + 2]}, {weights[b + 3], sc[3], types[b + 3]}};
    const int64_t inter = in_features(w[3]);
    TORCH_CHECK(out_features(w[2], 2 * inter) == 2 * inter, "decoder_layer: gate_up has ",
                out_features(w[2], 2 * inter), " rows, not twice down's ", inter, " inputs");
    TORCH_CHECK(out_features(w[0], qkv_n) == qkv_n, "decoder_layer: the QKV weight has ", out_features(w[0], qkv_n),
                " rows, not (H + 2 Hkv) * D = ", qkv_n);
    float* buf = scratch(T * (hidden + qkv_n + 3 * q_size + 3 * inter));
    layer(s, out.data_ptr<float>(), in_norms[i], post_norms[i], w, k_caches[i], v_caches[i], windows[i], i == 0, buf,
          inter);
  }
  return out;
}

// The step's shared arguments, checked once.
Step make_step(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t Hkv, int64_t D,
               double eps, double scale, const at::Tensor& k_cache, const at::Tensor& slot_mapping,
               const at::Tensor& seq_info, const at::Tensor& block_tables, int64_t sinks,
               const c10::optional<at::Tensor>& sink_cos, const c10::optional<at::Tensor>& sink_sin) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "decoder_layer: x must be float32 [T, hidden]");
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "decoder_layer: float32, float16 or bfloat16 KV pages only (quantized pages need their scales)");
  const int64_t T = x.size(0);
  TORCH_CHECK(H > 0 && Hkv > 0 && D > 0 && D % 2 == 0, "decoder_layer: bad head shape");
  const auto table = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == T * D && t.size(-1) == D, name,
                " must be contiguous float32 [T, 1, D]");
    return t.data_ptr<float>();
  };
  const bool sink_rows = sink_cos.has_value() && sink_sin.has_value();
  return {T, x.size(1), H, Hkv, D, eps, scale, table(cos, "decoder_layer: cos"), table(sin, "decoder_layer: sin"),
          sink_rows ? table(*sink_cos, "decoder_layer: sink_cos") : nullptr,
          sink_rows ? table(*sink_sin, "decoder_layer: sink_sin") : nullptr, slot_mapping, seq_info, block_tables,
          sinks};
}

at::Tensor decoder_layer(const at::Tensor& x, const at::Tensor& in_norm, const at::Tensor& post_norm, double eps,
                         const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_scale, int64_t qkv_type,
                         const at::Tensor& o, const c10::optional<at::Tensor>& o_scale, int64_t o_type,
                         const at::Tensor& gate_up, const c10::optional<at::Tensor>& gate_up_scale, int64_t gate_up_type,
                         const at::Tensor& down, const c10::optional<at::Tensor>& down_scale, int64_t down_type,
                         const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads,
                         int64_t head_dim, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& seq_info, const at::Tensor& block_tables,
                         double scale, int64_t window, int64_t sinks, const c10::optional<at::Tensor>& sink_cos,
                         const c10::optional<at::Tensor>& sink_sin) {
  const Step s = make_step(x, cos, sin, num_heads, num_kv_heads, head_dim, eps, scale, k_cache, slot_mapping, seq_info,
                           block_tables, sinks, sink_cos, sink_sin);
  c10::List<c10::optional<at::Tensor>> scales({qkv_scale, o_scale, gate_up_scale, down_scale});
  const int64_t types[4] = {qkv_type, o_type, gate_up_type, down_type};
  return run_stack(s, x, {in_norm}, {post_norm}, {qkv, o, gate_up, down}, scales, types, {k_cache}, {v_cache},
                   {window});
}

// Every layer of a forward in one call: decoder_layer for i = 0 .. L - 1, the weights of
// layer i at weights/scales/types[4 i .. 4 i + 3] (qkv, o, gate_up, down), its pages
// k_caches[i], v_caches[i] and window windows[i]; one slot mapping and block table for all
// layers (one KV cache group). What goes is the Python and dispatch between layers.
at::Tensor decoder_stack(const at::Tensor& x, at::TensorList in_norms, at::TensorList post_norms, double eps,
                         at::TensorList weights, const c10::List<c10::optional<at::Tensor>>& scales,
                         at::IntArrayRef types, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                         int64_t num_kv_heads, int64_t head_dim, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& seq_info, const at::Tensor& block_tables,
                         double scale, at::IntArrayRef windows, int64_t sinks,
                         const c10::optional<at::Tensor>& sink_cos, const c10::optional<at::Tensor>& sink_sin) {
  const size_t L = in_norms.size();
  TORCH_CHECK(L > 0 && post_norms.size() == L && weights.size() == 4 * L && scales.size() == 4 * L &&
                  types.size() == 4 * L && k_caches.size() == L && v_caches.size() == L && windows.size() == L,
              "decoder_stack: per layer one norm pair, four weights (scales, types), one page pair and a window");
  for (size_t i = 1; i < L; ++i)  // one group: the block ids checked on layer 0's pages hold for all
    TORCH_CHECK(k_caches[i].sizes() == k_caches[0].sizes() && k_caches[i].scalar_type() == k_caches[0].scalar_type(),
                "decoder_stack: every layer's pages must have layer 0's shape and dtype");
  const Step s = make_step(x, cos, sin, num_heads, num_kv_heads, head_dim, eps, scale, k_caches[0], slot_mapping,
                           seq_info, block_tables, sinks, sink_cos, sink_sin);
  return run_stack(s, x, in_norms, post_norms, weights, scales, types, k_caches, v_caches, windows);
}

}  // namespace
}  // namespace pagedkv

TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("decoder_stack(Tensor x, Tensor[] in_norms, Tensor[] post_norms, float eps, Tensor[] weights, "
        "Tensor?[] scales, int[] types, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, int head_dim, "
        "Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, Tensor slot_mapping, Tensor seq_info, Tensor block_tables, "
        "float scale, int[] windows, int sinks=0, Tensor? sink_cos=None, Tensor? sink_sin=None) -> Tensor",
        &pagedkv::decoder_stack);
  m.def("decoder_layer(Tensor x, Tensor in_norm, Tensor post_norm, float eps, Tensor qkv, Tensor? qkv_scale, "
        "int qkv_type, Tensor o, Tensor? o_scale, int o_type, Tensor gate_up, Tensor? gate_up_scale, "
        "int gate_up_type, Tensor down, Tensor? down_scale, int down_type, Tensor cos, "
        "Tensor sin, int num_heads, int num_kv_heads, int head_dim, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, Tensor seq_info, Tensor block_tables, float scale, int window=0, int sinks=0, "
        "Tensor? sink_cos=None, Tensor? sink_sin=None) -> Tensor",
        &pagedkv::decoder_layer);
}
