"""pagedkv: a KV-cache engine for transformer LLM inference.

    from pagedkv import LLM, SamplingParams
    llm = LLM()
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))

Numerics: pagedkv computes in fp32 with MKL's fastest kernels. ``PAGEDKV_BATCH_INVARIANT=1``
(read here, at import) asks MKL for strict conditional numerical reproducibility so greedy
outputs are bit-identical across batch sizes, chunked prefill, prefix hits and preemption,
at ~1.8x the single-stream decode time; see :mod:`pagedkv.numerics`.
"""

from pagedkv.numerics import apply_env

apply_env()

from pagedkv.config import EngineConfig  # noqa: E402
from pagedkv.engine.llm import LLM  # noqa: E402
from pagedkv.engine.outputs import RequestOutput  # noqa: E402
from pagedkv.engine.sampling_params import SamplingParams  # noqa: E402
from pagedkv.planner import plan  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig", "plan"]
__version__ = "0.1.0"
