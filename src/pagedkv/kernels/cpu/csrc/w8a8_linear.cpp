// W8A8 linear layer: int8 weights times int8 activations quantized as they come.
//
// Registers torch.ops.pagedkv.w8a8_linear(x, packed, wsum, w_scale, inv_smooth, group) -> y
// with x fp32 [M, K], y fp32 [M, N] (pagedkv/model/w8a8.py documents the recipe):
//   1. each row of x, times inv_smooth [K] if given, is quantized per `group` channels:
//      a_scale = amax / 127 (1 for an all-zero group, NaN for one holding a NaN or
//      infinity: that row's output is NaN), xq = round-half-even(x / a_scale);
//   2. per group g, the exact int32 dot products isum[m, n, g] = sum_k xq[m, k] q[n, k];
//   3. y[m, n] = (sum over g in order of float(isum[m, n, g]) * a_scale[m, g]) * w_scale[n],
//      every multiplication and addition rounded once (no FMA contraction), as the torch
//      reference in w8a8.py computes it.
// So every output is a fixed function of its own row: batch-invariant, and the same bits on
// any CPU (the integer part is exact however it is computed).
//
// `packed` is int8 [ceil(N / 16), K * 16]: panels of 16 output channels, each holding, for
// k = 0, 4, 8, ..., the 16 channels' weights k .. k + 3 (64 bytes: one AVX-512 VNNI
// operand, or two AVX2 ones); padding channels are zero. `wsum` is int32 [K / group, 16 * panels]: each
// channel's sum of weights per group (VNNI multiplies unsigned activations, xq + 128, and
// subtracts 128 * wsum).

#pragma GCC optimize("fp-contract=off")

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedkv {
namespace {

constexpr int kLanes = 16;            // output channels per panel
constexpr int64_t kPanelsPerTask = 4;  // 64 output channels per parallel task

// Built for AVX2 and AVX-512 VNNI CPUs; without AVX2 the op is not registered and w8a8.py
// computes the same numbers in torch. Both integer paths are exact:
//   VNNI: vpdpbusd multiplies unsigned bytes by signed ones, so activations go in as
//         xq + 128 and 128 * (the group's weight sum) is subtracted;
//   AVX2: vpmaddubsw(|xq|, sign(w, xq)) (each pair sum <= 2 * 127 * 127 < 2^15: no
//         saturation, as |xq| <= 127), then vpmaddwd with ones into int32.
// (torch._int_mm is not exact on CPUs without VNNI: oneDNN's AVX2 kernel saturates.)
#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PAGEDKV_W8A8_VNNI 1
constexpr int kBias = 128;
constexpr int kNR = 4;  // panels per tile: 4 x 4 zmm accumulators
#else
constexpr int kBias = 0;
constexpr int kNR = 1;  // 4 x 2 ymm accumulators
#endif

// A group's quantization scale, or NaN when the group holds a NaN or infinity (the row's
// output is then NaN, as an fp32 product's would be, instead of a silently clamped value).
inline float group_scale(const float* v, int64_t n) {
  float amax = 0.0f;
  bool finite = true;
  for (int64_t j = 0; j < n; ++j) {
    finite = finite && std::isfinite(v[j]);
    amax = std::max(amax, std::fabs(v[j]));
  }
  if (!finite) return NAN;
  return amax > 0.0f ? amax / 127.0f : 1.0f;
}

// Step 1, one row: xq (+ kBias) and one scale per group.
void quantize_row(const float* x, const float* inv_s, int64_t K, int64_t group, uint8_t* xq, float* a_scale) {
  std::vector<float> xs(x, x + K);
  if (inv_s != nullptr)
    for (int64_t k = 0; k < K; ++k) xs[k] = x[k] * inv_s[k];
  for (int64_t g = 0; g < K / group; ++g) {
    const float* v = xs.data() + g * group;
    const float s = group_scale(v, group);
    a_scale[g] = s;
    for (int64_t j = 0; j < group; ++j) {
      const float r = std::isnan(s) ? 0.0f : std::nearbyint(v[j] / s);  // half to even, as torch.round
      const int q = static_cast<int>(std::min(127.0f, std::max(-127.0f, r)));
      xq[g * group + j] = static_cast<uint8_t>(q + kBias);
    }
  }
}

#ifdef PAGEDKV_W8A8_VNNI
using IVec = __m512i;  // 16 int32 lanes: one panel
constexpr int kHalves = 1;
inline IVec izero() { return _mm512_setzero_si512(); }
// acc += the dot of the 4 activation bytes in xb (broadcast) with each lane's 4 weights.
inline IVec dot4(IVec acc, IVec xb, IVec ax, const int8_t* w) {
  (void)ax;
  return _mm512_dpbusd_epi32(acc, xb, _mm512_loadu_si512(w));
}
inline IVec bcast(int32_t x4) { return _mm512_set1_epi32(x4); }
inline IVec absb(IVec xb) { return xb; }
inline void store_group(float* facc, IVec acc, const int32_t* wsum, float a_scale, bool first) {
  const __m512i comp = _mm512_slli_epi32(_mm512_loadu_si512(wsum), 7);  // 128 * sum(w)
  const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, comp)), _mm512_set1_ps(a_scale));
  _mm512_store_ps(facc, first ? f : _mm512_add_ps(_mm512_load_ps(facc), f));
}
#else
using IVec = __m256i;  // 8 int32 lanes: half a panel
constexpr int kHalves = 2;
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec dot4(IVec acc, IVec xb, IVec ax, const int8_t* w) {
  const __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), xb));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
inline IVec bcast(int32_t x4) { return _mm256_set1_epi32(x4); }
inline IVec absb(IVec xb) { return _mm256_abs_epi8(xb); }
inline void store_group(float* facc, IVec acc, const int32_t* wsum, float a_scale, bool first) {
  (void)wsum;
  const __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(acc), _mm256_set1_ps(a_scale));
  _mm256_store_ps(facc, first ? f : _mm256_add_ps(_mm256_load_ps(facc), f));
}
#endif
constexpr int kVec = kLanes / kHalves;  // int32 lanes per IVec

// Rows m0 .. m0 + MR - 1 against panels p0 .. p0 + NR - 1 (each broadcast activation quad
// feeds NR panels, each weight vector MR rows): exact integer dots per group, then the
// scaled sum into facc[r][j] (mul, then add: each rounded once).
template <int MR, int NR>
void tile(const uint8_t* xq, const float* a_scale, int64_t K, int64_t group, const int8_t* w,
          const int32_t* wsum, int64_t wsum_stride, float facc[][4][kLanes]) {
  const int64_t G = K / group;
  for (int64_t g = 0; g < G; ++g) {
    IVec acc[MR][NR][kHalves];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < NR; ++j)
        for (int h = 0; h < kHalves; ++h) acc[r][j][h] = izero();
    for (int64_t k = g * group; k < (g + 1) * group; k += 4) {
      for (int r = 0; r < MR; ++r) {
        int32_t x4;
        std::memcpy(&x4, xq + r * K + k, 4);
        const IVec xb = bcast(x4), ax = absb(xb);
        for (int j = 0; j < NR; ++j)
          for (int h = 0; h < kHalves; ++h)
            acc[r][j][h] = dot4(acc[r][j][h], xb, ax, w + j * K * kLanes + k * kLanes + h * 4 * kVec);
      }
    }
    for (int j = 0; j < NR; ++j)
      for (int r = 0; r < MR; ++r)
        for (int h = 0; h < kHalves; ++h)
          store_group(facc[r][j] + h * kVec, acc[r][j][h], wsum + g * wsum_stride + j * kLanes + h * kVec,
                      a_scale[r * G + g], g == 0);
  }
}

// Rows m .. (MR at a time, then one by one) against NR panels starting at panel p.
template <int NR>
void panels(const uint8_t* xq, const float* a_scale, const int8_t* packed, const int32_t* wsum,
            const float* w_scale, float* y, int64_t M, int64_t K, int64_t N, int64_t group, int64_t p) {
  const int64_t G = K / group, stride = (N + kLanes - 1) / kLanes * kLanes;
  const int8_t* w = packed + p * K * kLanes;
  const int32_t* ws = wsum + p * kLanes;
  alignas(64) float facc[4][4][kLanes];
  for (int64_t m = 0; m < M;) {
    const int mr = M - m >= 4 ? 4 : 1;
    if (mr == 4) tile<4, NR>(xq + m * K, a_scale + m * G, K, group, w, ws, stride, facc);
    else tile<1, NR>(xq + m * K, a_scale + m * G, K, group, w, ws, stride, facc);
    for (int r = 0; r < mr; ++r)
      for (int j = 0; j < NR; ++j) {
        const int64_t n0 = (p + j) * kLanes, width = std::min<int64_t>(kLanes, N - n0);
        for (int64_t i = 0; i < width; ++i) y[(m + r) * N + n0 + i] = facc[r][j][i] * w_scale[n0 + i];
      }
    m += mr;
  }
}

void w8a8_cpu(const uint8_t* xq, const float* a_scale, const int8_t* packed, const int32_t* wsum,
              const float* w_scale, float* y, int64_t M, int64_t K, int64_t N, int64_t group) {
  const int64_t np = (N + kLanes - 1) / kLanes, tasks = (np + kPanelsPerTask - 1) / kPanelsPerTask;
#pragma omp parallel for schedule(static) if (tasks > 1 && M * N * K >= (1 << 18))
  for (int64_t t = 0; t < tasks; ++t) {
    int64_t p = t * kPanelsPerTask;
    const int64_t p1 = std::min(np, p + kPanelsPerTask);
    for (; p + kNR <= p1; p += kNR) panels<kNR>(xq, a_scale, packed, wsum, w_scale, y, M, K, N, group, p);
    for (; p < p1; ++p) panels<1>(xq, a_scale, packed, wsum, w_scale, y, M, K, N, group, p);
  }
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& wsum,
                       const at::Tensor& w_scale, const std::optional<at::Tensor>& inv_smooth, int64_t group) {
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "w8a8_linear: CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "w8a8_linear: x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w_scale.numel();
  TORCH_CHECK(group > 0 && group % 4 == 0 && K % group == 0, "w8a8_linear: group ", group,
              " must be a multiple of 4 dividing K = ", K);
  const int64_t panels = (N + kLanes - 1) / kLanes;
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.is_contiguous() && packed.dim() == 2 &&
              packed.size(0) == panels && packed.size(1) == K * kLanes,
              "w8a8_linear: packed must be contiguous int8 [ceil(N / 16), K * 16]");
  TORCH_CHECK(wsum.scalar_type() == at::kInt && wsum.is_contiguous() && wsum.dim() == 2 &&
              wsum.size(0) == K / group && wsum.size(1) == panels * kLanes,
              "w8a8_linear: wsum must be contiguous int32 [K / group, 16 * panels]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() && w_scale.dim() == 1,
              "w8a8_linear: w_scale must be contiguous float32 [N]");
  const float* inv_s = nullptr;
  if (inv_smooth.has_value() && inv_smooth->defined()) {
    TORCH_CHECK(inv_smooth->scalar_type() == at::kFloat && inv_smooth->is_contiguous() &&
                inv_smooth->numel() == K, "w8a8_linear: inv_smooth must be contiguous float32 [K]");
    inv_s = inv_smooth->data_ptr<float>();
  }
  std::vector<uint8_t> xq(M * K);
  std::vector<float> a_scale(M * (K / group));
  at::internal::lazy_init_num_threads();
  const float* xp = x.data_ptr<float>();
#pragma omp parallel for schedule(static) if (M >= 64)
  for (int64_t m = 0; m < M; ++m)
    quantize_row(xp + m * K, inv_s, K, group, xq.data() + m * K, a_scale.data() + m * (K / group));
  at::Tensor y = at::empty({M, N}, x.options());
  w8a8_cpu(xq.data(), a_scale.data(), packed.data_ptr<int8_t>(), wsum.data_ptr<int32_t>(),
           w_scale.data_ptr<float>(), y.data_ptr<float>(), M, K, N, group);
  return y;
}

#endif  // AVX2
}  // namespace
}  // namespace pagedkv

#if defined(__AVX2__)
TORCH_LIBRARY_FRAGMENT(pagedkv, m) {
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor wsum, Tensor w_scale, Tensor? inv_smooth, int group) -> Tensor",
        &pagedkv::w8a8_linear);
}
#endif  // AVX2
