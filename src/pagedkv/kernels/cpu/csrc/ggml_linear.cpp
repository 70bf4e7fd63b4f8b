// Linear layer over GGML block-quantized weights, kept quantized: y[M, N] = x[M, K] . W^T.
//
// Registers torch.ops.pagedkv.ggml_linear(x, blocks, qtype) -> y. ``blocks`` is uint8
// [N, K / 32 * block_bytes]: the bytes of a GGUF file's blocks (ggml-common.h, block_q4_1
// and block_q8_0), rearranged into panels as described below (GGMLWeight.packed; the
// file's row-major order gives wrong results):
//   Q4_1 (qtype 3), 20 bytes per 32 weights: fp16 d, fp16 m, 16 bytes of nibbles; byte j's
//        low nibble is weight j and its high nibble weight j + 16; w = d * q + m.
//   Q8_0 (qtype 8), 34 bytes per 32 weights: fp16 d, 32 int8 q; w = d * q.
// The rows are stored in panels of 8 (the last one holds N % 8 rows if that is not 0),
// each read as one sequential stream: for g = 0, 1, ..., a panel of P rows holds the P
// fp16 scales of its rows' block g, then (Q4_1) their P fp16 minimums, then their P quant
// arrays (16 or 32 bytes), so P scales convert to fp32 in one instruction. GGMLWeight packs
// the file's row-major blocks so at load; the bytes are the file's, rearranged.
// Each block is widened in registers to the fp32 values gguf-py's dequantize gives (the
// product, then the sum, each rounded once: this file is compiled without FMA contraction),
// and multiplied with the fp32 activations: a decode step reads 0.625 (Q4_1) or 1.0625
// (Q8_0) bytes per weight, the results are those of an fp32 product over the dequantized
// weights up to summation order, and no activation is quantized.
//
// Batch invariance by construction, as in int8_linear.cpp: output (m, n) is always the same
// sequence of FMAs over k in order into its own vector accumulator, then a fixed lane sum.

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "ggml_blocks.h"

namespace pagedkv {
namespace {

using namespace ggml;  // NOLINT: the block formats and vector helpers

// The 32 weights of one block as fp32 (the scalar path and the reference for the vector one).
void dequantize_block(const uint8_t* b, int64_t qtype, float* w) {
  const float d = half_at(b);
  if (qtype == kQ4_1) {
    const float m = half_at(b + 2);
    for (int j = 0; j < 16; ++j) {
      w[j] = d * static_cast<float>(b[4 + j] & 0xF) + m;
      w[j + 16] = d * static_cast<float>(b[4 + j] >> 4) + m;
    }
  } else {
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(static_cast<int8_t>(b[2 + j])) * d;
  }
}

#ifdef PAGEDKV_GGML_VECTOR
// R fp16 values at p (consecutive) as fp32 in out.
template <int R>
inline void halves(const uint8_t* p, float* out) {
  if constexpr (R == 8) _mm256_storeu_ps(out, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  else if constexpr (R == 4) _mm_storeu_ps(out, _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  else
    for (int r = 0; r < R; ++r) out[r] = half_at(p + 2 * r);
}

// Rows r0 .. r0 + R - 1 of a panel of P rows at w, against MR activation rows; accumulators
// in registers; K % 32 == 0.
template <int64_t Q, int R, int MR>
void tile(const float* x, int64_t K, const uint8_t* w, int64_t P, int64_t r0, float* y, int64_t N) {
  constexpr int64_t bb = Q == kQ4_1 ? 20 : 34, hdr = Q == kQ4_1 ? 4 : 2, qsb = bb - hdr;
  Vec acc[MR][R];
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = zero();
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const uint8_t* chunk = w + g * P * bb;  // P scales, (P minimums,) P quant arrays
    const uint8_t* qs = chunk + hdr * P + qsb * r0;
    _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetch), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetch + 64), _MM_HINT_T0);
    // Each piece as the fp32 weights it stands for: d * q + m (Q4_1) or q * d (Q8_0), each
    // operation rounded once, as gguf-py computes them. Q4_1 takes one FMA for both: d (fp16,
    // 11 significant bits) times q (4 bits) is exact in fp32, so rounding d * q + m once is
    // rounding fl(d * q) + m.
    float d[R], mn[R];
    halves<R>(chunk + 2 * r0, d);
    if constexpr (Q == kQ4_1) halves<R>(chunk + 2 * P + 2 * r0, mn);
    if constexpr (kStep == 8 && MR == 1) {
      // AVX2 (16 registers): one row's whole block at a time, so that only the R accumulators
      // stay live; piece by piece across the rows also kept R tables and GCC spilled
      // accumulators to the stack. Each output's own sequence of FMAs is the same either way.
      // With the one-FMA widening above: a single-stream step's 121 products 7.1 ms instead of
      // 8.5 (AMD EPYC family 25, AVX2 only, medians of 5 alternating runs).
      for (int r = 0; r < R; ++r) {
        const Vec dv = splat(d[r]);
        for (int p = 0; p < kPieces; ++p) {
          Vec wv;
          if constexpr (Q == kQ4_1) wv = q4_piece(qs + r * qsb, p, q4_table(dv, splat(mn[r])));
          else wv = mul(q8_piece(qs + r * qsb, p), dv);
          acc[0][r] = fma(load_x(x + g * kGroup + p * kStep), wv, acc[0][r]);
        }
      }
      continue;
    }
    decltype(q4_table(zero(), zero())) tab[Q == kQ4_1 ? R : 1];
    if constexpr (Q == kQ4_1)
      for (int r = 0; r < R; ++r) tab[r] = q4_table(splat(d[r]), splat(mn[r]));
    for (int p = 0; p < kPieces; ++p) {
      Vec wv[R];
      for (int r = 0; r < R; ++r) {
        if constexpr (Q == kQ4_1) wv[r] = q4_piece(qs + r * qsb, p, tab[r]);
        else wv[r] = mul(q8_piece(qs + r * qsb, p), splat(d[r]));
      }
      const int64_t k = g * kGroup + p * kStep;
      for (int m = 0; m < MR; ++m) {
        const Vec xv = load_x(x + m * K + k);
        for (int r = 0; r < R; ++r) acc[m][r] = fma(xv, wv[r], acc[m][r]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < R; ++r) y[m * N + r] = lane_sum(acc[m][r]);
}

// Rows r0 .. r0 + R - 1 against every activation row, MR rows at a time; the blocking never
// changes an output's own sequence of FMAs.
template <int64_t Q, int R, int MR>
void rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t P, int64_t r0, float* y, int64_t N) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile<Q, R, MR>(x + m * K, K, w, P, r0, y + m * N + r0, N);
  // The last two or three rows in one tile, so they too share each widened weight: one by
  // one, 7 activation rows had cost more than 8 (39.6 vs 33.2 ms; 27.5 vs 30.7 in one tile).
  const int64_t left = M - m;
  if (MR > 3 && left == 3) tile<Q, R, (MR > 3 ? 3 : 1)>(x + m * K, K, w, P, r0, y + m * N + r0, N);
  else if (MR > 2 && left == 2) tile<Q, R, (MR > 2 ? 2 : 1)>(x + m * K, K, w, P, r0, y + m * N + r0, N);
  else
    for (; m < M; ++m) tile<Q, R, 1>(x + m * K, K, w, P, r0, y + m * N + r0, N);
}

// From this many activation rows on, a panel's weights are widened once per tile of up to
// four activation rows; below it, once per row, eight weight rows at a time. AVX2 from 2
// (all 30 layers' products of SmolLM2 at 2 / 3 rows: 14.8 / 20.6 -> 11.4 / 14.0 ms on an AMD
// EPYC family 25, where 3 rows had cost more than 4); AVX-512 from 4, as measured before
// (its one-permute widening is cheaper; the 2-3 row tiles are not measured there).
constexpr int64_t kFewRowsTiled = kStep == 8 ? 2 : 4;

// The rows of one panel (P <= 8 rows at w; y points at its first output): 8 at once for few
// activation rows, else 4 (AVX2: 2) at a time with each widened weight reused by up to four
// activation rows.

template <int64_t Q>
void panel_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t P, float* y, int64_t N) {
  int64_t r = 0;
  if (M < kFewRowsTiled && P == kPanel) {
    rows<Q, 8, 1>(x, M, K, w, P, 0, y, N);
    return;
  }
  // AVX2: 2 rows x 4 activation rows of accumulators (4 x 4 filled all 16 registers and
  // spilled): products at 64 rows 1.3x faster on an AVX2-only AMD EPYC (family 25).
  constexpr int kR = kStep == 8 ? 2 : 4;
  if (M >= kFewRowsTiled)
    for (; r + kR <= P; r += kR) rows<Q, kR, 4>(x, M, K, w, P, r, y, N);
  for (; r < P; ++r) rows<Q, 1, 4>(x, M, K, w, P, r, y, N);
}

#endif

void scalar_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t qtype, int64_t P, float* y,
                 int64_t N) {
  const int64_t bb = block_bytes(qtype), hdr = qtype == kQ4_1 ? 4 : 2, qsb = bb - hdr;
  uint8_t block[34];
  float wf[kGroup];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t r = 0; r < P; ++r) {
      float acc = 0.0f;
      for (int64_t g = 0; g < K / kGroup; ++g) {
        const uint8_t* chunk = w + g * P * bb;  // reassemble the GGUF block, then widen it
        std::memcpy(block, chunk + 2 * r, 2);
        if (qtype == kQ4_1) std::memcpy(block + 2, chunk + 2 * P + 2 * r, 2);
        std::memcpy(block + hdr, chunk + hdr * P + qsb * r, qsb);
        dequantize_block(block, qtype, wf);
        for (int64_t j = 0; j < kGroup; ++j) acc += x[m * K + g * kGroup + j] * wf[j];
      }
      y[m * N + r] = acc;
    }
}

void ggml_linear_cpu(const float* x, const uint8_t* w, int64_t qtype, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t tasks = (N + kRowsPerTask - 1) / kRowsPerTask, row_bytes = K / kGroup * block_bytes(qtype);
#ifdef PAGEDKV_GGML_VECTOR
  if (kStep == 8 && M >= kBigM) {
    ggml_linear_widened(x, w, qtype, y, M, K, N);
    return;
  }
#endif
#pragma omp parallel for schedule(static) if (tasks > 1 && M * N * K >= (1 << 18))
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t n1 = std::min(N, (t + 1) * kRowsPerTask);
    for (int64_t n = t * kRowsPerTask; n < n1; n += kPanel) {
      const int64_t P = std::min(kPanel, N - n);
#ifdef PAGEDKV_GGML_VECTOR
      if (qtype == kQ4_1) panel_rows<kQ4_1>(x, M, K, w + n * row_bytes, P, y + n, N);
      else panel_rows<kQ8_0>(x, M, K, w + n * row_bytes, P, y + n, N);
#else
      scalar_rows(x, M, K, w + n * row_bytes, qtype, P, y + n, N);
#endif
    }
  }
}

at::Tensor ggml_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  TORCH_CHECK(x.device().is_cpu() && blocks.device().is_cpu(), "ggml_linear: CPU tensors");
  TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "ggml_linear: qtype must be 3 (Q4_1) or 8 (Q8_0), got ", qtype);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "ggml_linear: x must be contiguous float32 [M, K]");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % kGroup == 0, "ggml_linear: K = ", K, " is not a multiple of 32");
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous() &&
              blocks.size(1) % block_bytes(qtype) == 0,
              "ggml_linear: blocks must be contiguous uint8 [N, K / 32 * ", block_bytes(qtype), "] (panels, "
              "as GGMLWeight.packed holds them)");
  TORCH_CHECK(blocks.size(1) == K / kGroup * block_bytes(qtype), "ggml_linear: x has ", K,
              " features per row but the weight rows have ", blocks.size(1) / block_bytes(qtype) * kGroup);
  at::Tensor y = at::empty({x.size(0), blocks.size(0)}, x.options());
  at::internal::lazy_init_num_threads();  // this thread's OpenMP team size = torch.get_num_threads()
  ggml_linear_cpu(x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), qtype, y.data_ptr<float>(), x.size(0), K,
                  blocks.size(0));
  return y;
}

}  // namespace

at::Tensor ggml_linear_fn(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype) {
  return ggml_linear(x, blocks, qtype);
}

}  // namespace pagedkv

TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("ggml_linear(Tensor x, Tensor blocks, int qtype) -> Tensor", &pagedkv::ggml_linear);
}
