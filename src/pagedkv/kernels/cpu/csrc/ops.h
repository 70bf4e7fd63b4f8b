// The library's ops as plain C++ functions, for ops built from them (decoder_layer.cpp):
// the same functions torch.ops.pagedkv.* run, without a trip through the dispatcher.
#pragma once

#include <ATen/core/Tensor.h>

namespace pagedkv {

at::Tensor ggml_linear_fn(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype);
at::Tensor int8_linear_fn(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale);

// The same on raw pointers, for decoder_layer.cpp's buffers (layer_ops.cpp, ggml_a8_linear.cpp,
// paged_attention_op.cpp): x, y row-major and contiguous unless a stride is given.
void rms_norm_rows(const float* x, const float* w, float* y, int64_t T, int64_t D, double eps);
void silu_and_mul_rows(const float* x, float* y, int64_t T, int64_t I);  // x [T, 2I] -> y [T, I]
void rope_rotate_rows(float* x, int64_t T, int64_t H, int64_t D, int64_t row_stride, const float* cos,
                      const float* sin);
void ggml_a8_linear_into(const float* x, int64_t M, int64_t K, const at::Tensor& packed, int64_t qtype, int64_t n,
                         float* y);  // AVX2/AVX-512 builds only
// q, out [T, H, D]; unquantized pages; check: validate the sequences' rows (they must cover
// all T rows) and block ids (once per step is enough: every layer of a stack shares them)
void paged_attention_into(const float* q, float* out, int64_t T, int64_t H, int64_t D, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& seq_info, const at::Tensor& block_tables,
                          double scale, int64_t window, int64_t sinks, const float* sink_q, bool check);

}  // namespace pagedkv
