// What software prefetching can do for reads of scattered KV pages, one thread: 12 KiB K and
// V pages (a SmolLM2 page of 16 fp32 tokens, 3 KV heads of 64) read once each, in address order
// or shuffled, with a few FMAs a cache line, under each prefetch scheme. Prints GB/s (1e9
// bytes) of K + V read. Cited in BENCHMARKS.md's history ("Huge pages, and where batch-64 decode
// attention loses its read rate": git show ef5bb62:BENCHMARKS.md). Needs AVX-512 (AVX-512F loads and FMAs):
//
//   g++ -O2 -march=native -o /tmp/page_prefetch benchmarks/lab/page_prefetch.cpp
//   /tmp/page_prefetch 4 2     # FMAs per line, pages ahead for the far prefetches
//
// Columns: seq-none (address order, no prefetch), then shuffled pages with no prefetch,
// PREFETCHT0 of the next page spread over the current one, PREFETCHT1 of the page `dist` ahead
// at once (burst) or spread, both (the kernel's pair), and T2 / NTA spread.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>
#include <algorithm>
constexpr int PAGE = 12288, LINES = PAGE / 64;
template <int MODE>
double run(const char* K, const char* V, const std::vector<int>& order, int reps, int dist) {
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  auto t = std::chrono::steady_clock::now();
  const int n = order.size();
  for (int i = 0; i < n; ++i) {
    const char* k = K + (size_t)order[i] * PAGE; const char* v = V + (size_t)order[i] * PAGE;
    const char* kn = i + 1 < n ? K + (size_t)order[i + 1] * PAGE : nullptr;
    const char* vn = i + 1 < n ? V + (size_t)order[i + 1] * PAGE : nullptr;
    const char* kf = i + dist < n ? K + (size_t)order[i + dist] * PAGE : nullptr;
    const char* vf = i + dist < n ? V + (size_t)order[i + dist] * PAGE : nullptr;
    if (MODE == 2 || MODE == 3) if (kf) for (int o = 0; o < PAGE; o += 64) _mm_prefetch(kf + o, _MM_HINT_T1), _mm_prefetch(vf + o, _MM_HINT_T1);
    // compute on K then V, with spread prefetch per line
    for (int o = 0; o < PAGE; o += 64) {
      if ((MODE == 1 || MODE == 3) && kn) _mm_prefetch(kn + o, _MM_HINT_T0), _mm_prefetch(vn + o, _MM_HINT_T0);
      if (MODE == 4 && kf) _mm_prefetch(kf + o, _MM_HINT_T1), _mm_prefetch(vf + o, _MM_HINT_T1);
      if (MODE == 5 && kf) _mm_prefetch(kf + o, _MM_HINT_T1), _mm_prefetch(vf + o, _MM_HINT_T1);
      if (MODE == 5 && kn) _mm_prefetch(kn + o, _MM_HINT_T0), _mm_prefetch(vn + o, _MM_HINT_T0);
      if (MODE == 6 && kf) _mm_prefetch(kf + o, _MM_HINT_T2), _mm_prefetch(vf + o, _MM_HINT_T2);
      if (MODE == 7 && kf) _mm_prefetch(kf + o, _MM_HINT_NTA), _mm_prefetch(vf + o, _MM_HINT_NTA);
      __m512 x = _mm512_loadu_ps(k + o);
      for (int r = 0; r < reps; ++r) a0 = _mm512_fmadd_ps(x, x, a0);
      __m512 y = _mm512_loadu_ps(v + o);
      for (int r = 0; r < reps; ++r) a1 = _mm512_fmadd_ps(y, y, a1);
    }
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  volatile float sink = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)); (void)sink;
  return 2.0 * PAGE * n / s / 1e9;
}
int main(int argc, char** argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 1, dist = argc > 2 ? atoi(argv[2]) : 2;
  const size_t npages = 25000;  // 300 MB each
  char* K = (char*)aligned_alloc(4096, npages * PAGE); char* V = (char*)aligned_alloc(4096, npages * PAGE);
  memset(K, 1, npages * PAGE); memset(V, 1, npages * PAGE);
  std::vector<int> order(npages); for (size_t i = 0; i < npages; ++i) order[i] = i;
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  std::vector<int> seq(npages); for (size_t i = 0; i < npages; ++i) seq[i] = i;
  for (int round = 0; round < 2; ++round) {
    printf("reps %d dist %d | seq-none %.1f | rand: none %.1f  T0next %.1f  T1burst %.1f  both %.1f  T1spread %.1f  T1spread+T0next %.1f  T2spread %.1f  NTAspread %.1f\n", reps, dist,
      run<0>(K, V, seq, reps, dist), run<0>(K, V, order, reps, dist), run<1>(K, V, order, reps, dist), run<2>(K, V, order, reps, dist),
      run<3>(K, V, order, reps, dist), run<4>(K, V, order, reps, dist), run<5>(K, V, order, reps, dist), run<6>(K, V, order, reps, dist), run<7>(K, V, order, reps, dist));
  }
}
