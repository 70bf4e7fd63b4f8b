"""How much GPU memory the KV cache gets (``--gpu-memory-utilization``), as vLLM sizes it:
load the weights, run one profiling step of ``max_num_batched_tokens`` tokens, and give the
pages what is left of the device's memory times the utilization::

    KV budget = total x utilization - weights - activation peak - memory torch does not manage
                (the profiling step's peak       (CUDA context, cuBLAS and NCCL workspaces:
                 less the weights)                 used - reserved before the step)

The arithmetic is :func:`kv_budget_bytes` (plain Python, tested on the CPU); the planner takes
the same figures (``pagedkv plan --gpu NAME --activation-peak BYTES``, with the engine's
``activation_peak_bytes + non_torch_bytes``) and so predicts the same ``num_blocks``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedkv.attention.metadata import AttentionMetadata, SeqAttention
from pagedkv.kv.spec import KVCacheSpec
from pagedkv.kv_cache.storage import KVCacheStorage

log = logging.getLogger("pagedkv.memory")


@dataclass(frozen=True)
class MemoryProfile:
    """One profiling step's figures, in bytes (GiB = 2^30 where printed)."""
    total_bytes: int
    weights_bytes: int
    activation_peak_bytes: int
    non_torch_bytes: int

    def kv_budget(self, utilization: float) -> int:
        return kv_budget_bytes(self.total_bytes, utilization, self.weights_bytes, self.activation_peak_bytes,
                               self.non_torch_bytes)

    def describe(self, utilization: float) -> str:
        g = 2**30
        return (f"{self.total_bytes / g:.2f} GiB x {utilization:g} - weights {self.weights_bytes / g:.2f} GiB - "
                f"activation peak {self.activation_peak_bytes / g:.2f} GiB - not torch's "
                f"{self.non_torch_bytes / g:.2f} GiB = KV {self.kv_budget(utilization) / g:.2f} GiB")


def kv_budget_bytes(total: int, utilization: float, weights: int, activation_peak: int, non_torch: int) -> int:
    """The KV cache's bytes (see the module docstring).

    Raises:
        ValueError: nothing left for the KV cache (the message names each term, in GiB).
    """
    budget = int(total * utilization) - weights - activation_peak - non_torch
    if budget <= 0:
        g = 2**30
        raise ValueError(f"no GPU memory left for the KV cache: {total / g:.2f} GiB x {utilization:g} - weights "
                         f"{weights / g:.2f} GiB - activation peak {activation_peak / g:.2f} GiB - not torch's "
                         f"{non_torch / g:.2f} GiB <= 0: raise --gpu-memory-utilization or lower "
                         "--max-num-batched-tokens")
    return budget


@torch.inference_mode()
def profile_step(model, kv_spec: KVCacheSpec, max_num_batched_tokens: int, max_num_seqs: int) -> MemoryProfile:
    """Run one prefill of ``max_num_batched_tokens`` tokens (and the LM head over
    ``max_num_seqs`` rows, the most a step samples) on a scratch cache just large enough,
    on the model's GPU, and measure (see the module docstring)."""
    device = model.device
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    weights = torch.cuda.memory_allocated(device)
    non_torch = (total - free) - torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    n = max_num_batched_tokens
    pages = -(-n // kv_spec.block_size) + 1
    scratch = KVCacheStorage(kv_spec, pages, device=str(device))
    table = torch.arange(1, pages, dtype=torch.int64)
    ids = torch.randint(0, model.embed.shape[0], (n,), device=device)
    positions = torch.arange(n, device=device)
    meta = AttentionMetadata(torch.arange(kv_spec.block_size, kv_spec.block_size + n, device=device),
                             [SeqAttention(0, n, n, table)])
    hidden = model.forward(ids, positions, scratch, meta)
    model.logits(hidden[:max(1, min(max_num_seqs, n))])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - weights - scratch.nbytes
    del scratch, hidden
    torch.cuda.empty_cache()
    profile = MemoryProfile(int(total), int(weights), max(0, int(peak)), max(0, int(non_torch)))
    log.info("GPU memory: %s", profile)
    return profile
