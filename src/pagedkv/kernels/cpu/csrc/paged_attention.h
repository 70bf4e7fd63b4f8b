// Fused CPU paged attention: shared declarations of the kernel (pure C++/OpenMP) and its
// torch binding. Shape contract (same as pagedkv/attention/reference.py):
//
//   q            [T, num_heads, head_dim]                           fp32, contiguous
//   k/v cache    [num_blocks, block_size, num_kv_heads, head_dim]   fp32 | fp16 | bf16 | int8 | fp8
//                (e4m3fn, e5m2), contiguous
//   k/v scale    quantized caches only, fp32 or bf16: [num_blocks, block_size, num_kv_heads]
//                (per-token-head), [num_kv_heads, head_dim] (per-channel, fp32), [num_kv_heads]
//                (per-head) or [1] (per-tensor); a stored value q of slot j, KV head g,
//                channel c in block b reads as float(q) * scale[b, j, g] (or scale[g, c])
//   seq_info     [S, 5] int64: query_start, query_len, context_len, table_offset, table_len
//   block_tables [sum table_len] int64: every sequence's block table, concatenated
//   out          [T, num_heads, head_dim]                           fp32
//
// Query row r of sequence i sits at position context_len - query_len + r and sees keys
// 0..position (causal), or with a sliding window W > 0 keys position - W + 1..position (the
// W most recent, itself included: Mistral's and HF's convention) plus, with S sinks, keys
// 0..S-1 (StreamingLLM's attention sinks), those before the row's window scored with
// sink_q's row where it is given;
// query head h reads KV head h / (num_heads / num_kv_heads).
#pragma once

#include <cstdint>

namespace pagedkv {

enum class KVType : int { f32 = 0, f16 = 1, bf16 = 2, i8 = 3, f8e4m3 = 4, f8e5m2 = 5 };

inline bool is_quantized(KVType t) { return t == KVType::i8 || t == KVType::f8e4m3 || t == KVType::f8e5m2; }
inline int64_t element_bytes(KVType t) { return t == KVType::f32 ? 4 : is_quantized(t) ? 1 : 2; }

// Where a quantized cache's scales live: scale of (block b, slot j, KV head g) at
// b * strides[0] + j * strides[1] + g * strides[2]; per_channel: a [Hkv, D] fp32 table,
// channel c of head g at g * D + c.
struct ScaleLayout {
  const void* data = nullptr;
  int64_t strides[3] = {0, 0, 0};
  bool bf16 = false;
  bool per_channel = false;
};

struct PagedAttentionArgs {
  const float* q;             // [T, H, D]
  const void* k_cache;        // [NB, BS, Hkv, D], element type kv_type
  const void* v_cache;
  KVType kv_type;
  ScaleLayout k_scale;        // quantized caches only
  ScaleLayout v_scale;
  const int64_t* seq_info;    // [S, 5]
  const int64_t* block_tables;
  float* out;                 // [T, H, D]
  int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  int split;                  // context partitions on separate threads: -1 auto, 0 never, 1 always
  int64_t window = 0;         // sliding window in tokens, 0 = none (causal over the whole context)
  int64_t sinks = 0;          // with a window: the first `sinks` positions stay visible to every row
  // [T, H, D] or null: the queries that score the sinks before a row's window (StreamingLLM's
  // positions within the cache: q rotated to the row's cache position)
  const float* sink_q = nullptr;
  float softcap = 0.0f;       // > 0: scores become softcap * tanh(score / softcap) (Gemma 2), before masking
};

// Head sizes the kernel is instantiated for (multiples of 16 floats).
bool paged_attention_supports_head_dim(int64_t head_dim);

// Runs the kernel; arguments must already be validated by the caller.
void paged_attention_cpu(const PagedAttentionArgs& args);

}  // namespace pagedkv
