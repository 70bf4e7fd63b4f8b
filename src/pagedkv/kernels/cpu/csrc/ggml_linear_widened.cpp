// The many-rows path of ggml_linear (prefill chunks, large batches; AVX2 builds, from kBigM
// activation rows on): a task's weights are widened once into fp32 rows, the very values
// ggml_linear.cpp's tiles compute in registers, then multiplied from cache. Those tiles widen
// each block again for every 4 activation rows and stream all M rows past each pair of
// weight rows (44 GFLOP/s at M = 2,048 on an AVX2-only AMD EPYC, family 25). Each output is
// the tiles' own sequence of FMAs over k into one vector accumulator, then the same lane
// sum: the same bits, so batch invariance holds across the two paths.

#pragma GCC optimize("fp-contract=off")

#include "ggml_blocks.h"

#include <algorithm>
#include <vector>

namespace pagedkv {
namespace ggml {
namespace {

#ifdef PAGEDKV_GGML_VECTOR
// The P rows of a panel at w (ggml_linear.cpp's layout) as fp32 rows out[P][K].
template <int64_t Q>
void widen_rows(const uint8_t* w, int64_t P, int64_t K, float* out) {
  constexpr int64_t bb = Q == kQ4_1 ? 20 : 34, hdr = Q == kQ4_1 ? 4 : 2, qsb = bb - hdr;
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const uint8_t* chunk = w + g * P * bb;
    for (int64_t r = 0; r < P; ++r) {
      const Vec dv = splat(half_at(chunk + 2 * r));
      const uint8_t* qs = chunk + hdr * P + qsb * r;
      const auto tab = q4_table(dv, splat(Q == kQ4_1 ? half_at(chunk + 2 * P + 2 * r) : 0.0f));  // Q4_1 only
      for (int p = 0; p < kPieces; ++p) {
        Vec wv;
        if constexpr (Q == kQ4_1) wv = q4_piece(qs, p, tab);
        else wv = mul(q8_piece(qs, p), dv);
        store_x(out + r * K + g * kGroup + p * kStep, wv);
      }
    }
  }
}

// MR activation rows x R widened weight rows (w, row stride K): y[m * N + r].
template <int MR, int R>
inline void dot_tile(const float* x, const float* w, int64_t K, float* y, int64_t N) {
  Vec acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = zero();
  for (int64_t k = 0; k < K; k += kStep) {
    Vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = load_x(w + r * K + k);
    for (int m = 0; m < MR; ++m) {
      const Vec xv = load_x(x + m * K + k);
      for (int r = 0; r < R; ++r) acc[m][r] = fma(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) y[m * N + r] = lane_sum(acc[m][r]);
}

template <int64_t Q>
void widened_task(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t row_bytes, int64_t n0,
                  int64_t n1, float* y, int64_t N, float* buf) {
  for (int64_t n = n0; n < n1; n += kPanel)
    widen_rows<Q>(w + n * row_bytes, std::min(kPanel, n1 - n), K, buf + (n - n0) * K);
  // 3 activation rows x 4 weight rows (12 accumulators of 16 registers), the activation
  // rows held in L1 while the task's widened rows stream past them from L2.
  constexpr int MR = 3, R = 4;
  int64_t m = 0;
  for (; m < M; m += MR) {
    const int64_t mr = std::min<int64_t>(MR, M - m);
    int64_t r = n0;
    for (; r + R <= n1; r += R) {
      const float* wr = buf + (r - n0) * K;
      if (mr == MR) dot_tile<MR, R>(x + m * K, wr, K, y + m * N + r, N);
      else
        for (int64_t i = 0; i < mr; ++i) dot_tile<1, R>(x + (m + i) * K, wr, K, y + (m + i) * N + r, N);
    }
    for (; r < n1; ++r)
      for (int64_t i = 0; i < mr; ++i) dot_tile<1, 1>(x + (m + i) * K, buf + (r - n0) * K, K, y + (m + i) * N + r, N);
  }
}
#endif

}  // namespace

void ggml_linear_widened(const float* x, const uint8_t* w, int64_t qtype, float* y, int64_t M, int64_t K, int64_t N) {
#ifdef PAGEDKV_GGML_VECTOR
  const int64_t tasks = (N + kRowsPerTask - 1) / kRowsPerTask, row_bytes = K / kGroup * block_bytes(qtype);
#pragma omp parallel if (tasks > 1)
  {
    std::vector<float> buf(kRowsPerTask * K);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t n0 = t * kRowsPerTask, n1 = std::min(N, n0 + kRowsPerTask);
      if (qtype == kQ4_1) widened_task<kQ4_1>(x, M, K, w, row_bytes, n0, n1, y, N, buf.data());
      else widened_task<kQ8_0>(x, M, K, w, row_bytes, n0, n1, y, N, buf.data());
    }
  }
#else
  (void)x, (void)w, (void)qtype, (void)y, (void)M, (void)K, (void)N;
#endif
}

}  // namespace ggml
}  // namespace pagedkv
