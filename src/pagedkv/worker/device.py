"""Where an engine runs and in which dtype (``device``, ``dtype``; vLLM's ``--device`` and
``--dtype``), and what runs there so far.

On the CPU the engine computes in float32 with the C++ kernel library (:mod:`pagedkv.kernels.cpu`).
On a GPU (``cuda``) weights live on the device in the compute dtype (a GGUF's blocks
dequantized on load), attention is the Triton kernel (:mod:`pagedkv.kernels.triton`), linear
layers are torch's (cuBLAS), and sampling runs on the device. A compute dtype other than
float32 (bf16/fp16 on either device) takes the same path: float weights, the Triton or the
reference attention, never the C++ library (its ops are float32 CPU ops).

The CPU and disk KV tiers and swap run on either path: on a GPU the tier is pinned host
memory and its copies run on their own CUDA streams
(:mod:`pagedkv.connectors.offload.device_tier_worker`). Not on a GPU yet (refused with the
reason): int8/int4 weights and int8 activations (CPU kernels), prefill/decode transfer,
tensor parallelism.
"""

from __future__ import annotations

import torch

from pagedkv.config.engine import EngineConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: EngineConfig) -> torch.device:
    """``config.device`` as a torch device (``auto``: cuda when torch sees a GPU).

    Raises:
        ValueError: ``cuda`` where torch has no CUDA device.
    """
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: torch sees no CUDA device here (a CPU build of torch, or no GPU); "
                         "install a CUDA build of torch or use --device cpu")
    return torch.device(config.device)


def compute_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """``config.dtype`` as a torch dtype (``auto``: float32 on the CPU, bfloat16 on a GPU)."""
    if config.dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return TORCH_DTYPES[config.dtype]


def float_path(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the engine runs on float weights and torch/Triton ops (a GPU, or a compute
    dtype other than float32): the C++ library is never called then."""
    return device.type != "cpu" or dtype != torch.float32


def check_features(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse what the float path does not run yet, naming the setting.

    Raises:
        ValueError: a setting that needs the CPU float32 path.
    """
    if not float_path(device, dtype):
        return
    where = f"device {device.type}, dtype {str(dtype).removeprefix('torch.')}"
    for clash, on in (("weight_dtype int8/int4 (CPU kernels; use auto or float32)",
                       config.weight_dtype in ("int8", "int4")),
                      ("activation_dtype int8 (CPU kernels)", config.activation_dtype == "int8"),
                      ("kv_transfer_config", config.kv_transfer_config is not None),
                      ("tensor_parallel_size > 1", config.tensor_parallel_size > 1)):
        if on:
            raise ValueError(f"{where} cannot be combined with {clash} yet")
