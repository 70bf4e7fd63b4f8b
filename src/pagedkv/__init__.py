"""pagedkv: a KV-cache engine for transformer LLM inference.

    from pagedkv import LLM, SamplingParams
    llm = LLM()
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))

The names below load on first use (a module ``__getattr__``, PEP 562): importing a
torch-free part such as ``pagedkv.kv.block_pool`` or ``pagedkv.planner`` does not pay
for torch and the model code.

Numerics: pagedkv computes in fp32 with the BLAS's fastest kernels. ``PAGEDKV_BATCH_INVARIANT=1``
(or ``LLM(batch_invariant=True)``) computes every matrix product in fixed 16-row tiles so
greedy outputs are bit-identical across batch sizes, chunked prefill, prefix hits and
preemption; see :mod:`pagedkv.numerics`.
"""

from importlib import import_module

#: public name -> module that defines it
_LAZY = {"LLM": "pagedkv.engine.llm", "SamplingParams": "pagedkv.core.sampling_params",
         "RequestOutput": "pagedkv.engine.outputs", "EngineConfig": "pagedkv.config.engine",
         "plan": "pagedkv.planner", "simulate": "pagedkv.sim.run"}

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig", "plan", "simulate"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
