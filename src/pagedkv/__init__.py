"""pagedkv: a KV-cache engine for transformer LLM inference.

    from pagedkv import LLM, SamplingParams
    llm = LLM()
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))

Numerics: pagedkv computes in fp32 with the BLAS's fastest kernels. ``PAGEDKV_BATCH_INVARIANT=1``
(or ``LLM(batch_invariant=True)``) computes every matrix product in fixed 16-row tiles so
greedy outputs are bit-identical across batch sizes, chunked prefill, prefix hits and
preemption; see :mod:`pagedkv.numerics`.
"""

from pagedkv.config import EngineConfig
from pagedkv.engine.llm import LLM
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.planner import plan

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig", "plan"]
__version__ = "0.1.0"
