"""The CPU kernel library: C++ sources in ``csrc/`` (paged attention, the one-call decoder
layer and stack, int8/GGML/W8A8 linear layers, page copies), built and loaded by
:mod:`~pagedkv.kernels.cpu.library`, reached through :mod:`~pagedkv.kernels.cpu.ops`."""
