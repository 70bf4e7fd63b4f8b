// Vector helpers of the CPU paged-attention kernel: 16-float GCC/Clang vector types (one
// AVX-512 register, two AVX2 or four NEON ones under -march=native), a fixed-order lane sum,
// exp for non-positive inputs, fp16/bf16 -> fp32 page conversion and int8/fp8 page
// dequantization. Header-only; included by paged_attention_kernel.cpp, and by layer_ops.cpp
// for silu's exponential.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "paged_attention.h"

#if defined(__AVX2__) && !defined(__AVX512F__)
#define PAGEDKV_AVX2_ONLY 1  // a vf is two ymm registers: some helpers take AVX2 paths
#else
#define PAGEDKV_AVX2_ONLY 0
#endif

namespace pagedkv {
namespace vec {

constexpr int kLanes = 16;  // floats per vf
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

typedef float vf __attribute__((vector_size(kLanes * 4)));
typedef int32_t vi __attribute__((vector_size(kLanes * 4)));
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

inline vf loadv(const float* p) { vf v; std::memcpy(&v, p, sizeof v); return v; }
inline void storev(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
// x in every lane. (GCC lowers `vf{} + x`, and `x * v`, for 16-lane vectors on AVX2 as 16
// scalar stores and two reloads; the broadcast instruction is explicit there.)
inline vf splat(float x) {
#if PAGEDKV_AVX2_ONLY
  const __m256 b = _mm256_set1_ps(x);
  vf v;
  std::memcpy(&v, &b, 32);
  std::memcpy(reinterpret_cast<char*>(&v) + 32, &b, 32);
  return v;
#else
  return vf{} + x;
#endif
}
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline vf8 load8(const float* p) { vf8 v; std::memcpy(&v, p, sizeof v); return v; }
inline void store8(float* p, vf8 v) { std::memcpy(p, &v, sizeof v); }
inline vf8 vmax8(vf8 a, vf8 b) { return a > b ? a : b; }
inline float hmax8(vf8 v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}

// Sum of the 8 lanes as a fixed pairwise tree: halves, then (0 + 2) + (1 + 3).
inline float hsum8(vf8 a) {
  vf4 b, c; std::memcpy(&b, &a, 16); std::memcpy(&c, reinterpret_cast<char*>(&a) + 16, 16);
  vf4 d = b + c;
  return (d[0] + d[2]) + (d[1] + d[3]);
}

// Sum of the 16 lanes as a fixed pairwise tree: halves, then hsum8.
inline float hsum(vf v) {
  vf8 lo, hi; std::memcpy(&lo, &v, 32); std::memcpy(&hi, reinterpret_cast<char*>(&v) + 32, 32);
  return hsum8(lo + hi);
}

#if defined(__clang__) || __GNUC__ >= 12
#define PAGEDKV_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PAGEDKV_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, vi{__VA_ARGS__})
#endif

// r[j] = sum of the lanes of p[j], j < 16: a transposing tree of two-source shuffles (45
// operations for 16 sums instead of 16 separate lane sums). Lane j depends on p[j] alone.
// (AVX2 builds score keys with the kernel's own ymm code instead.)
inline vf hsum16(const vf* p) {
  vf w[8], u[4], t[2];
  for (int i = 0; i < 8; ++i)
    w[i] = PAGEDKV_SHUFFLE(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           PAGEDKV_SHUFFLE(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    u[i] = PAGEDKV_SHUFFLE(w[2 * i], w[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           PAGEDKV_SHUFFLE(w[2 * i], w[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    t[i] = PAGEDKV_SHUFFLE(u[2 * i], u[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           PAGEDKV_SHUFFLE(u[2 * i], u[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return PAGEDKV_SHUFFLE(t[0], t[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         PAGEDKV_SHUFFLE(t[0], t[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

// Max of the 16 lanes (a shuffle tree: short dependency chain).
#if PAGEDKV_AVX2_ONLY
inline float hmax(vf v) {
  __m256 lo, hi;
  std::memcpy(&lo, &v, 32);
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + 32, 32);
  __m256 m = _mm256_max_ps(lo, hi);
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}
#else
inline float hmax(vf v) {
  v = vmax(v, PAGEDKV_SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, PAGEDKV_SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, PAGEDKV_SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, PAGEDKV_SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}
#endif

// x in every lane of a vf (splat) or a vf8 (one ymm register: GCC broadcasts it directly).
template <class F> inline F lanes(float x) { if constexpr (sizeof(F) == sizeof(vf)) return splat(x); else return F{} + x; }

// e^x for x <= 0; lanes below ln(FLT_MIN) (and -inf) give 0. Cephes expf: x = n ln2 + r,
// |r| <= ln2/2, degree-5 polynomial for e^r, 2^n built in the exponent bits (~1 ulp).
// F, I: vf and vi, or vf8 and vi8 (AVX2 builds: the same operations a ymm at a time; GCC
// moves 16-lane vectors through the stack there). A lane's result is the same either way.
template <class F, class I>
inline F exp_nonpos_t(F x) {
  const float lo = -87.33654f, magic = 12582912.0f;  // 1.5 * 2^23: round to integer
  const I under = x < lanes<F>(lo);
  x = under ? lanes<F>(lo) : x;
  const F t = x * 1.44269504088896341f + magic;
  const F n = t - magic;
  const I ni = (I)t - (I)lanes<F>(magic);
  F r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  F y = lanes<F>(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const I bits = (ni + 127) << 23;
  const F res = y * (F)bits;
  return under ? lanes<F>(0.0f) : res;
}
inline vf exp_nonpos(vf x) { return exp_nonpos_t<vf, vi>(x); }
inline vf8 exp_nonpos8(vf8 x) { return exp_nonpos_t<vf8, vi8>(x); }

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
    uint32_t b; std::memcpy(&b, &f, 4); b |= sign; std::memcpy(&f, &b, 4);
    return f;
  }
  const uint32_t b = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
  std::memcpy(&f, &b, 4);
  return f;
#endif
}

// fp16 or bf16 values to fp32 (exact).
inline void convert(const uint16_t* src, float* dst, int64_t n, KVType type) {
  int64_t i = 0;
  if (type == KVType::bf16) {
    for (; i < n; ++i) {
      const uint32_t b = static_cast<uint32_t>(src[i]) << 16;
      std::memcpy(dst + i, &b, 4);
    }
    return;
  }
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = half_to_float(src[i]);
}

// 16 stored 8-bit values to exact fp32. fp8 bytes are placed in fp32 bit positions so the
// exponent field lines up, then rebased by a power of two: exact for normals and subnormals
// alike (a subnormal byte lands on an fp32 subnormal with the same mantissa). Our writer
// clamps to the format's maximum, so the inf/NaN codes never occur.
//   e4m3fn: s eeee mmm -> bits s<<31 | eeeemmm<<20, times 2^(127-7)
//   e5m2:   s eeeee mm -> bits s<<31 | eeeeemm<<21, times 2^(127-15)
// (Intrinsics where available: GCC lowers a generic 8-to-32-bit vector conversion lane by lane.)
template <KVType T>
inline uint32_t fp8_bits(uint32_t u) {
  return ((u & 0x80u) << 24) | ((u & 0x7fu) << (T == KVType::f8e4m3 ? 20 : 21));
}

template <KVType T>
inline vf load8(const uint8_t* p) {
  constexpr float rebase = T == KVType::f8e4m3 ? 0x1p120f : 0x1p112f;
  vf out;
#if defined(__AVX512F__)
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m512 f;
  if constexpr (T == KVType::i8) {
    f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  } else {
    const __m512i u = _mm512_cvtepu8_epi32(b);
    const __m512i bits = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x80)), 24),
                                         _mm512_slli_epi32(_mm512_and_si512(u, _mm512_set1_epi32(0x7f)),
                                                           T == KVType::f8e4m3 ? 20 : 21));
    f = _mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(rebase));
  }
  std::memcpy(&out, &f, sizeof out);
#else
  for (int i = 0; i < kLanes; ++i) {
    if constexpr (T == KVType::i8) {
      out[i] = static_cast<float>(static_cast<int8_t>(p[i]));
    } else {
      const uint32_t bits = fp8_bits<T>(p[i]);
      float f; std::memcpy(&f, &bits, 4);
      out[i] = f * rebase;
    }
  }
#endif
  return out;
}

// Element i of a float32 or bfloat16 (exact widening) array.
inline float scale_at(const void* base, int64_t i, bool bf16) {
  if (!bf16) return static_cast<const float*>(base)[i];
  const uint32_t b = static_cast<uint32_t>(static_cast<const uint16_t*>(base)[i]) << 16;
  float f; std::memcpy(&f, &b, 4);
  return f;
}

// Dequantize n slots x Hkv heads x D values of block b into fp32: dst = float(q) * scale
// (one rounding, as the reference), scales as described by `sl`.
template <KVType T>
void dequantize_page(const uint8_t* src, float* dst, int64_t b, int64_t n, int64_t Hkv, int64_t D,
                     const ScaleLayout& sl) {
  if (sl.per_channel) {
    const float* s = static_cast<const float*>(sl.data);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t g = 0; g < Hkv; ++g) {
        const int64_t off = (j * Hkv + g) * D;
        for (int64_t c = 0; c < D; c += kLanes) storev(dst + off + c, load8<T>(src + off + c) * loadv(s + g * D + c));
      }
    return;
  }
  for (int64_t j = 0; j < n; ++j)
    for (int64_t g = 0; g < Hkv; ++g) {
      const vf s = splat(scale_at(sl.data, b * sl.strides[0] + j * sl.strides[1] + g * sl.strides[2], sl.bf16));
      const int64_t off = (j * Hkv + g) * D;
      for (int64_t c = 0; c < D; c += kLanes) storev(dst + off + c, load8<T>(src + off + c) * s);
    }
}

}  // namespace vec
}  // namespace pagedkv
