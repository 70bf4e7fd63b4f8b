"""The one-call decoder layer and the one-call stack of layers (``csrc/decoder_layer.cpp``,
issue 17 item 4): on the default GGUF model (Q4_1/Q8_0 blocks with fp32 or int8 activations, or
int8 weights; fp32, fp16 or bf16 pages, written by the layer's own C++ copy) they compute
exactly what the per-op path does: the same tokens and bit-identical log-probs, through prefill
chunks, decode batches and prefix hits; it steps aside where it does not apply (quantized
pages, reference mode)."""

from __future__ import annotations

import pytest

from pagedkv import SamplingParams
from pagedkv.kernels.cpu.library import load_kernel

PROMPTS = ["Tell me about dragons.", "What is 2 + 2? Explain it in detail, step by step.",
           "Write a haiku about the sea." * 6]


@pytest.fixture(scope="module")
def engines(default_model_files):
    from pagedkv import LLM

    load_kernel()
    # a small step budget: the long prompt is prefilled in chunks beside the others' decodes
    engines = {kv: LLM(num_blocks=96, max_num_batched_tokens=24, enable_prefix_caching=True, kv_cache_dtype=kv)
               for kv in ("auto", "float16", "bfloat16", "int8")}
    engines["int8 weights"] = LLM(num_blocks=96, max_num_batched_tokens=24, enable_prefix_caching=True,
                                  weight_dtype="int8")
    engines["int8 activations"] = LLM(num_blocks=96, max_num_batched_tokens=24, enable_prefix_caching=True,
                                      activation_dtype="int8")
    return engines


def _run(llm, mode: str):
    """Generate with every layer in one call ("stack"), one call per layer ("layer") or op by op."""
    model = llm.engine.model
    model.fused_layers, model.fused_stack = mode != "per-op", mode == "stack"
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    try:
        return [(o.token_ids, o.logprobs) for o in llm.generate(PROMPTS, params)]
    finally:
        model.fused_layers = model.fused_stack = True


@pytest.mark.parametrize("kv", ["auto", "float16", "bfloat16", "int8 weights", "int8 activations"])
def test_the_fused_layer_and_stack_are_bit_identical_to_the_per_op_path(engines, kv, monkeypatch):
    llm = engines[kv]
    model = llm.engine.model
    assert model.fused_op(llm.engine.parts.kv_cache) is not None  # it is the path taken
    calls = []
    stack = model._forward_stack
    monkeypatch.setattr(model, "_forward_stack", lambda *a: calls.append(1) or stack(*a))
    fused = _run(llm, "stack")
    assert calls  # the stack ran
    assert _run(llm, "layer") == fused
    assert _run(llm, "per-op") == fused
    assert _run(llm, "stack") == fused  # again, now with prefix hits
    assert llm.engine.stats().prefix_cache_hits > 0


def test_the_stack_steps_aside_for_connectors_and_several_kv_groups(engines):
    model = engines["auto"].engine.model
    fused = model.fused_op(engines["auto"].engine.parts.kv_cache)
    a, b = object(), object()
    layers = len(model.layers)
    assert model.stack_op(fused, [a] * layers, None) is not None
    assert model.stack_op(fused, [a] * (layers - 1) + [b], None) is None  # two block tables
    assert model.stack_op(fused, [a] * layers, object()) is None  # a KV connector between layers
    assert model.stack_op(None, [a] * layers, None) is None


def test_it_steps_aside_for_quantized_pages_and_reference_mode(engines, monkeypatch):
    llm = engines["int8"]
    assert llm.engine.model.fused_op(llm.engine.parts.kv_cache) is None
    auto = engines["auto"]
    monkeypatch.setenv("PAGEDKV_ATTENTION", "reference")
    assert auto.engine.model.fused_op(auto.engine.parts.kv_cache) is None


def test_the_stack_is_bit_identical_with_windows_and_sinks(default_model_files):
    """Streaming eviction gives every layer a window and sinks, and rows past the cache's
    positions score the sinks with re-rotated queries: the stack passes all of them."""
    from pagedkv import LLM

    llm = LLM(num_blocks=96, max_num_batched_tokens=24, kv_eviction="streaming", kv_window_tokens=32,
              num_sink_tokens=4)
    model = llm.engine.model
    fused_op = model.fused_op(llm.engine.parts.kv_cache)
    assert model.layers[0].window == 32 and model.stack_op(fused_op, [None] * len(model.layers), None) is not None
    fused = _run(llm, "stack")
    assert _run(llm, "per-op") == fused and _run(llm, "layer") == fused


def test_the_stack_is_bit_identical_on_a_long_prompt_with_int8_activations(default_model_files):
    """A prompt prefilled in one 300-row step: the stack's products quantize 64 rows or more
    on several threads (each into the calling thread's buffers), its norms and RoPE split
    rows over threads; the result must still be the per-op path's, bit for bit."""
    from pagedkv import LLM

    llm = LLM(num_blocks=96, activation_dtype="int8")
    model = llm.engine.model
    prompt = "Tell me a long story about a dragon and a knight, in many chapters. " * 20
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    outs = {}
    for mode in ("stack", "per-op"):
        model.fused_layers, model.fused_stack = mode != "per-op", mode == "stack"
        try:
            (o,) = llm.generate([prompt], params)
        finally:
            model.fused_layers = model.fused_stack = True
        assert len(o.prompt_token_ids) > 256
        outs[mode] = (o.token_ids, o.logprobs, o.prompt_logprobs)
    assert outs["stack"] == outs["per-op"]


def test_the_stack_checks_every_layer_and_that_every_row_has_a_sequence(default_model_files):
    """Bad arguments on any layer are refused as the per-layer op refuses them (the stack
    validates block tables once a step, windows and sinks on every layer), and rows that no
    sequence covers are refused instead of reading a reused buffer's stale values."""
    import torch

    from pagedkv import LLM

    llm = LLM(num_blocks=64, kv_eviction="streaming", kv_window_tokens=32, num_sink_tokens=4)
    model, calls = llm.engine.model, []
    stack = model._forward_stack

    def capture(op, *a):
        return stack(lambda *args: calls.append(args) or op(*args), *a)
    model._forward_stack = capture
    llm.generate(["dragon " * 60], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    args = list(calls[0])  # the prefill: 60-odd rows of one sequence
    names = {"windows": 18, "sinks": 19, "sink_cos": 20, "seq_info": 15}
    layers = len(args[1])
    op = torch.ops.pagedkv.decoder_stack
    assert op(*args).shape == args[0].shape

    def refused(match, **changes):
        bad = list(args)
        for name, value in changes.items():
            bad[names[name]] = value
        with pytest.raises(RuntimeError, match=match):
            op(*bad)

    refused("window must be >= 0", windows=[32, -5] + [32] * (layers - 2))
    refused("need a window", windows=[32, 0] + [32] * (layers - 2))
    refused("sinks is 0", sinks=0)
    short = args[15].clone()
    short[0, 1] -= 1  # the sequence's last row belongs to no sequence
    short[0, 2] -= 1
    refused("belongs to no sequence", seq_info=short)
