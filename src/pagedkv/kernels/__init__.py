"""Compiled ops, one family per device: :mod:`~pagedkv.kernels.cpu` (C++, AVX2/AVX-512,
built on first use). Kernels import nothing of pagedkv; what calls them chooses between a
kernel and its reference (:mod:`pagedkv.attention.dispatch` for attention)."""
