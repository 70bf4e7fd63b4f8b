"""GPU kernels in Triton: paged attention for mixed batches (:mod:`~pagedkv.kernels.triton.paged_attention`)
and page copies between KV pools (:mod:`~pagedkv.kernels.triton.page_copy`).

Importing a kernel module imports ``triton``; CI runs them under ``TRITON_INTERPRET=1`` on
CPU tensors, against the torch reference. Nothing here is imported on a CPU-only path.
"""
