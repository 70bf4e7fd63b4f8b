"""Page-locked host tensors of exactly the size asked (a GPU's CPU tier and its staging pages).

``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which
rounds every block up to the next power of two: a 20 GiB tier would lock 32 GiB of the
host's memory (pytorch#95823; SGLang and vLLM users hit the same). So a tier tensor is
allocated as ordinary host memory and then locked in place with ``cudaHostRegister``
(through ``torch.cuda.cudart()``): exactly its bytes, and, under unified addressing, the
same address is valid on the GPU (the page-copy kernel reads and writes it directly), and
torch sees it as pinned (``is_pinned()``: asynchronous copies). The registration is undone
when the tensor is collected.

Without CUDA (the CPU's float path) the tensor is ordinary memory: nothing to lock.
"""

from __future__ import annotations

import weakref

import torch


def _cudart():
    return torch.cuda.cudart()


def _unregister(ptr: int) -> None:
    try:
        _cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - interpreter shutdown may have torn down CUDA first
        pass


def pinned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor of ``shape`` and ``dtype``, page-locked where CUDA is
    available (see the module docstring).

    Raises:
        RuntimeError: ``cudaHostRegister`` refused (for example, the host's locked-memory
            limit), with CUDA's error and the size asked.
    """
    t = torch.empty(shape, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0 or not torch.cuda.is_available():
        return t
    err = _cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(err) != 0:
        raise RuntimeError(f"cannot lock {nbytes / 2**30:.2f} GiB of host memory for the KV tier "
                           f"(cudaHostRegister: {err}); give a smaller --kv-offload-memory")
    weakref.finalize(t, _unregister, t.data_ptr())
    return t
