// GGML block formats (Q4_1, Q8_0) as ggml_linear.cpp reads them, and the vector code that
// widens a block to the fp32 values gguf-py's dequantize gives (see ggml_linear.cpp's header
// for the panel layout). Shared by ggml_linear.cpp and ggml_linear_widened.cpp; include it
// after `#pragma GCC optimize("fp-contract=off")`, as both do, so that a product and its sum
// are each rounded once wherever a helper is inlined.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagedkv {
namespace ggml {

constexpr int64_t kGroup = 32;        // weights per block
constexpr int64_t kQ4_1 = 3, kQ8_0 = 8;  // ggml_type values
constexpr int64_t kRowsPerTask = 64;  // output channels per parallel task
constexpr int64_t kPanel = 8;         // rows whose blocks are interleaved (ggml_linear.cpp)

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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define PAGEDKV_GGML_VECTOR 1
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
#endif

// From kBigM activation rows on, AVX2 builds take ggml_linear_widened (ggml_linear_widened.cpp).
constexpr int64_t kBigM = 12;
void ggml_linear_widened(const float* x, const uint8_t* w, int64_t qtype, float* y, int64_t M, int64_t K, int64_t N);

}  // namespace ggml
}  // namespace pagedkv
