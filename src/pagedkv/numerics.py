"""Batch-invariant numerics on CPU, by construction: fixed row tiles for every matrix product.

By default pagedkv lets the BLAS pick its fastest kernels. For a product of fewer than 16
rows, MKL's fp32 GEMM takes a GEMV-like path whose reduction order differs from the one
it uses for 16+ rows, so a row's result (to the last bit) depends on how many rows share
the product: a request's logits move by ~1e-5 with the batch around it, and a greedy
near-tie can flip.

Batch-invariant mode pads the rows of every linear layer (the LM head included) up to a
multiple of :data:`ROW_TILE` before the product, so no product ever has fewer than 16 rows
and every row goes through the same GEMM kernel whatever the batch: greedy outputs are
bit-identical for batch size 1 and N, under chunked prefill, preemption and prefix hits.
The other operations of a step are row-wise already (norms, RoPE, SwiGLU, softmax), and
the paged-attention kernel fixes each row's reduction order itself.

Why not MKL's own switch (``MKL_CBWR=AUTO,STRICT``, conditional numerical
reproducibility)? MKL honours it on Intel CPUs only: on the AMD EPYC machines this project
also runs on, products of 1-3 rows still differ from the same rows inside a 64-row
product with it set. Measured there, rows of products padded to 8 or 16 rows agree
bit for bit with the same rows inside products of 17 to 2,048 rows; on Intel (AVX-512)
products of 16+ rows agreed already. 16 covers both.

Cost: a single-stream decode step computes 16 rows instead of 1 (memory traffic is the
same, FLOPs x16); products of 16+ rows pay only for the padding to the next multiple of
16. BENCHMARKS.md has the measured step times.

Turn it on with ``PAGEDKV_BATCH_INVARIANT=1`` in the environment (every engine of the
process), ``--batch-invariant`` on the CLI, or ``EngineConfig(batch_invariant=True)`` (one
engine). It can be switched at any time: nothing here is process-wide state of the BLAS.
"""

from __future__ import annotations

import os

ENV = "PAGEDKV_BATCH_INVARIANT"
#: Rows per tile: every product in batch-invariant mode has a multiple of this many rows.
ROW_TILE = 16


def env_requests_invariance() -> bool:
    """True when ``PAGEDKV_BATCH_INVARIANT`` is set to 1/true/yes/on (case-insensitive)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def invariant_linear(x, weight, bias=None):
    """``F.linear(x, weight, bias)`` whose rows do not depend on how many rows ``x`` has.

    ``x`` ``[M, in]``, ``weight`` ``[out, in]``, ``bias`` ``[out]`` or None; returns
    ``[M, out]`` (fp32 in, fp32 out). Zero rows pad ``x`` to a multiple of
    :data:`ROW_TILE`; their results are dropped.
    """
    import torch.nn.functional as F

    m = x.shape[0]
    pad = -m % ROW_TILE
    if not pad:
        return F.linear(x, weight, bias)
    return F.linear(F.pad(x, (0, 0, 0, pad)), weight, bias)[:m]


def linear_for(batch_invariant: bool):
    """The linear function a model uses: ``linear(x, weight, bias=None)`` with a tensor
    weight through :func:`invariant_linear` or torch's own; a weight that is not a tensor
    (an :class:`~pagedkv.model.int8_weights.Int8Weight`) is called with ``(x, bias)``: its
    kernel is batch-invariant by construction."""
    import torch
    import torch.nn.functional as F

    base = invariant_linear if batch_invariant else F.linear

    def linear(x, weight, bias=None):
        if isinstance(weight, torch.Tensor):
            return base(x, weight, bias)
        return weight(x, bias, fallback=base)
    return linear
