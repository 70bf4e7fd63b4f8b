// One Llama decoder layer of a step in one call, for GGML block-quantized or int8 weights
// and a float32/float16/bfloat16 paged KV cache (the default engine on a GGUF): the ops LlamaLayer.forward runs, in
// its order, on the same functions, so the results are bit-identical to it; what goes is
// the Python between them (~25 us a layer, ~0.7 ms of a 6 ms single-stream step here).
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
#include <torch/library.h>

#include "ops.h"

namespace pagedkv {
namespace {

constexpr int64_t kA8 = 256;  // a weight type with this bit: GGMLA8Weight.packed, int8 activations

// x . w^T for n output channels (the A8 layout pads its panels, so it is told n).
at::Tensor product(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& scale, int64_t qtype,
                   int64_t n) {
  if (scale.has_value()) return int8_linear_fn(x, w, *scale);
  if (qtype & kA8) {
#if defined(__AVX2__)
    return ggml_a8_linear_fn(x, w, qtype & ~kA8, n);
#else
    TORCH_CHECK(false, "decoder_layer: int8 activations need the AVX2 build of the kernels");
#endif
  }
  return ggml_linear_fn(x, w, qtype);
}

// K of a weight in the A8 layout: 16 channels' blocks of 32 weights per panel row.
int64_t a8_in_features(const at::Tensor& w, int64_t qtype) {
  return w.size(1) / (16 * ((qtype & ~kA8) == 3 ? 20 : 34)) * 32;
}

// k, v [T, Hkv, D] (float32, rows strided, heads contiguous) into the pages' slots slot_mapping[T],
// converted to the pages' dtype as KVCacheStorage.write's index_copy_ does (round to nearest
// even): the same bits, without ~9 us of index_copy_ dispatch a layer at one decode token.
template <typename T>
void write_rows(const at::Tensor& src, at::Tensor& pages, const int64_t* slots, int64_t rows) {
  const int64_t width = src.size(1) * src.size(2), stride = src.stride(0);
  const float* s = src.data_ptr<float>();
  T* d = pages.data_ptr<T>();
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < width; ++i) d[slots[t] * width + i] = static_cast<T>(s[t * stride + i]);
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
              const at::Tensor& slot_mapping) {
  const int64_t T = k.size(0), slots_total = k_cache.numel() / (k.size(1) * k.size(2));
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "decoder_layer: slot_mapping must be contiguous int64 [T]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k.stride(2) == 1 && k.stride(1) == k.size(2) &&
                  v.stride(2) == 1 && v.stride(1) == v.size(2) && k_cache.size(-1) == k.size(2) &&
                  k_cache.size(-2) == k.size(1) && v_cache.sizes() == k_cache.sizes(),
              "decoder_layer: pages [.., Hkv, D] like k and v, contiguous, and contiguous heads");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < slots_total, "decoder_layer: slot ", slots[t], " is outside the ",
                slots_total, " slots of the pages");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k_cache.scalar_type(), "write_kv", [&] {
    write_rows<scalar_t>(k, k_cache, slots, T);
    write_rows<scalar_t>(v, v_cache, slots, T);
  });
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
  TORCH_CHECK(x.dim() == 2, "decoder_layer: x must be [T, hidden]");
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16) && v_cache.scalar_type() == dtype,
              "decoder_layer: float32, float16 or bfloat16 KV pages only (quantized pages need their scales)");
  const int64_t T = x.size(0), H = num_heads, Hkv = num_kv_heads, D = head_dim;
  const int64_t q_size = H * D, kv_size = Hkv * D;
  const int64_t hidden = x.size(1);
  const int64_t inter = (down_type & kA8) ? a8_in_features(down, down_type) : 0;  // only A8 needs it
  const at::Tensor projected =
      product(rms_norm_fn(x, in_norm, eps), qkv, qkv_scale, qkv_type, q_size + 2 * kv_size);  // [T, (H + 2 Hkv) D]
  TORCH_CHECK(projected.size(1) == q_size + 2 * kv_size, "decoder_layer: the QKV weight has ",
              projected.size(1), " rows, not (H + 2 Hkv) * D = ", q_size + 2 * kv_size);
  at::Tensor qk = projected.narrow(1, 0, q_size + kv_size).view({T, H + Hkv, D});
  rope_rotate_fn(qk, cos, sin);
  const at::Tensor v = projected.narrow(1, q_size + kv_size, kv_size).view({T, Hkv, D});
  write_kv(qk.narrow(1, H, Hkv), v, k_cache, v_cache, slot_mapping);
  const at::Tensor q = qk.narrow(1, 0, H).contiguous();
  c10::optional<at::Tensor> sink_q;
  if (sink_cos.has_value() && sink_sin.has_value()) {  // as LlamaLayer.forward: q rotated again, for the sinks
    at::Tensor qs = q.clone();
    rope_rotate_fn(qs, *sink_cos, *sink_sin);
    sink_q = qs;
  }
  const at::Tensor attn = paged_attention_fn(q, k_cache, v_cache, seq_info, block_tables, scale, window, sinks, sink_q);
  const at::Tensor y = x + product(attn.reshape({T, q_size}), o, o_scale, o_type, hidden);
  const at::Tensor h = rms_norm_fn(y, post_norm, eps);
  const at::Tensor act = silu_and_mul_fn(product(h, gate_up, gate_up_scale, gate_up_type, 2 * inter));
  return y + product(act, down, down_scale, down_type, hidden);
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
  TORCH_CHECK(post_norms.size() == L && weights.size() == 4 * L && scales.size() == 4 * L && types.size() == 4 * L &&
                  k_caches.size() == L && v_caches.size() == L && windows.size() == L,
              "decoder_stack: per layer one norm pair, four weights (scales, types), one page pair and a window");
  at::Tensor h = x;
  for (size_t i = 0; i < L; ++i) {
    const size_t w = 4 * i;
    h = decoder_layer(h, in_norms[i], post_norms[i], eps, weights[w], scales.get(w), types[w], weights[w + 1],
                      scales.get(w + 1), types[w + 1], weights[w + 2], scales.get(w + 2), types[w + 2], weights[w + 3],
                      scales.get(w + 3), types[w + 3], cos, sin, num_heads, num_kv_heads, head_dim, k_caches[i],
                      v_caches[i], slot_mapping, seq_info, block_tables, scale, windows[i], sinks, sink_cos, sink_sin);
  }
  return h;
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
