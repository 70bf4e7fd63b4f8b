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
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagedkv {
namespace {

constexpr int64_t kGroup = 32;        // weights per block
constexpr int64_t kQ4_1 = 3, kQ8_0 = 8;  // ggml_type values
constexpr int64_t kRowsPerTask = 64;  // output channels per parallel task
constexpr int64_t kPanel = 8;         // rows whose blocks are interleaved (see the header)

inline int64_t block_bytes(int64_t qtype) { return qtype == kQ4_1 ? 20 : 34; }

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; c10::Half converts in software
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#if defined(__AVX512F__)
constexpr int kStep = 16;
using Vec = __m512;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load_x(const float* p) { return _mm512_loadu_ps(p); }
inline void store_x(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec splat(float v) { return _mm512_set1_ps(v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
// Piece p (0, 1) of a Q4_1 block, weights 16p .. 16p + 15 (all 16 bytes' low or high
// nibbles), looked up in the block's table of its 16 values d * q + m: the permute reads
// only an index's low 4 bits, so the low nibbles need no mask.
inline Vec q4_piece(const uint8_t* qs, int p, Vec table) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm512_permutexvar_ps(p == 0 ? v : _mm512_srli_epi32(v, 4), table);
}
inline Vec q4_table(Vec d, Vec m) {
  return fma(d, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), m);
}
inline Vec q8_piece(const uint8_t* qs, int p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16 * p))));
}
inline float lane_sum(Vec v) {  // fixed tree: halves, then quarters, ...
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}
#else
constexpr int kStep = 8;
using Vec = __m256;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load_x(const float* p) { return _mm256_loadu_ps(p); }
inline void store_x(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec splat(float v) { return _mm256_set1_ps(v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
// Piece p (0..3) of a Q4_1 block: weights 8p .. 8p + 7: bytes 8 (p % 2) .. + 7, low
// nibbles for p < 2, high ones after.
inline Vec q4_piece_q(const uint8_t* qs, int p) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * (p & 1))));
  const __m256i n = p < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(0xF)) : _mm256_srli_epi32(v, 4);
  return _mm256_cvtepi32_ps(n);
}
struct Q4Table { Vec d, m; };  // AVX2 widens and scales: an 8-entry permute cannot hold 16 values
inline Q4Table q4_table(Vec d, Vec m) { return {d, m}; }
inline Vec q4_piece(const uint8_t* qs, int p, Q4Table t) { return fma(t.d, q4_piece_q(qs, p), t.m); }
inline Vec q8_piece(const uint8_t* qs, int p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * p))));
}
inline float lane_sum(Vec v) {
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}
#endif
constexpr int kPieces = kGroup / kStep;
constexpr int64_t kPrefetch = 256;  // bytes ahead in each weight row


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
  for (; m < M; ++m) tile<Q, R, 1>(x + m * K, K, w, P, r0, y + m * N + r0, N);
}

// The rows of one panel (P <= 8 rows at w; y points at its first output): 8 at once for few
// activation rows, else 4 (AVX2: 2) at a time with each widened weight reused by four activation rows.
template <int64_t Q>
void panel_rows(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t P, float* y, int64_t N) {
  int64_t r = 0;
  if (M < 4 && P == kPanel) {
    rows<Q, 8, 1>(x, M, K, w, P, 0, y, N);
    return;
  }
  // AVX2: 2 rows x 4 activation rows of accumulators (4 x 4 filled all 16 registers and
  // spilled): products at 64 rows 1.3x faster on an AVX2-only AMD EPYC (family 25).
  constexpr int kR = kStep == 8 ? 2 : 4;
  if (M >= 4)
    for (; r + kR <= P; r += kR) rows<Q, kR, 4>(x, M, K, w, P, r, y, N);
  for (; r < P; ++r) rows<Q, 1, 4>(x, M, K, w, P, r, y, N);
}

// Many activation rows (prefill chunks, large batches): a task's weights are widened once
// into fp32 rows (the very values the tiles above compute in registers), then multiplied
// from cache (the tiles above widen each block again for every 4 activation rows, and
// stream all M rows past each pair of weight rows: 44 GFLOP/s at M = 2,048). An output's sequence of FMAs is the tiles' own: the same bits.
constexpr int64_t kBigM = 12; // activation rows from which the widened path is taken

template <int64_t Q>
void widen_rows(const uint8_t* w, int64_t P, int64_t K, float* out) {
  constexpr int64_t bb = Q == kQ4_1 ? 20 : 34, hdr = Q == kQ4_1 ? 4 : 2, qsb = bb - hdr;
  for (int64_t g = 0; g < K / kGroup; ++g) {
    const uint8_t* chunk = w + g * P * bb;
    for (int64_t r = 0; r < P; ++r) {
      const Vec dv = splat(half_at(chunk + 2 * r));
      const uint8_t* qs = chunk + hdr * P + qsb * r;
      for (int p = 0; p < kPieces; ++p) {
        Vec wv;
        if constexpr (Q == kQ4_1) wv = q4_piece(qs, p, q4_table(dv, splat(half_at(chunk + 2 * P + 2 * r))));
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
#define PAGEDKV_GGML_VECTOR 1
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
