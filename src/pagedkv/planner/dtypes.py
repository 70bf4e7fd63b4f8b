"""Dtype names the planner accepts, and how ``auto`` resolves.

KV cache dtypes are those of :data:`pagedkv.kv.spec.DTYPE_BYTES` (the engine's
storage arithmetic); weight dtypes are the same names. Short spellings (``fp16``,
``bf16``, ``fp8``, ...) are accepted and normalised.

``auto`` follows the engine: a KV cache is stored in the compute dtype. On the CPU
(``--gpu cpu`` or no ``--gpu``) the engine computes in float32 (DESIGN.md,
"Numerics on these CPUs"), so ``auto`` is float32 for both. On a GPU the compute
dtype is the checkpoint's ``torch_dtype`` (float16 or bfloat16), with float32
checkpoints served in bfloat16; a checkpoint whose config declares FP8 weights
(``quantization_config.quant_method == "fp8"``, e.g. DeepSeek-V3) keeps FP8 weights
while its KV cache is bfloat16.
"""

from __future__ import annotations

from pagedkv.kv.spec import DTYPE_BYTES

ALIASES = {
    "fp32": "float32", "f32": "float32", "float": "float32",
    "fp16": "float16", "f16": "float16", "half": "float16",
    "bf16": "bfloat16",
    "fp8": "fp8_e4m3", "e4m3": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3",
    "e5m2": "fp8_e5m2", "float8_e5m2": "fp8_e5m2",
}
#: Bytes per weight parameter. int4 is 4 bits, its scales not counted; the GGML block
#: formats the CPU engine computes with count theirs (ggml-common.h: block_q4_1 is an fp16
#: scale, an fp16 minimum and 32 nibbles, 20 bytes per 32 weights; block_q8_0 is an fp16
#: scale and 32 int8, 34 bytes per 32).
WEIGHT_DTYPE_BYTES: dict[str, float] = dict(DTYPE_BYTES) | {"q4_1": 20 / 32, "q8_0": 34 / 32}


def normalize(name: str, what: str) -> str:
    """Canonical dtype name for ``name`` (``"auto"`` stays ``"auto"``).

    Raises:
        ValueError: for an unknown name; ``what`` names the option in the message.
    """
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    names = WEIGHT_DTYPE_BYTES if what == "weight dtype" else DTYPE_BYTES
    if key == "auto" or key in names:
        return key
    raise ValueError(f"unknown {what} {name!r}; choose auto or one of {', '.join(names)}")


def compute_dtype(torch_dtype: str | None, on_gpu: bool) -> str:
    """The dtype the engine computes in: float32 on CPU, the checkpoint's 16-bit type on a GPU."""
    if not on_gpu:
        return "float32"
    name = ALIASES.get(str(torch_dtype or "bfloat16").lower(), str(torch_dtype or "bfloat16").lower())
    return name if name in ("float16", "bfloat16") else "bfloat16"


def resolve_kv(kv_dtype: str, torch_dtype: str | None, on_gpu: bool) -> str:
    """Resolve a KV cache dtype; ``auto`` is the compute dtype."""
    kv = normalize(kv_dtype, "kv cache dtype")
    return compute_dtype(torch_dtype, on_gpu) if kv == "auto" else kv


def resolve_weights(weight_dtype: str, torch_dtype: str | None, on_gpu: bool,
                    quant_method: str | None = None) -> str:
    """Resolve a weight dtype; ``auto`` is the compute dtype, or fp8_e4m3 for FP8 checkpoints on a GPU."""
    w = normalize(weight_dtype, "weight dtype")
    if w != "auto":
        return w
    if on_gpu and quant_method == "fp8":
        return "fp8_e4m3"
    return compute_dtype(torch_dtype, on_gpu)
