"""The one-call decoder layer (``csrc/decoder_layer.cpp``, issue 17 item 4): on the default
GGUF model (Q4_1/Q8_0 or int8 weights, fp32 or fp16 pages) it computes exactly what the per-op path does:
the same tokens and bit-identical log-probs, through prefill chunks, decode batches and
prefix hits; it steps aside where it does not apply (quantized pages, reference mode)."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from pagedkv.attention.kernel import load_kernel

PROMPTS = ["Tell me about dragons.", "What is 2 + 2? Explain it in detail, step by step.",
           "Write a haiku about the sea." * 6]


@pytest.fixture(scope="module")
def engines(default_model_files):
    from pagedkv import LLM

    load_kernel()
    # a small step budget: the long prompt is prefilled in chunks beside the others' decodes
    engines = {kv: LLM(num_blocks=96, max_num_batched_tokens=24, enable_prefix_caching=True, kv_cache_dtype=kv)
               for kv in ("auto", "float16", "int8")}
    engines["int8 weights"] = LLM(num_blocks=96, max_num_batched_tokens=24, enable_prefix_caching=True,
                                  weight_dtype="int8")
    return engines


def _run(llm, fused: bool):
    llm.engine.model.fused_layers = fused
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    try:
        return [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, params)]
    finally:
        llm.engine.model.fused_layers = True


@pytest.mark.parametrize("kv", ["auto", "float16", "int8 weights"])
def test_the_fused_layer_is_bit_identical_to_the_per_op_path(engines, kv):
    llm = engines[kv]
    assert llm.engine.model.fused_op(llm.engine.parts.storage) is not None  # it is the path taken
    fused = _run(llm, True)
    assert _run(llm, False) == fused
    assert _run(llm, True) == fused  # again, now with prefix hits
    assert llm.engine.stats().prefix_cache_hits > 0


def test_it_steps_aside_for_quantized_pages_and_reference_mode(engines, monkeypatch):
    llm = engines["int8"]
    assert llm.engine.model.fused_op(llm.engine.parts.storage) is None
    auto = engines["auto"]
    monkeypatch.setenv("PAGEDKV_ATTENTION", "reference")
    assert auto.engine.model.fused_op(auto.engine.parts.storage) is None
