// The library's ops as plain C++ functions, for ops built from them (decoder_layer.cpp):
// the same functions torch.ops.pagedkv.* run, without a trip through the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>

namespace pagedkv {

at::Tensor rms_norm_fn(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor silu_and_mul_fn(const at::Tensor& x);
void rope_rotate_fn(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor ggml_linear_fn(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype);
// AVX2/AVX-512 builds only (ggml_a8_linear.cpp): GGML blocks times int8 activations
at::Tensor ggml_a8_linear_fn(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n);
at::Tensor int8_linear_fn(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale);
// unquantized caches only (no scales), split = -1 (the kernel decides); window 0 = none
at::Tensor paged_attention_fn(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& seq_info, const at::Tensor& block_tables, double scale,
                              int64_t window, int64_t sinks, const c10::optional<at::Tensor>& sink_q);

}  // namespace pagedkv
