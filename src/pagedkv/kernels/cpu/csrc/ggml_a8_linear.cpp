// GGML block weights times int8 activations (llama.cpp's CPU scheme): y[M, N] = x[M, K] . W^T.
//
// Registers torch.ops.pagedkv.ggml_a8_linear(x, packed, qtype, n) -> y [M, n], x fp32 [M, K]
// (pagedkv/model/ggml_a8.py documents the recipe and holds its torch reference):
//   1. each row of x is quantized per block of 32 values: dx = amax / 127 (1 where that is
//      0; NaN for a block holding a NaN or infinity: its row's output is then NaN),
//      xq = round-half-even(x / dx) in [-127, 127], sq = sum of the block's xq;
//   2. per weight block b, the exact integer dot isum = sum_j xq_j q_j (q: Q4_1's nibbles
//      0..15, Q8_0's int8 values);
//   3. y = sum over b in order of float(isum) * (d_b * dx_b)   [Q4_1: + sum over b in order
//      of m_b * (dx_b * sq_b), added last], each multiplication and addition rounded once
//      (this file is compiled without FMA contraction).
// Every output is a fixed function of its own row: batch-invariant, and the same bits on
// AVX2 and AVX-512 VNNI CPUs and in the torch reference.
//
// `packed` is uint8 [ceil(n / 16), K / 32 * 16 * block_bytes]: panels of 16 output channels
// (padding channels have zero blocks); for each block b a panel holds its channels' 16 fp16
// scales d, (Q4_1) their 16 fp16 minimums m, then the quants in 64-byte chunks whose byte
// 4r + i belongs to channel r:
//   Q4_1, chunk c (0..3): low nibble q[r, 32b + 8c + i], high nibble q[r, 32b + 8c + 4 + i];
//   Q8_0, chunk c (0..7): int8 q[r, 32b + 4c + i].
// So one 64-byte load feeds 16 channels' 4-weight dot products (vpdpbusd on AVX-512 VNNI:
// unsigned weight bytes times signed activations; Q8_0 weights go in as q + 128 (xor 0x80)
// and 128 * sq comes off; AVX2: vpmaddubsw, then vpmaddwd with ones: Q4_1 as nibbles times
// xq, summed in int16 over the block and widened once, Q8_0 as |q| times sign(xq, q), whose
// pair sums stay below 2^15, widened per chunk). AVX2 keeps one integer chain per (row, half
// panel) and pins each step of it (see `pinned`); VNNI keeps two, so that consecutive
// vpdpbusd do not wait on each other's 5-cycle latency.

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedkv {
namespace {

constexpr int64_t kGroup = 32, kLanes = 16;
constexpr int64_t kQ4_1 = 3, kQ8_0 = 8;
inline int64_t block_bytes(int64_t qtype) { return qtype == kQ4_1 ? 20 : 34; }

#if defined(__AVX2__)
// Step 1 for one row: xq, dx and sq per block, eight values a vector (a scalar loop took 1.2-2.9
// ns per value here, ~8% of a 64-row decode step). Every operation is the recipe's, rounded as
// the scalar form rounds it: the division v / dx is IEEE's in each lane, vroundps rounds half
// to even as nearbyint does, and the block's maximum and integer sum do not depend on order.
void quantize_row(const float* x, int64_t K, int8_t* xq, float* dx, int32_t* sq) {
  const __m256 zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.0f);
  const __m256 hi = _mm256_set1_ps(127.0f), lo = _mm256_set1_ps(-127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t b = 0; b < K / kGroup; ++b) {
    const float* v = x + b * kGroup;
    __m256 a[4], amax = zero, finite = _mm256_cmp_ps(zero, zero, _CMP_EQ_OQ);
    for (int i = 0; i < 4; ++i) {
      a[i] = _mm256_loadu_ps(v + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, a[i]));
      finite = _mm256_and_ps(finite, _mm256_cmp_ps(_mm256_mul_ps(a[i], zero), zero, _CMP_EQ_OQ));  // NaN for inf, NaN
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float top = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    float d = top / 127.0f;
    if (!(d > 0.0f)) d = 1.0f;
    dx[b] = d;
    if (_mm256_movemask_ps(finite) != 0xFF) {  // a NaN or infinity: the block's dx is NaN
      dx[b] = NAN;
      std::memset(xq + b * kGroup, 0, kGroup);
      sq[b] = 0;
      continue;
    }
    const __m256 dv = _mm256_set1_ps(d);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 r = _mm256_round_ps(_mm256_div_ps(a[i], dv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      q[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
    }
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + b * kGroup), _mm256_permutevar8x32_epi32(bytes, order));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    sq[b] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
  }
}
#endif

#if defined(__AVX2__)
#define PAGEDKV_GGML_A8 1
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
using IVec = __m512i;  // one panel: 16 int32 lanes
using FVec = __m512;
constexpr int kHalves = 1;
inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec iload(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline IVec bcast(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
inline IVec lo_nibbles(IVec v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0F)); }
inline IVec hi_nibbles(IVec v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(0x0F)); }
inline IVec dot_u(IVec acc, IVec w, IVec x) { return _mm512_dpbusd_epi32(acc, w, x); }  // w unsigned
inline IVec q4_widen(IVec a) { return a; }
#ifndef PAGEDKV_A8_CHAINS
#define PAGEDKV_A8_CHAINS 2
#endif
constexpr int kChains = PAGEDKV_A8_CHAINS;  // integer accumulators per (row, panel): 1 or 2
inline IVec q8_operand(IVec w) { return _mm512_xor_si512(w, _mm512_set1_epi8(static_cast<char>(0x80))); }
inline IVec dot_q8(IVec acc, IVec w, IVec x) { return _mm512_dpbusd_epi32(acc, w, x); }  // w = q + 128
constexpr int32_t kQ8Bias = 128;
inline IVec iadd(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline IVec isub_splat(IVec a, int32_t v) { return _mm512_sub_epi32(a, _mm512_set1_epi32(v)); }
inline FVec to_float(IVec v) { return _mm512_cvtepi32_ps(v); }
inline FVec fzero() { return _mm512_setzero_ps(); }
inline FVec fsplat(float v) { return _mm512_set1_ps(v); }
inline FVec fmul(FVec a, FVec b) { return _mm512_mul_ps(a, b); }
inline FVec fadd(FVec a, FVec b) { return _mm512_add_ps(a, b); }
inline FVec halves16(const uint8_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void fstore(float* p, FVec v) { _mm512_storeu_ps(p, v); }
#else
using IVec = __m256i;  // half a panel: 8 int32 lanes
using FVec = __m256;
constexpr int kHalves = 2;
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec iload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline IVec bcast(const int8_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
inline IVec lo_nibbles(IVec v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline IVec hi_nibbles(IVec v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }
inline IVec pairs(IVec p16) { return _mm256_madd_epi16(p16, _mm256_set1_epi16(1)); }
// An empty asm that claims to change v: the sums below stay one chain, in program order. Without
// it GCC reassociates a block's 32 integer additions per (row, half) into a tree, computes every
// vpmaddubsw first and spills them to the stack (a store and a reload each); with it the 120
// layer products of a 64-row decode step ran 1.35-1.4x faster and the Q8_0 LM head ~2x (AMD
// EPYC family 25, BENCHMARKS.md). Integer sums are exact in any order: the bits do not change.
inline IVec pinned(IVec v) {
  asm("" : "+x"(v));
  return v;
}
// Q4_1 sums stay in int16 lanes for a whole block and are widened once: a pair of nibbles
// (0..15) times int8 activations (-127..127) is at most 3,810 in size, and a block adds 8
// such pairs per lane (30,480 < 2^15), so neither vpmaddubsw nor the adds can saturate.
inline IVec dot_u(IVec acc, IVec w, IVec x) { return pinned(_mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x))); }
inline IVec q4_widen(IVec a) { return pairs(a); }
constexpr int kChains = 1;
inline IVec q8_operand(IVec w) { return w; }
inline IVec dot_q8(IVec acc, IVec w, IVec x) {
  return pinned(_mm256_add_epi32(acc, pairs(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)))));
}
constexpr int32_t kQ8Bias = 0;
inline IVec iadd(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec isub_splat(IVec a, int32_t v) { return _mm256_sub_epi32(a, _mm256_set1_epi32(v)); }
inline FVec to_float(IVec v) { return _mm256_cvtepi32_ps(v); }
inline FVec fzero() { return _mm256_setzero_ps(); }
inline FVec fsplat(float v) { return _mm256_set1_ps(v); }
inline FVec fmul(FVec a, FVec b) { return _mm256_mul_ps(a, b); }
inline FVec fadd(FVec a, FVec b) { return _mm256_add_ps(a, b); }
inline FVec halves8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void fstore(float* p, FVec v) { _mm256_storeu_ps(p, v); }
#endif
// Software prefetch, blocks ahead in each panel's stream, into L2 (_MM_HINT_T1), and the
// panels one activation row reads at once. Measured on an AMD EPYC (family 26, AVX-512 VNNI),
// the 121 products of a single-stream step: 4 panels and 8 blocks into L2 ran 4.5-4.9 ms
// against 5.2-6.0 ms with 4 (or 8) blocks into L1 (T0), no better than no prefetch at all;
// later (2026-12-04), one panel at a time (the thread's weights read as one linear stream
// instead of four interleaved ones) with 24 blocks ran them 1.15x faster (54 GB/s, a plain
// sum's rate on 2 cores; 16 and 32 blocks within noise of 24), and 16-row products 1.13x.
// AVX2 keeps four panels (its one integer chain per half panel needs them to hide latency)
// and 8 blocks: not yet measured otherwise on an AVX2-only CPU.
// (benchmarks/ab_ggml_a8_variants.py builds copies with other values through the two macros.)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDKV_A8_DEFAULT_PREFETCH 24
#define PAGEDKV_A8_DEFAULT_ROW_PANELS 1
#else
#define PAGEDKV_A8_DEFAULT_PREFETCH 8
#define PAGEDKV_A8_DEFAULT_ROW_PANELS 4
#endif
#ifndef PAGEDKV_A8_PREFETCH_BLOCKS
#define PAGEDKV_A8_PREFETCH_BLOCKS PAGEDKV_A8_DEFAULT_PREFETCH
#endif
#ifndef PAGEDKV_A8_ROW_PANELS
#define PAGEDKV_A8_ROW_PANELS PAGEDKV_A8_DEFAULT_ROW_PANELS
#endif
#ifndef PAGEDKV_A8_TILE_ROWS
#define PAGEDKV_A8_TILE_ROWS (kHalves == 1 ? 4 : 2)
#endif
// From PAGEDKV_A8_WIDE_MIN_ROWS rows on, VNNI tiles span two panels with one integer chain
// each: a broadcast activation feeds two vpdpbusd, and the chains of two panels hide each
// other's latency. Measured on an AMD EPYC (family 26), a decode step's 121 products
// (ab_ggml_a8_variants.py, medians of 15-20): 64 rows 1.07x, 512 rows 1.07x, 16 rows 0.94x.
#ifndef PAGEDKV_A8_WIDE_PANELS
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDKV_A8_WIDE_PANELS 2
#else
#define PAGEDKV_A8_WIDE_PANELS 1
#endif
#endif
#ifndef PAGEDKV_A8_WIDE_MIN_ROWS
#define PAGEDKV_A8_WIDE_MIN_ROWS 32
#endif
constexpr int64_t kPrefetchBlocks = PAGEDKV_A8_PREFETCH_BLOCKS;
constexpr int kRowPanels = PAGEDKV_A8_ROW_PANELS;
static_assert(kRowPanels == 1 || kRowPanels == 2 || kRowPanels == 4, "one row reads 1, 2 or 4 panels at once");
constexpr int kTileRows = PAGEDKV_A8_TILE_ROWS;  // rows of a batched tile
constexpr int kWidePanels = PAGEDKV_A8_WIDE_PANELS;
constexpr int64_t kWideMinRows = PAGEDKV_A8_WIDE_MIN_ROWS;
constexpr int kMaxTileRows = 8;
static_assert(kTileRows >= 2 && kTileRows <= kMaxTileRows && kWidePanels >= 1 && kWidePanels <= 4, "tile shape");
constexpr int kVec = kLanes / kHalves;      // channels per vector
constexpr int64_t kHalfBytes = 64 / kHalves;  // bytes of a chunk per vector

inline FVec scales(const uint8_t* p, int h) {  // channels h * kVec .. of 16 fp16 at p, as fp32
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  (void)h;
  return halves16(p);
#else
  return halves8(p + 2 * kVec * h);
#endif
}

// Step 1's results for rows 0.. (row-major, K / 32 blocks a row): quants, dx and sq.
struct Acts {
  const int8_t* xq;
  const float* dx;
  const int32_t* sq;
  Acts rows_from(int64_t m, int64_t K) const {
    const int64_t G = K / kGroup;
    return {xq + m * K, dx + m * G, sq + m * G};
  }
};

// Rows m0 .. m0 + MR - 1 of the quantized activations against panels p .. p + NR - 1 at w
// (each `stride` bytes): the integer dots of a block in registers (C chains per row and panel),
// then the scaled sums.
template <int64_t Q, int MR, int NR, int C>
void tile(const Acts& a, int64_t K, const uint8_t* w, int64_t stride, float out[][4][kLanes]) {  // out[MR][NR]
  const int8_t* xq = a.xq;
  const float* dx = a.dx;
  const int32_t* sq = a.sq;
  constexpr int64_t hdr = Q == kQ4_1 ? 64 : 32, pbb = 16 * (Q == kQ4_1 ? 20 : 34);
  constexpr int kChunks = Q == kQ4_1 ? 4 : 8;
  const int64_t G = K / kGroup;
  FVec acc[MR][NR][kHalves], macc[MR][NR][kHalves];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j)
      for (int h = 0; h < kHalves; ++h) acc[r][j][h] = macc[r][j][h] = fzero();
  for (int64_t b = 0; b < G; ++b) {
    for (int j = 0; j < NR; ++j)  // the hardware prefetcher alone runs these short streams below the bus
      for (int64_t off = 0; off < pbb; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * stride + (b + kPrefetchBlocks) * pbb + off), _MM_HINT_T1);
    IVec ia[MR][NR][kHalves][C];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j)
        for (int h = 0; h < kHalves; ++h)
          for (int i = 0; i < C; ++i) ia[r][j][h][i] = izero();
    for (int c = 0; c < kChunks; ++c) {
      for (int j = 0; j < NR; ++j)
        for (int h = 0; h < kHalves; ++h) {
          const IVec v = iload(w + j * stride + b * pbb + hdr + 64 * c + kHalfBytes * h);
          if constexpr (Q == kQ4_1) {
            const IVec lo = lo_nibbles(v), hi = hi_nibbles(v);
            for (int r = 0; r < MR; ++r) {
              const int8_t* xr = xq + r * K + b * kGroup + 8 * c;
              ia[r][j][h][0] = dot_u(ia[r][j][h][0], lo, bcast(xr));
              ia[r][j][h][C - 1] = dot_u(ia[r][j][h][C - 1], hi, bcast(xr + 4));
            }
          } else {
            const IVec q = q8_operand(v);
            for (int r = 0; r < MR; ++r)
              ia[r][j][h][c % C] = dot_q8(ia[r][j][h][c % C], q, bcast(xq + r * K + b * kGroup + 4 * c));
          }
        }
    }
    for (int j = 0; j < NR; ++j)
      for (int h = 0; h < kHalves; ++h) {
        const uint8_t* blk = w + j * stride + b * pbb;
        const FVec d = scales(blk, h);
        for (int r = 0; r < MR; ++r) {
          IVec isum = C == 1 ? ia[r][j][h][0] : iadd(ia[r][j][h][0], ia[r][j][h][C - 1]);
          if constexpr (Q == kQ4_1) isum = q4_widen(isum);
          if constexpr (Q == kQ8_0) isum = isub_splat(isum, kQ8Bias * sq[r * G + b]);
          acc[r][j][h] = fadd(acc[r][j][h], fmul(to_float(isum), fmul(d, fsplat(dx[r * G + b]))));
          if constexpr (Q == kQ4_1) {
            const float sx = dx[r * G + b] * static_cast<float>(sq[r * G + b]);
            macc[r][j][h] = fadd(macc[r][j][h], fmul(scales(blk + 32, h), fsplat(sx)));
          }
        }
      }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j)
      for (int h = 0; h < kHalves; ++h)
        fstore(out[r][j] + h * kVec, Q == kQ4_1 ? fadd(acc[r][j][h], macc[r][j][h]) : acc[r][j][h]);
}

// Panels p .. p + NR - 1 against every row, MR rows at a time; the rows left over go in the
// largest of 4, 2 and 1 rows that fits, except that AVX2's pair tiles end an odd batch in one
// 3-row tile (not a pair and a lone row's own pass over the weights).
template <int64_t Q, int MR, int NR, int C>
void panels(const Acts& acts, const uint8_t* packed, float* y, int64_t M, int64_t K, int64_t N, int64_t p) {
  const int64_t G = K / kGroup, stride = G * 16 * block_bytes(Q);
  alignas(64) float out[kMaxTileRows][4][kLanes];
  for (int64_t m = 0; m < M;) {
    const int64_t left = M - m;
    const Acts a = acts.rows_from(m, K);
    const uint8_t* wp = packed + p * stride;
    int mr;
    if (MR == 2 && left == 3) mr = 3, tile<Q, (MR == 2 ? 3 : 1), NR, C>(a, K, wp, stride, out);  // not 2 + 1
    else if (left >= MR) mr = MR, tile<Q, MR, NR, C>(a, K, wp, stride, out);
    else if (MR > 4 && left >= 4) mr = 4, tile<Q, (MR > 4 ? 4 : 1), NR, C>(a, K, wp, stride, out);
    else if (MR > 2 && left >= 2) mr = 2, tile<Q, (MR > 2 ? 2 : 1), NR, C>(a, K, wp, stride, out);
    else mr = 1, tile<Q, 1, NR, C>(a, K, wp, stride, out);
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < NR; ++j) {
        const int64_t n0 = (p + j) * kLanes, width = std::min<int64_t>(kLanes, N - n0);
        std::memcpy(y + (m + r) * N + n0, out[r][j], width * sizeof(float));
      }
    m += mr;
  }
}

// Tile shapes: one row reads kRowPanels panels at once; more rows reuse each loaded weight
// vector across kTileRows rows (AVX2 has half the registers), over kWidePanels panels at once
// from kWideMinRows rows on. Every shape gives each row the same operations (the same bits).
template <int64_t Q>
void run_task(const Acts& a, const uint8_t* packed, float* y, int64_t M, int64_t K, int64_t N, int64_t p,
              int64_t p1) {
  if (M < 2) {
    for (; p + kRowPanels <= p1; p += kRowPanels) panels<Q, 1, kRowPanels, kChains>(a, packed, y, M, K, N, p);
    for (; p < p1; ++p) panels<Q, 1, 1, kChains>(a, packed, y, M, K, N, p);
    return;
  }
  if (kWidePanels > 1 && M >= kWideMinRows)
    for (; p + kWidePanels <= p1; p += kWidePanels) panels<Q, kTileRows, kWidePanels, 1>(a, packed, y, M, K, N, p);
  for (; p < p1; ++p) panels<Q, kTileRows, 1, kChains>(a, packed, y, M, K, N, p);
}

void ggml_a8_cpu(const Acts& a, const uint8_t* packed, int64_t qtype, float* y, int64_t M, int64_t K, int64_t N) {
  const int64_t np = (N + kLanes - 1) / kLanes;
  // One contiguous run of panels per thread, the runs differing by at most one panel: static
  // tasks of four panels left a thread idle for a task's time whenever their count was odd (9
  // for a 576-wide output).
#pragma omp parallel if (np > 1 && M * N * K >= (1 << 18))
  {
    int64_t t = 0, threads = 1;
#ifdef _OPENMP
    t = omp_get_thread_num(), threads = omp_get_num_threads();
#endif
    const int64_t p = t * np / threads, p1 = (t + 1) * np / threads;
    if (qtype == kQ4_1) run_task<kQ4_1>(a, packed, y, M, K, N, p, p1);
    else run_task<kQ8_0>(a, packed, y, M, K, N, p, p1);
  }
}

// y [M, n] = x [M, K] . W^T, arguments checked by the caller. The quantized activations
// live in this thread's buffers, kept between calls (a decode step makes ~120 of these
// products; a fresh allocation each was a malloc and a free apiece).
void a8_linear_into(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t qtype, int64_t n, float* y) {
  const int64_t G = K / kGroup;
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> dx;
  thread_local std::vector<int32_t> sq;
  if (static_cast<int64_t>(xq.size()) < M * K) xq.resize(M * K);
  if (static_cast<int64_t>(dx.size()) < M * G) dx.resize(M * G), sq.resize(M * G);
  int8_t* xqp = xq.data();  // this thread's buffers, by address: another thread's xq is its own
  float* dxp = dx.data();
  int32_t* sqp = sq.data();
  at::internal::lazy_init_num_threads();
#pragma omp parallel for schedule(static) if (M >= 64)
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * K, K, xqp + m * K, dxp + m * G, sqp + m * G);
  ggml_a8_cpu({xqp, dxp, sqp}, packed, qtype, y, M, K, n);
}

// `packed` must hold the panels of an n x K weight of type qtype.
void check_packed(const at::Tensor& packed, int64_t qtype, int64_t K, int64_t n) {
  TORCH_CHECK(packed.device().is_cpu(), "ggml_a8_linear: CPU tensors");
  TORCH_CHECK(qtype == kQ4_1 || qtype == kQ8_0, "ggml_a8_linear: qtype must be 3 (Q4_1) or 8 (Q8_0), got ", qtype);
  const int64_t G = K / kGroup, np = (n + kLanes - 1) / kLanes;
  TORCH_CHECK(K > 0 && K % kGroup == 0, "ggml_a8_linear: K = ", K, " is not a positive multiple of 32");
  TORCH_CHECK(n > 0 && packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 2 &&
              packed.size(0) == np && packed.size(1) == G * 16 * block_bytes(qtype),
              "ggml_a8_linear: packed must be contiguous uint8 [ceil(n / 16), K / 32 * 16 * ", block_bytes(qtype),
              "] for K = ", K, " and n = ", n, " (GGMLA8Weight.packed)");
}

at::Tensor ggml_a8_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype, int64_t n) {
  TORCH_CHECK(x.device().is_cpu(), "ggml_a8_linear: CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "ggml_a8_linear: x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  check_packed(packed, qtype, K, n);
  at::Tensor y = at::empty({M, n}, x.options());
  a8_linear_into(x.data_ptr<float>(), M, K, packed.data_ptr<uint8_t>(), qtype, n, y.data_ptr<float>());
  return y;
}
#endif  // AVX2

}  // namespace

#ifdef PAGEDKV_GGML_A8
void ggml_a8_linear_into(const float* x, int64_t M, int64_t K, const at::Tensor& packed, int64_t qtype, int64_t n,
                         float* y) {
  check_packed(packed, qtype, K, n);
  a8_linear_into(x, M, K, packed.data_ptr<uint8_t>(), qtype, n, y);
}
#endif

}  // namespace pagedkv

#ifdef PAGEDKV_GGML_A8
TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("ggml_a8_linear(Tensor x, Tensor packed, int qtype, int n) -> Tensor", &pagedkv::ggml_a8_linear);
}
#endif
