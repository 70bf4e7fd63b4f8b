// Weight-only int8 linear layer: y[M, N] = x[M, K] . (q[N, K] * scale[N])^T, fp32 activations.
//
// Registers torch.ops.pagedkv.int8_linear(x, q, scale) -> y. The weights are int8 with one
// fp32 scale per output channel (symmetric); each 16 (AVX-512) or 8 (AVX2) int8 values are
// widened to fp32 in registers and multiplied with fp32 activations, so a decode step reads
// one byte per weight instead of four, and no activation is quantized.
//
// Batch invariance by construction: output (m, n) is always the same sequence of FMAs over
// k in order into its own vector accumulator, then a fixed lane sum, times scale[n]. Which
// other rows share the call (M), how rows are blocked, and the thread count (each output is
// computed by exactly one thread) change nothing.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedkv {
namespace {

#if defined(__AVX512F__)
constexpr int64_t kStep = 16;
using Vec = __m512;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load_x(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load_w(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float lane_sum(Vec v) {  // fixed tree: halves, then quarters, ...
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));  // AVX512F only
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kStep = 8;
using Vec = __m256;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load_x(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load_w(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float lane_sum(Vec v) {
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}
#else
constexpr int64_t kStep = 0;  // no vector path: the scalar loop below
#endif

constexpr int64_t kRowsPerTask = 64;  // output channels per parallel task

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// R output channels x MR activation rows, accumulators in registers: vectors over the first
// K - K % kStep inputs, then the lane sum, then the last K % kStep products one by one.
template <int R, int MR>
void tile(const float* x, int64_t K, const int8_t* w, const float* scale, float* y, int64_t N) {
  const int64_t kv = K - K % kStep;
  Vec acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = zero();
  for (int64_t k = 0; k < kv; k += kStep) {
    Vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_w(w + r * K + k);
    for (int m = 0; m < MR; ++m) {
      const Vec xv = load_x(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = fma(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) {
      float sum = lane_sum(acc[m][r]);
      for (int64_t k = kv; k < K; ++k) sum += x[m * K + k] * static_cast<float>(w[r * K + k]);
      y[m * N + r] = sum * scale[r];
    }
}

// R output channels against every activation row, MR rows at a time (R * MR accumulators
// and R widened weights stay in registers). The blocking never changes an output's own
// sequence of FMAs, so it may depend on M.
template <int R, int MR>
void rows(const float* x, int64_t M, int64_t K, const int8_t* w, const float* scale, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile<R, MR>(x + m * K, K, w, scale, y + m * N, N);
  for (; m < M; ++m) tile<R, 1>(x + m * K, K, w, scale, y + m * N, N);
}
#endif

void scalar_rows(const float* x, int64_t M, int64_t K, const int8_t* w, int64_t nrows, const float* scale,
                 float* y, int64_t N) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < nrows; ++r) {
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * static_cast<float>(w[r * K + k]);
      y[m * N + r] = acc * scale[r];
    }
}

void int8_linear_cpu(const float* x, const int8_t* q, const float* scale, float* y, int64_t M, int64_t K,
                     int64_t N) {
  const int64_t tasks = (N + kRowsPerTask - 1) / kRowsPerTask;
#pragma omp parallel for schedule(static) if (tasks > 1 && M * N * K >= (1 << 18))
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n0 = t * kRowsPerTask, n1 = std::min(N, n0 + kRowsPerTask);
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
    {
      int64_t n = n0;
      if (M < 4)  // few rows: more output channels at once (independent FMA chains)
        for (; n + 8 <= n1; n += 8) rows<8, 1>(x, M, K, q + n * K, scale + n, y + n, N);
      else  // more rows: each widened weight reused by four rows
        for (; n + 4 <= n1; n += 4) rows<4, 4>(x, M, K, q + n * K, scale + n, y + n, N);
      for (; n < n1; ++n) rows<1, 4>(x, M, K, q + n * K, scale + n, y + n, N);
      continue;
    }
#endif
    scalar_rows(x, M, K, q + n0 * K, n1 - n0, scale + n0, y + n0, N);
  }
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && scale.device().is_cpu(), "int8_linear: CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "int8_linear: x must be contiguous float32 [M, K]");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.is_contiguous() && q.size(1) == x.size(1),
              "int8_linear: q must be contiguous int8 [N, K] with K = x.size(1) = ", x.size(1));
  TORCH_CHECK(scale.dim() == 1 && scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
              scale.size(0) == q.size(0), "int8_linear: scale must be contiguous float32 [N]");
  at::Tensor y = at::empty({x.size(0), q.size(0)}, x.options());
  at::internal::lazy_init_num_threads();  // this thread's OpenMP team size = torch.get_num_threads()
  int8_linear_cpu(x.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), y.data_ptr<float>(),
                  x.size(0), x.size(1), q.size(0));
  return y;
}

}  // namespace

at::Tensor int8_linear_fn(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale) {
  return int8_linear(x, q, scale);
}

}  // namespace pagedkv

TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("int8_linear(Tensor x, Tensor q, Tensor scale) -> Tensor", &pagedkv::int8_linear);
}
