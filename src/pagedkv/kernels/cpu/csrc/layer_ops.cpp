// The small per-layer ops of a decoder step, each one call instead of five to ten torch ops
// (at one decode token a torch op costs microseconds of dispatch for nanoseconds of math):
//
//   rms_norm(x [T, D], w [D], eps) -> y        y = x * (1 / sqrt(mean(x^2) + eps)) * w
//       (Zhang & Sennrich 2019). The sum of squares is accumulated in 16 fixed partial sums
//       then added in a fixed order, so a row's result never depends on T or threads.
//   silu_and_mul(x [T, 2I]) -> y [T, I]         y = silu(x[:, :I]) * x[:, I:] (SwiGLU,
//       Shazeer 2020), silu(g) = g * sigmoid(g), eight lanes at a time with the attention
//       kernel's exp of a non-positive number: e = exp(-|g|), sigmoid = 1 / (1 + e) for
//       g >= 0 and e / (1 + e) below (no overflow either side; within 3e-7 relative of fp64,
//       torch's fp32 silu within 2.1e-7); below g = -87.3, where e is subnormal, libm's exp.
//   rope_rotate_(x [T, H, D], cos [T, D], sin [T, D])   in place, HF's rotate-half layout:
//       x = x * cos + cat(-x2, x1) * sin, each product and the sum rounded once (this file
//       is compiled without FMA contraction), so it equals the torch composite bit for bit.
//   greedy_argmax(logits [n, V]) -> (best int64 [n], finite bool [n])   torch.argmax's pick
//       (the first maximum; the first NaN where a row has one; 0 for a row of -inf) and
//       whether the picked logit is finite, in one pass over the row: the greedy sampler's
//       five torch ops cost ~80 us a step at one row on a just-computed LM head output.
//
// Rows are split over threads (at::parallel_for); each row is computed by one thread alone.
// The *_rows functions are the same on raw pointers (ops.h), for decoder_layer.cpp's buffers.

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "ops.h"
#include "vec.h"

#include <cmath>
#include <cstdint>
#include <tuple>

namespace pagedkv {
namespace {

constexpr int kPartials = 16;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              ": expected a contiguous float32 CPU tensor");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm x");
  check_rows(w, "rms_norm weight");
  const int64_t D = x.size(-1), T = D ? x.numel() / D : 0;
  TORCH_CHECK(w.dim() == 1 && w.size(0) == D, "rms_norm: weight must be [", D, "]");
  at::Tensor y = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), T, D, eps);
  return y;
}

// Below g = -87.3 exp(g) is subnormal, which the vector exp flushes to 0; there silu(g) is
// still ~1e-36 (a large `up` makes it a normal number), so those lanes take
// g / (1 + exp(-g)) with libm's exp, whose exp(-g) is still a normal number up to g = -88.7.
constexpr float kSubnormalExp = -87.3f;

vec::vf8 silu_times(vec::vf8 g, vec::vf8 u) {
  const vec::vi8 neg = g < 0.0f;
  const vec::vf8 e = vec::exp_nonpos8(neg ? g : -g);
  vec::vf8 y = g * ((neg ? e : vec::vf8{} + 1.0f) / (e + 1.0f)) * u;
  const vec::vi8 tiny = g < kSubnormalExp;
#if defined(__AVX__)
  __m256 t;
  std::memcpy(&t, &tiny, sizeof t);
  const bool any = _mm256_movemask_ps(t) != 0;
#else
  bool any = false;
  for (int j = 0; j < 8; ++j) any |= tiny[j] != 0;
#endif
  if (any)
    for (int j = 0; j < 8; ++j)
      if (tiny[j]) y[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
  return y;
}

// One row: every element goes through the same lane arithmetic, the tail in a padded vector
// (a scalar libm exp per element took 10 ns here: 10 ms of a 64-row decode step).
void silu_and_mul_row(const float* gate, const float* up, float* y, int64_t I) {
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) vec::store8(y + i, silu_times(vec::load8(gate + i), vec::load8(up + i)));
  if (i == I) return;
  float g[8] = {}, u[8] = {}, r[8];
  std::memcpy(g, gate + i, (I - i) * sizeof(float));
  std::memcpy(u, up + i, (I - i) * sizeof(float));
  vec::store8(r, silu_times(vec::load8(g), vec::load8(u)));
  std::memcpy(y + i, r, (I - i) * sizeof(float));
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "silu_and_mul x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_and_mul: x must be [T, 2 * I]");
  const int64_t T = x.size(0), I = x.size(1) / 2;
  at::Tensor y = at::empty({T, I}, x.options());
  silu_and_mul_rows(x.data_ptr<float>(), y.data_ptr<float>(), T, I);
  return y;
}

void rope_rotate_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 &&
              x.stride(1) == x.size(2), "rope_rotate_: x must be float32 [T, H, D] with contiguous heads");
  check_rows(cos, "rope_rotate_ cos");
  check_rows(sin, "rope_rotate_ sin");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), row = x.stride(0);
  TORCH_CHECK(D % 2 == 0 && cos.numel() == T * D && sin.numel() == T * D && cos.size(-1) == D && sin.size(-1) == D,
              "rope_rotate_: tables must be [T, D] (or [T, 1, D])");
  rope_rotate_rows(x.data_ptr<float>(), T, H, D, row, cos.data_ptr<float>(), sin.data_ptr<float>());
}


constexpr int64_t kArgmaxChunk = 128;  // floats per chunk: one vector max and NaN test each

// The first maximum of a row, or its first NaN: chunks' maxima in vectors, a chunk scanned
// element by element only when it holds a NaN or beats the best so far (a few times a row).
int64_t first_argmax_row(const float* x, int64_t V) {
  float best = x[0];
  int64_t at = 0, c = 0;
  const auto scan = [&](int64_t lo, int64_t hi) {  // false: a NaN at `at`
    for (int64_t j = lo; j < hi; ++j) {
      if (x[j] != x[j]) return at = j, false;
      if (x[j] > best) best = x[j], at = j;
    }
    return true;
  };
  for (; c + kArgmaxChunk <= V; c += kArgmaxChunk) {
    vec::vf m = vec::loadv(x + c);
    vec::vi nan = m != m;
    for (int64_t j = vec::kLanes; j < kArgmaxChunk; j += vec::kLanes) {
      const vec::vf v = vec::loadv(x + c + j);
      m = vec::vmax(m, v), nan |= v != v;
    }
    bool any_nan = false, beats = false;
    for (int l = 0; l < vec::kLanes; ++l) any_nan |= nan[l] != 0, beats |= m[l] > best;
    if ((any_nan || beats) && !scan(c, c + kArgmaxChunk)) return at;
  }
  scan(c, V);
  return at;
}

std::tuple<at::Tensor, at::Tensor> greedy_argmax(const at::Tensor& logits) {
  check_rows(logits, "greedy_argmax logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "greedy_argmax: logits must be [n, V] with V > 0");
  const int64_t n = logits.size(0), V = logits.size(1);
  at::Tensor best = at::empty({n}, logits.options().dtype(at::kLong));
  at::Tensor finite = at::empty({n}, logits.options().dtype(at::kBool));
  const float* x = logits.data_ptr<float>();
  int64_t* b = best.data_ptr<int64_t>();
  bool* f = finite.data_ptr<bool>();
  at::parallel_for(0, n, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) b[r] = first_argmax_row(x + r * V, V), f[r] = std::isfinite(x[r * V + b[r]]);
  });
  return {best, finite};
}
}  // namespace

void rms_norm_rows(const float* x, const float* w, float* y, int64_t T, int64_t D, double eps) {
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = x + t * D;
      float part[kPartials] = {};
      int64_t d = 0;
      for (; d + kPartials <= D; d += kPartials)
        for (int j = 0; j < kPartials; ++j) part[j] += row[d + j] * row[d + j];
      for (int j = 0; d < D; ++d, ++j) part[j] += row[d] * row[d];
      float sum = 0.0f;
      for (int j = 0; j < kPartials; ++j) sum += part[j];
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(D) + static_cast<float>(eps));
      for (d = 0; d < D; ++d) y[t * D + d] = row[d] * inv * w[d];
    }
  });
}

void silu_and_mul_rows(const float* x, float* y, int64_t T, int64_t I) {
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) silu_and_mul_row(x + t * 2 * I, x + t * 2 * I + I, y + t * I, I);
  });
}

void rope_rotate_rows(float* x, int64_t T, int64_t H, int64_t D, int64_t row_stride, const float* cos,
                      const float* sin) {
  const int64_t half = D / 2;
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *c = cos + t * D, *s = sin + t * D;
      for (int64_t h = 0; h < H; ++h) {
        float* v = x + t * row_stride + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[i] + -b * s[i];
          v[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}


}  // namespace pagedkv

TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &pagedkv::rms_norm);
  m.def("silu_and_mul(Tensor x) -> Tensor", &pagedkv::silu_and_mul);
  m.def("rope_rotate_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", &pagedkv::rope_rotate_);
  m.def("greedy_argmax(Tensor logits) -> (Tensor, Tensor)", &pagedkv::greedy_argmax);
}
