// Fused CPU paged attention: reads K/V straight from the pages through each sequence's
// block table (no gathered copy), online softmax page by page, flash-decoding partitions.
// Shapes: see paged_attention.h. Plain C++ with GCC/Clang vector types (AVX-512 / AVX2 /
// NEON under -march=native) and OpenMP; no torch headers, so it compiles in seconds.
//
// Work: a *tile* is up to kPrefillTile query rows of one sequence (1 for a decode); its
// keys are cut into *partitions* of part_pages pages. A (row, head) keeps an online
// softmax state (m, l, acc) over the pages of a partition; partition states are then
// folded in partition order, and out = acc / l. A tile's partitions run in one work item,
// or, when there are too few tiles to fill the threads, one item per partition with the
// states stored in a scratch buffer and folded afterwards by the same fold function.
//
// Determinism (the engine's bit-identical greedy outputs rely on it): a (row, head)'s
// arithmetic depends only on its position and the keys it sees; partitions are a function
// of block_size alone. Neither the batch, the other rows of its chunk or tile, the thread
// count nor the split choice changes any operation applied to it.

#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "vec.h"
#include "attention_avx2.h"

namespace pagedkv {
namespace {

using namespace vec;  // NOLINT: the kernel is written in these helpers

constexpr int64_t kPartitionTokens = 256;  // keys per partition (rounded down to whole pages)
constexpr int64_t kPrefillTile = 4;        // query rows per tile of a multi-token chunk
// Multiply-adds below which one thread is quicker. A lone SmolLM2 decode (9 heads of 64, 3 KV
// heads) at ~200 tokens, ~1.2e5, ran on one thread under the earlier 1 << 19; split over 2
// threads by KV head it took 355 instead of 520 us of a 3 ms step (AMD EPYC family 26).
constexpr int64_t kMinParallelWork = 1 << 14;
constexpr int64_t kMaxGroup = 16;       // query heads per KV head that take update_tile_page (AVX2)
constexpr int64_t kPairsPerPass = 6;    // (row, head) pairs per V load there: 12 accumulators
constexpr int64_t kTilePairs = kPrefillTile * kMaxGroup;  // (row, head) pairs of a KV head in a tile

// The next page's K/V bytes, prefetched a key at a time while the current page is computed
// (block tables are shuffled, so hardware prefetchers cannot guess the next page).
struct Prefetch {
  const char *k = nullptr, *v = nullptr;
  int64_t slot_bytes = 0, head_bytes = 0;  // one slot (all KV heads), one KV head
  void key(int64_t j, int64_t g) const {
    if (k == nullptr) return;
    const int64_t off = j * slot_bytes + g * head_bytes;
    for (int64_t b = 0; b < head_bytes; b += 64) __builtin_prefetch(k + off + b), __builtin_prefetch(v + off + b);
  }
};

struct Tile {
  int64_t seq, q0, nq, nparts;
  int64_t scratch;  // float offset of its partition states, or -1 when folded in place
};

struct Item {
  int64_t tile, p_begin, p_end;
  int64_t g_begin, g_end;  // its KV heads (with their query heads)
};

// A softmax state is (m, l) in `ml` and acc[D]. noinline: the in-item fold and the
// split-mode combine must run the very same instructions.
template <int NV>
__attribute__((noinline)) void fold(float* ml, float* acc, const float* ml2, const float* acc2) {
  if (ml2[0] == kNegInf) return;  // a partition with no key for this row (before its window)
  if (ml[0] == kNegInf) {
    ml[0] = ml2[0], ml[1] = ml2[1];
    for (int v = 0; v < NV; ++v) storev(acc + v * kLanes, loadv(acc2 + v * kLanes));
    return;
  }
  const float m = std::max(ml[0], ml2[0]);
  const float w1 = std::exp(ml[0] - m), w2 = std::exp(ml2[0] - m);
  ml[0] = m;
  ml[1] = ml[1] * w1 + ml2[1] * w2;
  for (int v = 0; v < NV; ++v)
    storev(acc + v * kLanes, loadv(acc + v * kLanes) * w1 + loadv(acc2 + v * kLanes) * w2);
}

template <int NV>
__attribute__((noinline)) void finalize(const float* ml, const float* acc, float* out) {
  const float inv = 1.0f / ml[1];
  for (int v = 0; v < NV; ++v) storev(out + v * kLanes, loadv(acc + v * kLanes) * inv);
}

template <int NV>
class Kernel {
 public:
  static constexpr int64_t D = NV * kLanes;
  // PV accumulators held in registers per pass: AVX-512 has 32 registers of one vf each;
  // AVX2 has 16 of half a vf, so it takes at most two vf columns of three heads per pass
  // (12 accumulators; two heads' 8 FMAs a key leave the FMA latency partly exposed: 1.01x at
  // 64 x 200 tokens from memory, 1.08x from cache, measured on an AMD EPYC family 25).
  static constexpr int kColsPerPass = PAGEDKV_AVX2_ONLY ? (NV % 2 == 0 ? 2 : 1) : NV;  // divides NV
  static constexpr int64_t kHeadsPerPass =
      PAGEDKV_AVX2_ONLY ? (kColsPerPass == 1 ? 4 : 3) : (NV >= 16 ? 1 : NV >= 8 ? 2 : 4);

  explicit Kernel(const PagedAttentionArgs& a)
      : a_(a), H_(a.num_heads), Hkv_(a.num_kv_heads), G_(a.num_heads / a.num_kv_heads),
        BS_(a.block_size), bspad_((a.block_size + kLanes - 1) / kLanes * kLanes),
        part_pages_(std::max<int64_t>(1, kPartitionTokens / a.block_size)) {}

  void run() {
    plan();
    if (items_.empty()) return;
    std::vector<float> scratch(scratch_size_);
    const int64_t n_items = static_cast<int64_t>(items_.size()), n_split = static_cast<int64_t>(split_tiles_.size());
    // One barrier per pass: on a shared machine every barrier waits for a descheduled thread.
#pragma omp parallel if (n_items > 1 && work_ >= kMinParallelWork)
    {
      Workspace ws(*this);
      if (n_split == 0) {
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t i = 0; i < n_items; ++i) run_item(items_[i], ws, scratch.data());
      } else {
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; ++i) run_item(items_[i], ws, scratch.data());
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t i = 0; i < n_split; ++i) combine(tiles_[split_tiles_[i]], scratch.data());
      }
    }
  }

 private:
  struct Workspace {
    std::vector<float> kbuf, vbuf;      // a converted page [BS, Hkv, D] (fp16/bf16/int8/fp8 caches)
    std::vector<float> scores;          // [G, bspad] scores, then probabilities; [G] rescale factors; [bspad]
    std::vector<float> cur_ml, cur_acc; // partition state per (row, head): [R, 2], [R, D]
    std::vector<float> run_ml, run_acc; // folded state
    explicit Workspace(const Kernel& k) {
      const int64_t R = kPrefillTile * k.H_;
      if (k.a_.kv_type != KVType::f32) kbuf.resize(k.BS_ * k.Hkv_ * D), vbuf.resize(k.BS_ * k.Hkv_ * D);
      scores.resize(std::max(k.G_ * (k.bspad_ + 1) + k.bspad_, kPrefillTile * k.G_ * k.bspad_ + 2 * kTilePairs));
      cur_ml.resize(R * 2), cur_acc.resize(R * D), run_ml.resize(R * 2), run_acc.resize(R * D);
    }
  };

  const int64_t* seq(int64_t s) const { return a_.seq_info + 5 * s; }
  int64_t first_pos(const Tile& t) const { return seq(t.seq)[2] - seq(t.seq)[1] + t.q0; }
  int64_t part_tokens() const { return part_pages_ * BS_; }
  int64_t state_stride() const { return D + 2; }

  void plan() {
    for (int64_t s = 0; s < a_.num_seqs; ++s) {
      const int64_t ql = seq(s)[1], ctx = seq(s)[2];
      const int64_t tile = ql == 1 ? 1 : kPrefillTile;
      for (int64_t q0 = 0; q0 < ql; q0 += tile) {
        const int64_t nq = std::min(tile, ql - q0), last = ctx - ql + q0 + nq - 1;
        tiles_.push_back({s, q0, nq, last / part_tokens() + 1, -1});
        work_ += (last + 1) * nq * H_ * D;
      }
    }
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    const bool split = a_.split == 1 || (a_.split < 0 && static_cast<int64_t>(tiles_.size()) < 4 * threads);
    for (int64_t t = 0; t < static_cast<int64_t>(tiles_.size()); ++t) {
      Tile& tl = tiles_[t];
      if (!split || tl.nparts == 1) {
        items_.push_back({t, 0, tl.nparts, 0, Hkv_});
        continue;
      }
      tl.scratch = scratch_size_;
      scratch_size_ += tl.nparts * tl.nq * H_ * state_stride();
      split_tiles_.push_back(t);
      for (int64_t p = 0; p < tl.nparts; ++p) items_.push_back({t, p, p + 1, 0, Hkv_});
    }
    split_heads(threads);
  }

  // Too few items for the threads (one or two short decodes): each decode tile's items go
  // one KV head (and its query heads) apiece. A (row, head)'s operations do not change.
  // fp32 pages only: the other kinds convert a whole page (every head) per item.
  void split_heads(int threads) {
    if (threads < 2 || Hkv_ == 1 || a_.kv_type != KVType::f32 || static_cast<int64_t>(items_.size()) >= 2 * threads)
      return;
    std::vector<Item> by_head;
    for (const Item& it : items_) {
      if (tiles_[it.tile].nq != 1) {
        by_head.push_back(it);
        continue;
      }
      for (int64_t g = 0; g < Hkv_; ++g) by_head.push_back({it.tile, it.p_begin, it.p_end, g, g + 1});
    }
    items_.swap(by_head);
  }

  // Scores of one query head q [D] against keys 0..n-1 (key j at k + j * stride), scaled
  // (and soft-capped), into s[0..n rounded up to 16): keys >= n repeat key n-1.
  void score_keys(const float* q, const float* k, int64_t n, int64_t stride, float* s) const {
    score_scaled(q, k, n, stride, s);
    if (a_.softcap > 0.0f)  // as HF's Gemma 2: divide, tanh, multiply, each rounded once
      for (int64_t j = 0; j < (n + kLanes - 1) / kLanes * kLanes; ++j) s[j] = std::tanh(s[j] / a_.softcap) * a_.softcap;
  }

  void score_scaled(const float* q, const float* k, int64_t n, int64_t stride, float* s) const {
#if PAGEDKV_AVX2_ONLY
    for (int64_t j0 = 0; j0 < n; j0 += kLanes) avx2::dot16<NV>(q, k, j0, n, stride, a_.scale, s + j0);
#else
    vf qh[NV];
    for (int c = 0; c < NV; ++c) qh[c] = loadv(q + c * kLanes);
    for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
      vf part[kLanes];
      for (int jj = 0; jj < kLanes; ++jj) {
        const float* kj = k + std::min<int64_t>(j0 + jj, n - 1) * stride;
        part[jj] = qh[0] * loadv(kj);
        for (int c = 1; c < NV; ++c) part[jj] += qh[c] * loadv(kj + c * kLanes);
      }
      storev(s + j0, hsum16(part) * a_.scale);
    }
#endif
  }

  // Online-softmax step of one (row, head) over a page's scores s[0..bspad) (masked keys
  // -inf): s becomes the probabilities e^(s - m_new), ml = (m, l) is updated; returns the
  // factor alpha = e^(m_old - m_new) that rescales the accumulator.
  float softmax_update(float* s, float* ml) const {
#if PAGEDKV_AVX2_ONLY
    const float m_old = ml[0], m_new = std::max(m_old, avx2::page_max(s, bspad_));
    const float alpha = exp_nonpos8(vf8{} + (m_old - m_new))[0];
    const float lsum = avx2::page_exp_sum(s, m_new, bspad_);
#else
    vf mx = loadv(s);
    for (int64_t c = kLanes; c < bspad_; c += kLanes) mx = vmax(mx, loadv(s + c));
    const float m_old = ml[0], m_new = std::max(m_old, hmax(mx));
    const float alpha = exp_nonpos(splat(m_old - m_new))[0];
    for (int64_t c = 0; c < bspad_; c += kLanes) storev(s + c, exp_nonpos(loadv(s + c) - m_new));
    vf psum = loadv(s);  // masked lanes are exactly 0: a fixed lane-wise tree, whatever n is
    for (int64_t c = kLanes; c < bspad_; c += kLanes) psum += loadv(s + c);
    const float lsum = hsum(psum);
#endif
    ml[0] = m_new;
    ml[1] = ml[1] * alpha + lsum;
    return alpha;
  }

  // Online-softmax update of the G query heads of one row (q: [G, D]) with keys 0..sink_end-1
  // and lo..n-1 of one KV head of a page (k, v: key j at k + j * stride; keys in between are
  // scored, then masked: they lie before the row's sliding window and after its attention
  // sinks). qs: the queries that score the sink keys (q itself unless sink_q is given).
  // ml: [G, 2], acc: [G, D]. sc: workspace.
  // pf: the next page, whose KV head g is prefetched during the first PV pass.
  void update_group(const float* q, const float* qs, const float* k, const float* v, int64_t sink_end, int64_t lo,
                    int64_t n, float* sc, float* ml, float* acc, const Prefetch& pf, int64_t g) const {
    const int64_t stride = Hkv_ * D;
    float* alphas = sc + G_ * bspad_;  // [G]
    for (int64_t h = 0; h < G_; ++h) score_keys(q + h * D, k, n, stride, sc + h * bspad_);
    if (qs != q && sink_end > 0) {  // sink keys scored by the sink queries (their own workspace row)
      float* tmp = alphas + G_;
      for (int64_t h = 0; h < G_; ++h) {
        score_keys(qs + h * D, k, sink_end, stride, tmp);
        std::memcpy(sc + h * bspad_, tmp, sink_end * sizeof(float));
      }
    }
    for (int64_t h = 0; h < G_; ++h) {
      float* s = sc + h * bspad_;
      for (int64_t j = n; j < bspad_; ++j) s[j] = kNegInf;
      for (int64_t j = sink_end; j < lo; ++j) s[j] = kNegInf;
      alphas[h] = softmax_update(s, ml + 2 * h);
    }
    constexpr int64_t kHeads = kHeadsPerPass;
    for (int64_t h = 0; h < G_;) {
      const int64_t hb = kHeads == 3 && G_ - h == 4 ? 2 : std::min(G_ - h, kHeads);  // 4 heads: 2 + 2, not 3 + 1
      const float* p = sc + h * bspad_;
      const Prefetch next = h == 0 ? pf : Prefetch{};  // once per page
      if (hb == 4) accumulate<4 <= kHeads ? 4 : 1>(p, v, n, alphas + h, acc + h * D, next, g);
      else if (hb == 3) accumulate<3 <= kHeads ? 3 : 1>(p, v, n, alphas + h, acc + h * D, next, g);
      else if (hb == 2) accumulate<2 <= kHeads ? 2 : 1>(p, v, n, alphas + h, acc + h * D, next, g);
      else accumulate<1>(p, v, n, alphas + h, acc + h * D, next, g);
      h += hb;
    }
  }

  // acc[t] = acc[t] * alpha[t] + sum_j p[t][j] v_j for HB heads sharing each V load (p: [HB, bspad]).
  template <int HB>
  void accumulate(const float* p, const float* v, int64_t n, const float* alpha, float* acc, const Prefetch& pf,
                  int64_t g) const {
    const int64_t stride = Hkv_ * D;
#if PAGEDKV_AVX2_ONLY
    // ymm registers throughout: GCC moves 64-byte vector values through general registers
    // and the stack when there is no 512-bit register to hold them.
    constexpr int W = 2 * kColsPerPass;  // ymm per head per pass
    for (int c0 = 0; c0 < 2 * NV; c0 += W) {  // column passes: a lane's sum keeps its j order
      __m256 o[HB][W];
      for (int t = 0; t < HB; ++t) {
        const __m256 a = _mm256_set1_ps(alpha[t]);
        for (int c = 0; c < W; ++c) o[t][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + t * D + (c0 + c) * 8), a);
      }
      const auto step = [&](int64_t j) {
        __m256 vj[W];
        for (int c = 0; c < W; ++c) vj[c] = _mm256_loadu_ps(v + j * stride + (c0 + c) * 8);
        for (int t = 0; t < HB; ++t) {
          const __m256 pj = _mm256_broadcast_ss(p + t * bspad_ + j);
          for (int c = 0; c < W; ++c) o[t][c] = _mm256_fmadd_ps(pj, vj[c], o[t][c]);
        }
      };
      if (c0 == 0 && pf.k != nullptr) {  // prefetching the next page a key at a time (decodes)
        for (int64_t j = 0; j < n; ++j) {
          pf.key(j, g);
          if (j == n - 1)
            for (int64_t jj = n; jj < BS_; ++jj) pf.key(jj, g);
          step(j);
        }
      } else {  // no prefetch: a loop of loads and FMAs alone (a prefill tile's later rows)
        for (int64_t j = 0; j < n; ++j) step(j);
      }
      for (int t = 0; t < HB; ++t)
        for (int c = 0; c < W; ++c) _mm256_storeu_ps(acc + t * D + (c0 + c) * 8, o[t][c]);
    }
#else
    vf o[HB][NV];
    for (int t = 0; t < HB; ++t)
      for (int c = 0; c < NV; ++c) o[t][c] = loadv(acc + t * D + c * kLanes) * alpha[t];
    for (int64_t j = 0; j < n; ++j) {
      pf.key(j, g);
      if (j == n - 1)
        for (int64_t jj = n; jj < BS_; ++jj) pf.key(jj, g);
      vf vj[NV];
      for (int c = 0; c < NV; ++c) vj[c] = loadv(v + j * stride + c * kLanes);
      for (int t = 0; t < HB; ++t) {
        const float pj = p[t * bspad_ + j];
        for (int c = 0; c < NV; ++c) o[t][c] += pj * vj[c];
      }
    }
    for (int t = 0; t < HB; ++t)
      for (int c = 0; c < NV; ++c) storev(acc + t * D + c * kLanes, o[t][c]);
#endif
  }

#if PAGEDKV_AVX2_ONLY
  // Rows 0..rows-1 of a prefill tile, all of which see every key of a page (no mask): the
  // same operations for each (row, head) as update_group, batched over the tile's heads of
  // KV head g: the rescale factors of eight heads in one exponential, PV for up to 6
  // (row, head) pairs per V load. q: the first row's queries [H, D], rows H * D apart; ml, acc: the first row's states [H, 2],
  // [H, D], rows H apart. sc: [kPrefillTile * G, bspad] scores, then 2 * kTilePairs floats.
  void update_tile_page(const float* q, int64_t rows, const float* k, const float* v, float* sc, float* ml,
                        float* acc, const Prefetch& pf, int64_t g) const {
    const int64_t stride = Hkv_ * D, pairs = rows * G_;
    float* alphas = sc + kPrefillTile * G_ * bspad_;  // [pairs], then m_old - m_new [pairs]
    float* diffs = alphas + kTilePairs;
    const float* qs[kTilePairs];
    float *p[kTilePairs], *o[kTilePairs], *mls[kTilePairs], m_new[kTilePairs];
    for (int64_t t = 0; t < pairs; ++t) {
      const int64_t r = (t / G_) * H_ + g * G_ + t % G_;  // (row, head) of pair t
      qs[t] = q + r * D, mls[t] = ml + 2 * r, o[t] = acc + r * D, p[t] = sc + t * bspad_;
    }
    // (scoring two heads per K load, four keys at a time, measured no faster in this loop)
    for (int64_t t = 0; t < pairs; ++t) score_keys(qs[t], k, BS_, stride, p[t]);
    for (int64_t t = 0; t < pairs; ++t) {
      for (int64_t j = BS_; j < bspad_; ++j) p[t][j] = kNegInf;
      m_new[t] = std::max(mls[t][0], avx2::page_max(p[t], bspad_));
      diffs[t] = mls[t][0] - m_new[t];
    }
    for (int64_t t = 0; t < pairs; t += 8) store8(alphas + t, exp_nonpos8(load8(diffs + t)));  // lane-wise: as one at a time
    for (int64_t t = 0; t < pairs; ++t) {
      const float lsum = avx2::page_exp_sum(p[t], m_new[t], bspad_);
      mls[t][0] = m_new[t];
      mls[t][1] = mls[t][1] * alphas[t] + lsum;
      if (t < BS_) pf.key(t, g);  // the next page, a key per pair (outside the FMA loops: GCC spills there)
    }
    for (int64_t j = pairs; j < BS_; ++j) pf.key(j, g);
    for (int64_t t = 0; t < pairs; t += kPairsPerPass) {
      switch (std::min(pairs - t, kPairsPerPass)) {
        case 6: avx2::accumulate_pairs<NV, 6>(p + t, alphas + t, o + t, v, stride, BS_); break;
        case 5: avx2::accumulate_pairs<NV, 5>(p + t, alphas + t, o + t, v, stride, BS_); break;
        case 4: avx2::accumulate_pairs<NV, 4>(p + t, alphas + t, o + t, v, stride, BS_); break;
        case 3: avx2::accumulate_pairs<NV, 3>(p + t, alphas + t, o + t, v, stride, BS_); break;
        case 2: avx2::accumulate_pairs<NV, 2>(p + t, alphas + t, o + t, v, stride, BS_); break;
        default: avx2::accumulate_pairs<NV, 1>(p + t, alphas + t, o + t, v, stride, BS_);
      }
    }
  }
#endif

  // K and V of page `block`'s first n slots as fp32 [BS, Hkv, D]: the page itself (fp32), or
  // converted / dequantized into ws (an L1-sized buffer: only the stored bytes come from memory).
  std::pair<const float*, const float*> page(int64_t block, int64_t n, Workspace& ws) const {
    const int64_t off = block * BS_ * Hkv_ * D;
    switch (a_.kv_type) {
      case KVType::f32:
        return {static_cast<const float*>(a_.k_cache) + off, static_cast<const float*>(a_.v_cache) + off};
      case KVType::i8: return dequantize<KVType::i8>(block, off, n, ws);
      case KVType::f8e4m3: return dequantize<KVType::f8e4m3>(block, off, n, ws);
      case KVType::f8e5m2: return dequantize<KVType::f8e5m2>(block, off, n, ws);
      default:
        convert(static_cast<const uint16_t*>(a_.k_cache) + off, ws.kbuf.data(), n * Hkv_ * D, a_.kv_type);
        convert(static_cast<const uint16_t*>(a_.v_cache) + off, ws.vbuf.data(), n * Hkv_ * D, a_.kv_type);
        return {ws.kbuf.data(), ws.vbuf.data()};
    }
  }

  template <KVType T>
  std::pair<const float*, const float*> dequantize(int64_t block, int64_t off, int64_t n, Workspace& ws) const {
    dequantize_page<T>(static_cast<const uint8_t*>(a_.k_cache) + off, ws.kbuf.data(), block, n, Hkv_, D,
                       a_.k_scale);
    dequantize_page<T>(static_cast<const uint8_t*>(a_.v_cache) + off, ws.vbuf.data(), block, n, Hkv_, D,
                       a_.v_scale);
    return {ws.kbuf.data(), ws.vbuf.data()};
  }

  Prefetch prefetch(int64_t block) const {
    const int64_t elem = element_bytes(a_.kv_type), off = block * BS_ * Hkv_ * D * elem;
    return {static_cast<const char*>(a_.k_cache) + off, static_cast<const char*>(a_.v_cache) + off,
            Hkv_ * D * elem, D * elem};
  }

  // Whether every row first..last of a prefill tile sees every key of page b, unmasked
  // (AVX2 builds take update_tile_page there).
  bool whole_page(const Tile& tl, int64_t first, int64_t last, int64_t b) const {
    if (!PAGEDKV_AVX2_ONLY || tl.nq == 1 || G_ > kMaxGroup) return false;
    return first - b * BS_ + 1 >= BS_ && (a_.window <= 0 || last - a_.window + 1 <= b * BS_);
  }

  void run_item(const Item& it, Workspace& ws, float* scratch) const {
    const Tile& tl = tiles_[it.tile];
    const int64_t* sq = seq(tl.seq);
    const int64_t pos0 = first_pos(tl), last = pos0 + tl.nq - 1;
    const int64_t* table = a_.block_tables + sq[3];
    const int64_t h0 = it.g_begin * G_, h1 = it.g_end * G_;  // the item's query heads
    // (row, head) r = i * H_ + h of rows i0.. and the item's heads h
    const auto for_rows = [&](int64_t i0, auto&& fn) {
      for (int64_t i = i0; i < tl.nq; ++i)
        for (int64_t r = i * H_ + h0; r < i * H_ + h1; ++r) fn(r);
    };
    for (int64_t p = it.p_begin; p < it.p_end; ++p) {
      const int64_t b0 = p * part_pages_, b1 = std::min((p + 1) * part_pages_, last / BS_ + 1);
      const int64_t i0 = std::max<int64_t>(0, b0 * BS_ - pos0);  // first row that sees partition p
      for_rows(i0, [&](int64_t r) {
        ws.cur_ml[2 * r] = kNegInf, ws.cur_ml[2 * r + 1] = 0.0f;
        std::fill(ws.cur_acc.begin() + r * D, ws.cur_acc.begin() + (r + 1) * D, 0.0f);
      });
      const int64_t b_end = std::min(it.p_end * part_pages_, last / BS_ + 1);  // the item's last page + 1
      // pages wholly before the first row's window: no row reads them (a sliding-window table
      // may hold the null page there)
      const int64_t b_win = a_.window > 0 ? std::max<int64_t>(0, pos0 - a_.window + 1) / BS_ : 0;
      const int64_t b_sinks = (a_.sinks + BS_ - 1) / BS_;  // pages holding attention sinks
      for (int64_t b = b0; b < b1; ++b) {
        if (b < b_win && b >= b_sinks) continue;
        const auto [kp, vp] = page(table[b], std::min(BS_, last - b * BS_ + 1), ws);
        const Prefetch next = b + 1 < b_end ? prefetch(table[b + 1]) : Prefetch{};
        // The page after next into L2, whole and in address order: per-key L1 prefetches one
        // page ahead alone left decodes at ~half the read rate of a plain sweep over the same
        // shuffled pages (AMD EPYC family 25); on AVX-512 (AMD EPYC family 26) adding it sped
        // cold-cache decodes up 1.07-1.21x (64 x 200 and 16 x 2,048 tokens, fp32 and fp16
        // pages; three pages ahead no better than two).
        if (b + 2 < b_end) prefetch_page(table[b + 2], it);
#if PAGEDKV_AVX2_ONLY
        if (whole_page(tl, pos0 + i0, last, b)) {
          const int64_t r = i0 * H_;
          for (int64_t g = it.g_begin; g < it.g_end; ++g)
            update_tile_page(a_.q + (sq[0] + tl.q0 + i0) * H_ * D, tl.nq - i0, kp + g * D, vp + g * D,
                             ws.scores.data(), ws.cur_ml.data() + 2 * r, ws.cur_acc.data() + r * D, next, g);
          continue;
        }
#endif
        for (int64_t i = i0; i < tl.nq; ++i) {
          const int64_t n = std::min(BS_, pos0 + i - b * BS_ + 1);
          const int64_t lo = a_.window > 0 ? std::max<int64_t>(0, pos0 + i - a_.window + 1 - b * BS_) : 0;
          const int64_t sink_end = std::min({lo, n, std::max<int64_t>(0, a_.sinks - b * BS_)});
          if (n <= 0 || (lo >= n && sink_end == 0)) continue;  // after the row, or between sinks and window
          const int64_t row = (sq[0] + tl.q0 + i) * H_ * D;
          const float* q = a_.q + row;
          const float* qs = a_.sink_q != nullptr ? a_.sink_q + row : q;
          for (int64_t g = it.g_begin; g < it.g_end; ++g) {
            const int64_t r = i * H_ + g * G_;
            update_group(q + g * G_ * D, qs + g * G_ * D, kp + g * D, vp + g * D, sink_end, std::min(lo, n), n,
                         ws.scores.data(), ws.cur_ml.data() + 2 * r, ws.cur_acc.data() + r * D, i == i0 ? next : Prefetch{}, g);
          }
        }
      }
      for_rows(i0, [&](int64_t r) {
        const float* ml = ws.cur_ml.data() + 2 * r;
        const float* acc = ws.cur_acc.data() + r * D;
        if (tl.scratch >= 0) {
          float* st = scratch + tl.scratch + (p * tl.nq * H_ + r) * state_stride();
          st[0] = ml[0], st[1] = ml[1];
          std::memcpy(st + 2, acc, D * sizeof(float));
        } else if (p == 0) {
          ws.run_ml[2 * r] = ml[0], ws.run_ml[2 * r + 1] = ml[1];
          std::memcpy(ws.run_acc.data() + r * D, acc, D * sizeof(float));
        } else {
          fold<NV>(ws.run_ml.data() + 2 * r, ws.run_acc.data() + r * D, ml, acc);
        }
      });
    }
    if (tl.scratch >= 0) return;
    for_rows(0, [&](int64_t r) {
      finalize<NV>(ws.run_ml.data() + 2 * r, ws.run_acc.data() + r * D, a_.out + (sq[0] + tl.q0) * H_ * D + r * D);
    });
  }

  // The page after next into L2, in address order: the whole page, or the item's KV heads of each slot.
  void prefetch_page(int64_t block, const Item& it) const {
    const Prefetch far = prefetch(block);
    if (it.g_begin == 0 && it.g_end == Hkv_) {
      for (int64_t o = 0; o < BS_ * far.slot_bytes; o += 64)
        __builtin_prefetch(far.k + o, 0, 2), __builtin_prefetch(far.v + o, 0, 2);
      return;
    }
    for (int64_t j = 0; j < BS_; ++j)
      for (int64_t o = j * far.slot_bytes + it.g_begin * far.head_bytes; o < j * far.slot_bytes + it.g_end * far.head_bytes;
           o += 64)
        __builtin_prefetch(far.k + o, 0, 2), __builtin_prefetch(far.v + o, 0, 2);
  }

  // Split mode: fold each (row, head)'s partition states in partition order.
  void combine(const Tile& tl, const float* scratch) const {
    const int64_t pos0 = first_pos(tl), row0 = seq(tl.seq)[0] + tl.q0;
    float ml[2];
    std::vector<float> acc(D);
    for (int64_t r = 0; r < tl.nq * H_; ++r) {
      const int64_t nparts = (pos0 + r / H_) / part_tokens() + 1;
      const float* st = scratch + tl.scratch + r * state_stride();
      ml[0] = st[0], ml[1] = st[1];
      std::memcpy(acc.data(), st + 2, D * sizeof(float));
      for (int64_t p = 1; p < nparts; ++p) {
        const float* sp = st + p * tl.nq * H_ * state_stride();
        fold<NV>(ml, acc.data(), sp, sp + 2);
      }
      finalize<NV>(ml, acc.data(), a_.out + row0 * H_ * D + r * D);
    }
  }

  const PagedAttentionArgs& a_;
  const int64_t H_, Hkv_, G_, BS_, bspad_, part_pages_;
  std::vector<Tile> tiles_;
  std::vector<Item> items_;
  std::vector<int64_t> split_tiles_;
  int64_t scratch_size_ = 0;
  int64_t work_ = 0;  // about the multiply-adds of QK^T (keys x rows x heads x head_dim)
};

template <int NV>
void run_kernel(const PagedAttentionArgs& a) { Kernel<NV>(a).run(); }

}  // namespace

bool paged_attention_supports_head_dim(int64_t head_dim) {
  switch (head_dim) {
    case 16: case 32: case 48: case 64: case 80: case 96: case 128: case 256: return true;
    default: return false;
  }
}

void paged_attention_cpu(const PagedAttentionArgs& a) {
  switch (a.head_dim) {
    case 16: return run_kernel<1>(a);
    case 32: return run_kernel<2>(a);
    case 48: return run_kernel<3>(a);
    case 64: return run_kernel<4>(a);
    case 80: return run_kernel<5>(a);
    case 96: return run_kernel<6>(a);
    case 128: return run_kernel<8>(a);
    case 256: return run_kernel<16>(a);
    default: return;  // unreachable: the binding checks paged_attention_supports_head_dim
  }
}

}  // namespace pagedkv
