"""CUDA graphs for decode steps, as vLLM runs them: the model's forward of a batch of decodes
captured once per batch-size bucket over persistent device buffers, replayed each step.

A step qualifies when every scheduled request computes exactly one token (no prefill chunk,
no drafts to verify) and the batch fits the largest bucket; the batch is padded to the
next bucket. Each step the runner copies its token ids, positions, slots and block tables
into the buffers and replays the bucket's graph; logits and sampling run eagerly after it
(prefill and mixed steps run eagerly too). Nothing inside a captured forward reads back to
the host: the attention kernel takes its sequence layout from the buffers
(:class:`~pagedkv.attention.metadata.KernelArgs`), the RoPE lookup skips its bounds check
(positions stay below ``max_model_len``).

Persistent buffers, sized for the largest bucket ``B`` and ``P = ceil(max_model_len / block_size)``
pages a sequence::

    input_ids [B]  positions [B]  slot_mapping [B]  seq_info [B, 5]  tables [B * P]
    tile_seq [B]   tile_first [B]                                     (int64)

Padding sequences have query length 0 (the kernel stores nothing for them) and write their
K/V to slot 0 of the null page, which is zeroed again at the end of the captured forward.
Graphs need one full-attention KV group (no window pages going back, no null page in a
table). With ``capture=False`` the same buffers and padding run eagerly: that is how the
CPU tests check this bookkeeping.
"""

from __future__ import annotations

import logging

import torch

from pagedkv.attention.metadata import AttentionMetadata, KernelArgs

log = logging.getLogger("pagedkv.cuda_graphs")
LARGEST_BUCKET = 256


def graph_buckets(max_num_seqs: int, largest: int = LARGEST_BUCKET) -> list[int]:
    """Batch sizes with a graph: 1, 2, 4, 8, then every multiple of 8 up to
    ``min(max_num_seqs, largest)`` (vLLM's choice), and that maximum itself."""
    top = max(1, min(max_num_seqs, largest))
    sizes = [b for b in (1, 2, 4, 8) if b <= top] + list(range(16, top + 1, 8))
    return sorted(set(sizes) | {top})


def bucket_for(batch: int, buckets: list[int]) -> int | None:
    """The smallest bucket holding ``batch`` decodes, or None (past the largest: eager)."""
    return next((b for b in buckets if b >= batch), None)


class DecodeGraphs:
    """Captured decode forwards of ``model`` over ``kv_cache``, one per bucket.

    Args:
        model: the decoder (on a GPU for capture).
        kv_cache: its KV cache (:class:`~pagedkv.kv_cache.storage.KVCacheStorage`).
        block_size: tokens per page.
        max_num_seqs, max_model_len: the engine's limits (buffer sizes).
        capture: record CUDA graphs (a GPU); False runs the same padded forward eagerly.
    """

    def __init__(self, model, kv_cache, block_size: int, max_num_seqs: int, max_model_len: int,
                 capture: bool = True) -> None:
        self.model, self.kv_cache, self.block_size, self.capture = model, kv_cache, block_size, capture
        self.buckets = graph_buckets(max_num_seqs)
        self.max_pages = -(-max_model_len // block_size)
        b, dev, i64 = self.buckets[-1], model.device, torch.int64
        self.input_ids = torch.zeros(b, dtype=i64, device=dev)
        self.positions = torch.zeros(b, dtype=i64, device=dev)
        self.slot_mapping = torch.zeros(b, dtype=i64, device=dev)
        self.seq_info = torch.zeros(b, 5, dtype=i64, device=dev)
        self.tables = torch.zeros(b * self.max_pages, dtype=i64, device=dev)
        self.tile_seq = torch.arange(b, dtype=i64, device=dev)
        self.tile_first = torch.zeros(b, dtype=i64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0  # decode steps run through a graph (or, with capture=False, its padded forward)

    def _meta(self, bucket: int) -> AttentionMetadata:
        args = KernelArgs(self.seq_info[:bucket], self.tables[:bucket * self.max_pages], self.tile_seq[:bucket],
                          self.tile_first[:bucket], self.max_pages, splits_for(bucket, self.max_pages))
        return AttentionMetadata(self.slot_mapping[:bucket], [], args)

    def _forward(self, bucket: int) -> torch.Tensor:
        hidden = self.model.forward(self.input_ids[:bucket], self.positions[:bucket], self.kv_cache,
                                    self._meta(bucket), graph_safe=True)
        for i in range(self.kv_cache.num_layers):  # padding rows wrote to the null page: clean it again
            pages = self.kv_cache.layer(i)
            pages.k[0].zero_()
            pages.v[0].zero_()
        return hidden

    def capture_all(self) -> None:
        """Record every bucket's graph, the largest first (they share one memory pool)."""
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            self.fill([], [], [], [], bucket)
            for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                self._forward(bucket)
            torch.cuda.synchronize(self.model.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[bucket] = self._forward(bucket)
            self.graphs[bucket] = graph
        log.info("captured CUDA graphs for decode batches of %s", ", ".join(map(str, self.buckets)))

    def fill(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
             bucket: int) -> None:
        """Copy a decode batch into the buffers, padded to ``bucket`` (padding: query length
        0, slot 0 of the null page)."""
        n, p = len(ids), self.max_pages
        info = torch.zeros(bucket, 5, dtype=torch.int64)
        info[:, 3] = torch.arange(bucket) * p
        info[:, 4] = p
        flat = torch.zeros(bucket * p, dtype=torch.int64)
        for i, (pos, table) in enumerate(zip(positions, tables)):
            info[i, :3] = torch.tensor([i, 1, pos + 1])
            flat[i * p:i * p + len(table)] = torch.tensor(table, dtype=torch.int64)
        pad = [0] * (bucket - n)
        for buf, values in ((self.input_ids, ids + pad), (self.positions, positions + pad),
                            (self.slot_mapping, slots + pad)):
            buf[:bucket].copy_(torch.tensor(values, dtype=torch.int64), non_blocking=True)
        self.seq_info[:bucket].copy_(info, non_blocking=True)
        self.tables[:bucket * p].copy_(flat, non_blocking=True)

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a decode batch (one token per request; ``tables``:
        each request's block table). Raises ValueError past the largest bucket."""
        bucket = bucket_for(len(ids), self.buckets)
        if bucket is None:
            raise ValueError(f"a decode batch of {len(ids)} is past the largest graph ({self.buckets[-1]})")
        self.fill(ids, positions, slots, tables, bucket)
        self.replays += 1
        if self.capture:
            self.graphs[bucket].replay()
            return self.outputs[bucket][:len(ids)]
        return self._forward(bucket)[:len(ids)]


def splits_for(bucket: int, max_pages: int) -> int:
    """Flash-decoding splits of a bucket's graph: fixed at capture, for the longest context
    (small batches split their pages; 16 pages a split at least)."""
    if bucket >= 64 or max_pages < 32:
        return 1
    return min(16, 1 << max(0, (min(256 // bucket, max_pages // 16)).bit_length() - 1))
