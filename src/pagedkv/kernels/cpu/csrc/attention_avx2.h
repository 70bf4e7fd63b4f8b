// AVX2 micro-kernels of the CPU paged-attention kernel (paged_attention_kernel.cpp), used
// only when it is built for AVX2 without AVX-512 (PAGEDKV_AVX2_ONLY, vec.h), in ymm
// registers throughout: GCC moves 16-float generic vectors through the stack on AVX2. The
// row-by-row path (Kernel::score_scaled, softmax_update, accumulate) and the prefill-tile
// path (update_tile_page) give each (query head, key) score and each (query head, dimension)
// output lane the same sequence of rounded operations, so a row's bits do not depend on
// whether it runs alone (decode) or in a prefill tile. Kernel::accumulate repeats the PV
// rule below in its own loop: change both together.
//   score(q, k_j) = ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)), then * scale, where
//   p_l = q_l k_l, then p_l = fma(q_{l+8}, k_{l+8}, p_l), ... (one ymm lane, dimensions in order);
//   acc = acc * alpha, then acc = fma(p_j, v_j, acc) for keys j in order (lane-wise);
//   page max and exp-sum: the lane operations and sum tree of the 16-lane generic code.
// Shapes: q [D] (D = 16 NV floats), keys and values `stride` floats apart.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "vec.h"

namespace pagedkv {
namespace avx2 {

using vec::vf8;

// The largest of a page's scores s[0..bspad) (bspad a multiple of 16), a ymm at a time.
inline float page_max(const float* s, int64_t bspad) {
  vf8 mx8 = vec::load8(s);
  for (int64_t c = 8; c < bspad; c += 8) mx8 = vec::vmax8(mx8, vec::load8(s + c));
  return vec::hmax8(mx8);
}

// s <- e^(s - m) for a page's scores; returns their sum (a fixed lane-wise tree: the same
// lane operations and sum tree as the 16-lane code, halves of vf lanes).
inline float page_exp_sum(float* s, float m, int64_t bspad) {
  for (int64_t c = 0; c < bspad; c += 8) vec::store8(s + c, vec::exp_nonpos8(vec::load8(s + c) - m));
  vf8 p_lo = vec::load8(s), p_hi = vec::load8(s + 8);
  for (int64_t c = vec::kLanes; c < bspad; c += vec::kLanes) p_lo += vec::load8(s + c), p_hi += vec::load8(s + c + 8);
  return vec::hsum8(p_lo + p_hi);
}

// Scaled scores of keys j0..j0+15 (keys >= n repeat key n-1) against one query head q into
// out[0..15]: the query held in registers, eight keys folded at a time.
template <int NV>
inline void dot16(const float* q, const float* k, int64_t j0, int64_t n, int64_t stride, float scale_,
                  float* out) {
  const __m256 scale = _mm256_set1_ps(scale_);
  __m256 qv[2 * NV];  // the query, loaded once for the 16 keys
  for (int c = 0; c < 2 * NV; ++c) qv[c] = _mm256_loadu_ps(q + c * 8);
  for (int g8 = 0; g8 < 2; ++g8) {
    __m256 s[8];
    for (int t = 0; t < 8; ++t) {
      const float* kj = k + std::min<int64_t>(j0 + 8 * g8 + t, n - 1) * stride;
      s[t] = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kj));
      for (int c = 1; c < 2 * NV; ++c) s[t] = _mm256_fmadd_ps(qv[c], _mm256_loadu_ps(kj + c * 8), s[t]);
    }
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
    const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
    _mm256_storeu_ps(out + 8 * g8, _mm256_mul_ps(sum, scale));
  }
}

// o[t] = o[t] * alpha[t] + sum_j p[t][j] v_j over keys 0..bs-1 for NP (row, head) pairs
// (p[t]: probabilities, o[t]: accumulator [D]), two ymm columns per pass: 2 x NP accumulators
// and two V loads per key.
template <int NV, int NP>
inline void accumulate_pairs(const float* const* p, const float* alpha, float* const* o, const float* v,
                             int64_t stride, int64_t bs) {
  for (int c0 = 0; c0 < 2 * NV; c0 += 2) {
    __m256 r[NP][2];
    for (int t = 0; t < NP; ++t) {
      const __m256 a = _mm256_set1_ps(alpha[t]);
      for (int c = 0; c < 2; ++c) r[t][c] = _mm256_mul_ps(_mm256_loadu_ps(o[t] + (c0 + c) * 8), a);
    }
    for (int64_t j = 0; j < bs; ++j) {
      const __m256 v0 = _mm256_loadu_ps(v + j * stride + c0 * 8), v1 = _mm256_loadu_ps(v + j * stride + c0 * 8 + 8);
      for (int t = 0; t < NP; ++t) {
        const __m256 pj = _mm256_broadcast_ss(p[t] + j);
        r[t][0] = _mm256_fmadd_ps(pj, v0, r[t][0]);
        r[t][1] = _mm256_fmadd_ps(pj, v1, r[t][1]);
      }
    }
    for (int t = 0; t < NP; ++t)
      for (int c = 0; c < 2; ++c) _mm256_storeu_ps(o[t] + (c0 + c) * 8, r[t][c]);
  }
}

}  // namespace avx2
}  // namespace pagedkv
