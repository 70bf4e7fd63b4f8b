"""One config.json parser and one KVCacheSpec builder for the engine and the planner.

The engine's view (``load_model_config``) and the planner's (``load_model``) of the same
file must give the same KVCacheSpec, sliding windows included; the engine only adds its
refusal of non-Llama architectures and its default positions.
"""

from __future__ import annotations

import json

import pytest

from pagedkv.core.limits import resolve_max_model_len
from pagedkv.model.config import for_engine
from pagedkv.model.hf_config import parse
from pagedkv.model.loader import load_model_config
from pagedkv.planner.models import load_model

BASE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=32768)
W = 4096


def _write(tmp_path, cfg: dict):
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize("extra,windows", [
    (dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=W), (W,) * 4),
    (dict(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None), ()),
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=W, use_sliding_window=False), ()),
    (dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=W, use_sliding_window=True,
          max_window_layers=2), (None, None, W, W)),
    (dict(architectures=["LlamaForCausalLM"], model_type="llama"), ()),
], ids=["mistral", "mistral-no-window", "qwen2-unused-window", "qwen2-max-window-layers", "llama"])
def test_engine_and_planner_parse_the_same_windows_and_spec(tmp_path, extra, windows):
    folder = _write(tmp_path, BASE | extra)
    engine, planner = load_model_config(folder), load_model(str(folder))
    assert engine.layer_windows == planner.layer_windows == windows
    for kw in (dict(dtype="float32", block_size=16), dict(dtype="int8", block_size=32, scale_granularity="per-head")):
        assert engine.kv_spec(**kw) == planner.kv_spec(**kw)
    assert engine.kv_spec("float16", tp=2).num_kv_heads == 1


def test_a_window_no_longer_caps_the_engine_length(tmp_path):
    """Windowed attention runs past the window (tests/test_sliding_window.py), so the limit is
    the model's positions."""
    mistral = load_model_config(_write(tmp_path, BASE | dict(architectures=["MistralForCausalLM"], sliding_window=W)))
    assert mistral.sliding_window == W and resolve_max_model_len(mistral, None) == 32768
    assert resolve_max_model_len(mistral, W + 1) == W + 1
    with pytest.raises(ValueError, match="limit of 32768"):
        resolve_max_model_len(mistral, 32769)
    qwen = parse(BASE | dict(model_type="qwen2", sliding_window=W, use_sliding_window=False))
    assert qwen.sliding_window is None and resolve_max_model_len(for_engine(qwen), None) == 32768


def test_gemma_layer_patterns():
    g2 = parse(BASE | dict(model_type="gemma2", sliding_window=W))
    assert g2.layer_windows == (W, None, W, None)
    g3 = parse(BASE | dict(model_type="gemma3_text", sliding_window=W, sliding_window_pattern=2))
    assert g3.layer_windows == (W, None, W, None)
    six = parse(BASE | dict(model_type="gemma3_text", num_hidden_layers=12))  # Gemma3TextConfig's defaults
    assert six.layer_windows == (4096,) * 5 + (None,) + (4096,) * 5 + (None,)
    assert (six.rope_theta, six.local_rope_theta, six.qk_norm, six.final_logit_softcapping) == (1e6, 1e4, True, None)
    typed = parse(BASE | dict(sliding_window=W, layer_types=["full_attention"] + ["sliding_attention"] * 3))
    assert typed.layer_windows == (None, W, W, W) and typed.sliding_layers == 3
    spec = typed.kv_spec("float16", block_size=16)
    assert spec.bytes_for_tokens(10_000) == (10_000 + 3 * W) * spec.bytes_per_token_layer
    with pytest.raises(ValueError, match="layer_types has 2 entries"):
        parse(BASE | dict(sliding_window=W, layer_types=["full_attention"] * 2))


def test_mla_spec_is_one_latent_per_layer_on_every_device():
    m = parse(BASE | dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128))
    assert m.attention == "MLA" and m.head_dim == 192
    for tp in (1, 8):
        spec = m.kv_spec("bfloat16", tp=tp)
        assert (spec.num_kv_heads, spec.mla_latent_dim, spec.bytes_per_token) == (1, 576, 4 * 576 * 2)


def test_engine_fields_rope_tokens_and_defaults():
    m = parse(BASE | dict(rope_parameters={"rope_theta": 500000.0, "rope_type": "default"}, eos_token_id=[2, 7],
                          bos_token_id=1, rms_norm_eps=1e-6, attention_bias=True))
    assert (m.rope_theta, m.rope_scaling, m.eos_token_ids) == (500000.0, None, (2, 7))
    assert (m.bos_token_id, m.rms_norm_eps) == (1, 1e-6)
    assert m.qkv_bias and m.head_dim == 32
    scaled = parse(BASE | dict(rope_theta=1e4, rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    assert scaled.rope_scaling["factor"] == 8.0
    assert parse(BASE | dict(model_type="qwen2")).qkv_bias  # Qwen2 always has q/k/v biases
    no_pos = for_engine(parse({k: v for k, v in BASE.items() if k != "max_position_embeddings"}))
    assert no_pos.max_position_embeddings == 2048 and no_pos.architecture == "LlamaForCausalLM"


def test_engine_refuses_what_the_planner_reads(tmp_path):
    folder = _write(tmp_path, BASE | dict(architectures=["FalconForCausalLM"], model_type="falcon",
                                          new_decoder_architecture=True, num_kv_heads=2))
    assert load_model(str(folder)).num_key_value_heads == 2
    with pytest.raises(ValueError, match="unsupported architecture 'FalconForCausalLM'"):
        load_model_config(folder)


@pytest.mark.parametrize("edit,match", [({"hidden_size": "64"}, "hidden_size must be a positive integer"),
                                        ({"intermediate_size": 0}, "intermediate_size must be a positive"),
                                        ({"num_key_value_heads": 3}, "do not divide")])
def test_bad_sizes_name_the_field(edit, match):
    with pytest.raises(ValueError, match=match):
        parse(BASE | edit, "m")


def test_engine_refuses_biases_it_does_not_apply():
    for extra in (dict(attention_bias=True), dict(mlp_bias=True)):
        with pytest.raises(ValueError, match="attention_bias / mlp_bias"):
            for_engine(parse(BASE | extra))


def test_gemma3_configs_as_the_hub_writes_them():
    """The multimodal wrapper's text_config is its language model (the engine refuses the
    wrapper by name); keys the Hub's text_config leaves out take Gemma3TextConfig's defaults;
    what the engine does not run is named (found by a break-it pass)."""
    text = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=8,
                model_type="gemma3_text", sliding_window=W)
    mm = parse(dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", text_config=text,
                    vision_config={"hidden_size": 1152}))
    assert mm.num_hidden_layers == 6 and mm.sliding_layers == 5 and mm.architecture == "Gemma3ForConditionalGeneration"
    assert (mm.num_key_value_heads, mm.head_dim, mm.rms_norm_eps, mm.max_position_embeddings) == (4, 256, 1e-6, 131072)
    with pytest.raises(ValueError, match="unsupported architecture 'Gemma3ForConditionalGeneration'"):
        for_engine(mm)
    assert parse(text | dict(attn_logit_softcapping=1.0)).attn_logit_softcapping is None  # as HF's Gemma 3
    for extra, match in ((dict(use_bidirectional_attention=True), "bidirectional attention"),
                         (dict(layer_types=["chunked_attention"] * 6), "layer type 'chunked_attention'")):
        cfg = parse(text | dict(architectures=["Gemma3ForCausalLM"]) | extra)
        with pytest.raises(ValueError, match=match):
            for_engine(cfg)
    assert for_engine(parse(text | dict(architectures=["Gemma3ForCausalLM"]))).qk_norm
