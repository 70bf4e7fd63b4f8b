"""pagedkv: a KV-cache engine for transformer LLM inference.

    from pagedkv import LLM, SamplingParams
    llm = LLM()
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))

Numerics: pagedkv computes in fp32 and asks MKL for conditional numerical reproducibility
(``MKL_CBWR=AUTO,STRICT``, set here unless already set) so a matrix row's result does not
depend on how many rows share the product; greedy outputs are then bit-identical across
batch sizes, chunked prefill, prefix hits and preemption. Set ``MKL_CBWR`` yourself (for
example to ``AUTO``) before importing to trade that for MKL's fastest small-batch kernels.
"""

import os

os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from pagedkv.config import EngineConfig  # noqa: E402
from pagedkv.engine.llm import LLM  # noqa: E402
from pagedkv.engine.outputs import RequestOutput  # noqa: E402
from pagedkv.engine.sampling_params import SamplingParams  # noqa: E402
from pagedkv.planner import plan  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "EngineConfig", "plan"]
__version__ = "0.1.0"
