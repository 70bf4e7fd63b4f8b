"""KV settings named on the ``pagedkv eval`` command line: ``dtype`` or ``dtype:granularity``.

    float32, float16, bfloat16                     unquantized (granularity ignored)
    int8, fp8_e4m3, fp8_e5m2                       per-token-head scales (the default)
    int8:per-head, fp8_e4m3:per-tensor, ...        another scale granularity
"""

from __future__ import annotations

from typing import NamedTuple

from pagedkv.config.engine import KV_CACHE_DTYPES, KV_CACHE_SCALES, KV_DTYPE_ALIASES
from pagedkv.kv_cache import quant


class KVSetting(NamedTuple):
    dtype: str
    scale: str = "per-token-head"

    @property
    def label(self) -> str:
        return f"{self.dtype}:{self.scale}" if self.dtype in quant.QMAX else self.dtype

    def engine_args(self) -> dict:
        return {"kv_cache_dtype": self.dtype, "kv_cache_scale": self.scale}


def parse_settings(text: str, default_scale: str = "per-token-head") -> list[KVSetting]:
    """``"float32,int8,int8:per-tensor"`` -> settings, in order (the first is the baseline);
    a quantized dtype without ``:granularity`` takes ``default_scale``.
    Names of one setting (``auto``/``float32``, ``int8``/``int8:per-token-head``; a granularity
    on an unquantized dtype is ignored) count once: later repeats are dropped.

    Raises:
        ValueError: for an unknown dtype or granularity, or an empty list.
    """
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        dtype, _, scale = item.partition(":")
        dtype = {"auto": "float32", **KV_DTYPE_ALIASES}.get(dtype, dtype)
        if dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown KV dtype {dtype!r} in {item!r} (one of {', '.join(KV_CACHE_DTYPES)})")
        scale = scale or default_scale
        if scale not in KV_CACHE_SCALES:
            raise ValueError(f"unknown scale granularity {scale!r} in {item!r} (one of {', '.join(KV_CACHE_SCALES)})")
        setting = KVSetting(dtype, scale if dtype in quant.QMAX else "per-token-head")
        if setting not in out:
            out.append(setting)
    if not out:
        raise ValueError("no KV setting given")
    return out
