// torch binding of the fused CPU paged attention kernel: validates the tensors and registers
//   torch.ops.pagedkv.paged_attention(q, k_cache, v_cache, seq_info, block_tables, scale, split=-1,
//                                     k_scale=None, v_scale=None, window=0, sinks=0,
//                                     sink_q=None)
// Shapes: see paged_attention.h. Only light ATen headers, to keep the JIT build short.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "ops.h"
#include "paged_attention.h"

#include <algorithm>
#include <vector>

namespace pagedkv {
namespace {

KVType kv_type(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return KVType::f32;
    case at::kHalf: return KVType::f16;
    case at::kBFloat16: return KVType::bf16;
    case at::kChar: return KVType::i8;
    case at::kFloat8_e4m3fn: return KVType::f8e4m3;
    case at::kFloat8_e5m2: return KVType::f8e5m2;
    default: TORCH_CHECK(false, "paged_attention: KV cache dtype must be float32, float16, bfloat16, int8, "
                         "float8_e4m3fn or float8_e5m2, got ", t.scalar_type());
  }
}

// The caches and metadata for queries [*, H, D].
void check_caches(int64_t H, int64_t D, const at::Tensor& k, const at::Tensor& v, const at::Tensor& info,
                  const at::Tensor& tables) {
  for (const at::Tensor* t : {&k, &v, &info, &tables})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "paged_attention: tensors must be contiguous CPU tensors");
  TORCH_CHECK(k.dim() == 4 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(),
              "paged_attention: k_cache and v_cache must be [num_blocks, block_size, kv_heads, head_dim] of one dtype");
  TORCH_CHECK(D == k.size(3), "paged_attention: q head_dim ", D, " != cache head_dim ", k.size(3));
  TORCH_CHECK(k.size(2) > 0 && H % k.size(2) == 0, "paged_attention: num_heads ", H,
              " is not a multiple of num_kv_heads ", k.size(2));
  TORCH_CHECK(paged_attention_supports_head_dim(D), "paged_attention: head_dim ", D,
              " is not supported by the kernel");
  TORCH_CHECK(info.scalar_type() == at::kLong && info.dim() == 2 && info.size(1) == 5,
              "paged_attention: seq_info must be int64 [S, 5]");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.dim() == 1, "paged_attention: block_tables must be int64 [N]");
}

void check_tensors(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& info,
                   const at::Tensor& tables) {
  TORCH_CHECK(q.device().is_cpu() && q.is_contiguous(), "paged_attention: tensors must be contiguous CPU tensors");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "paged_attention: q must be float32 [T, H, D]");
  check_caches(q.size(1), q.size(2), k, v, info, tables);
}

// A window >= 0 (0: none), sinks only with one, sink queries only with sinks.
void check_window(int64_t window, int64_t sinks, bool sink_q) {
  TORCH_CHECK(window >= 0, "paged_attention: window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(sinks >= 0 && (sinks == 0 || window > 0), "paged_attention: sinks must be >= 0 and need a window, got ",
              sinks, " with window ", window);
  TORCH_CHECK(!sink_q || sinks > 0, "paged_attention: sink_q scores attention sinks, but sinks is 0");
}

// Each sequence's rows (of T), table slice and block ids must lie inside their tensors.
void check_sequences(int64_t T, const at::Tensor& k, const at::Tensor& info, const at::Tensor& tables) {
  const int64_t* s = info.data_ptr<int64_t>();
  const int64_t* bt = tables.data_ptr<int64_t>();
  const int64_t nb = k.size(0), bs = k.size(1), n_tables = tables.numel();
  for (int64_t i = 0; i < info.size(0); ++i, s += 5) {
    const int64_t qs = s[0], ql = s[1], ctx = s[2], off = s[3], len = s[4];
    // written as differences so that huge values cannot wrap around and pass
    TORCH_CHECK(qs >= 0 && ql >= 0 && qs <= T && ql <= T - qs && ql <= ctx, "paged_attention: sequence ", i,
                " has query rows [", qs, ", ", qs + ql, ") and context_len ", ctx, " for ", T, " rows");
    TORCH_CHECK(off >= 0 && len >= 0 && off <= n_tables && len <= n_tables - off && len * bs >= ctx,
                "paged_attention: sequence ", i,
                " block table (", len, " blocks at ", off, ") does not cover context_len ", ctx);
    for (int64_t b = 0; b < (ctx + bs - 1) / bs; ++b)
      TORCH_CHECK_INDEX(bt[off + b] >= 0 && bt[off + b] < nb, "paged_attention: block id ", bt[off + b],
                        " out of range [0, ", nb, ")");
  }
}

// The layout of one quantized cache's scales (k: the cache [NB, BS, Hkv, D]): contiguous
// float32 or bfloat16 [NB, BS, Hkv] (per token and head), float32 [Hkv, D] (per channel),
// [Hkv] (per head) or [1] (per tensor).
ScaleLayout scale_layout(const at::Tensor& k, const at::Tensor& s, const char* name) {
  TORCH_CHECK(s.device().is_cpu() && s.is_contiguous() &&
                  (s.scalar_type() == at::kFloat || s.scalar_type() == at::kBFloat16),
              "paged_attention: ", name, " must be a contiguous float32 or bfloat16 CPU tensor");
  ScaleLayout l;
  l.data = s.data_ptr();
  l.bf16 = s.scalar_type() == at::kBFloat16;
  const int64_t bs = k.size(1), hkv = k.size(2), d = k.size(3);
  if (s.dim() == 3 && s.size(0) == k.size(0) && s.size(1) == bs && s.size(2) == hkv) {
    l.strides[0] = bs * hkv, l.strides[1] = hkv, l.strides[2] = 1;
  } else if (s.dim() == 2 && s.size(0) == hkv && s.size(1) == d) {
    TORCH_CHECK(!l.bf16, "paged_attention: per-channel ", name, " must be float32");
    l.per_channel = true;
  } else if (s.dim() == 1 && s.size(0) == hkv) {
    l.strides[2] = 1;
  } else {
    TORCH_CHECK(s.dim() == 1 && s.size(0) == 1, "paged_attention: ", name, " shape ", s.sizes(),
                " is none of [num_blocks, block_size, kv_heads], [kv_heads, head_dim], [kv_heads], [1]");
  }
  return l;
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& seq_info, const at::Tensor& block_tables, double scale, int64_t split,
                           const c10::optional<at::Tensor>& k_scale, const c10::optional<at::Tensor>& v_scale,
                           int64_t window, int64_t sinks, const c10::optional<at::Tensor>& sink_q, double softcap) {
  check_tensors(q, k_cache, v_cache, seq_info, block_tables);
  TORCH_CHECK(softcap >= 0.0, "paged_attention: softcap must be >= 0 (0: none), got ", softcap);
  check_window(window, sinks, sink_q.has_value());
  check_sequences(q.size(0), k_cache, seq_info, block_tables);
  if (sink_q.has_value()) {
    TORCH_CHECK(sink_q->sizes() == q.sizes() && sink_q->scalar_type() == at::kFloat && sink_q->is_contiguous() &&
                    sink_q->device() == q.device(),
                "paged_attention: sink_q must be a contiguous float32 tensor shaped like q ", q.sizes(), ", got ",
                sink_q->sizes(), " ", sink_q->scalar_type());
  }
  const KVType type = kv_type(k_cache);
  PagedAttentionArgs a{q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(), type, {}, {},
                       seq_info.data_ptr<int64_t>(), block_tables.data_ptr<int64_t>(), nullptr,
                       seq_info.size(0), q.size(1), k_cache.size(2), q.size(2), k_cache.size(1),
                       static_cast<float>(scale), static_cast<int>(split), window, sinks,
                       sink_q.has_value() ? sink_q->data_ptr<float>() : nullptr, static_cast<float>(softcap)};
  if (is_quantized(type)) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "paged_attention: an int8/fp8 cache needs k_scale and v_scale");
    a.k_scale = scale_layout(k_cache, *k_scale, "k_scale");
    a.v_scale = scale_layout(k_cache, *v_scale, "v_scale");
  } else {
    TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(), "paged_attention: scales given for an unquantized cache");
  }
  at::Tensor out = at::empty_like(q);  // [T, H, D]
  a.out = out.data_ptr<float>();
  at::internal::lazy_init_num_threads();  // this thread's OpenMP team size = torch.get_num_threads()
  paged_attention_cpu(a);
  return out;
}

}  // namespace

void paged_attention_into(const float* q, float* out, int64_t T, int64_t H, int64_t D, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& seq_info, const at::Tensor& block_tables,
                          double scale, int64_t window, int64_t sinks, const float* sink_q, bool check) {
  const KVType type = kv_type(k_cache);
  TORCH_CHECK(!is_quantized(type), "paged_attention_into: unquantized pages only");
  check_caches(H, D, k_cache, v_cache, seq_info, block_tables);
  check_window(window, sinks, sink_q != nullptr);
  if (check) {
    check_sequences(T, k_cache, seq_info, block_tables);
    // every row of the buffers belongs to exactly one sequence: none is left unwritten
    std::vector<char> seen(T, 0);
    const int64_t* s = seq_info.data_ptr<int64_t>();
    for (int64_t i = 0; i < seq_info.size(0); ++i, s += 5)
      for (int64_t r = s[0]; r < s[0] + s[1]; ++r) {
        TORCH_CHECK(!seen[r], "paged_attention: row ", r, " belongs to two sequences");
        seen[r] = 1;
      }
    const auto gap = std::find(seen.begin(), seen.end(), 0);
    TORCH_CHECK(gap == seen.end(), "paged_attention: row ", gap - seen.begin(), " of ", T, " belongs to no sequence");
  }
  PagedAttentionArgs a{q, k_cache.data_ptr(), v_cache.data_ptr(), type, {}, {}, seq_info.data_ptr<int64_t>(),
                       block_tables.data_ptr<int64_t>(), out, seq_info.size(0), H, k_cache.size(2), D,
                       k_cache.size(1), static_cast<float>(scale), -1, window, sinks, sink_q, 0.0f};
  at::internal::lazy_init_num_threads();
  paged_attention_cpu(a);
}

}  // namespace pagedkv

TORCH_LIBRARY(pagedkv, m) {
  m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor seq_info, Tensor block_tables, "
        "float scale, int split=-1, Tensor? k_scale=None, Tensor? v_scale=None, int window=0, int sinks=0, Tensor? sink_q=None, "
        "float softcap=0.0) -> Tensor",
        &pagedkv::paged_attention);
}
