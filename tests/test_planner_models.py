"""Bundled configs load, carry a source, and count parameters exactly as transformers builds them."""

import json

import pytest

from pagedkv.planner.models import bundled_entry, bundled_names, load_model
from pagedkv.planner.params import count_params, expected_experts_touched

REQUIRED = {"llama-3-8b", "llama-3-70b", "llama-3.1-405b", "mistral-7b-v0.1", "mixtral-8x7b", "qwen2.5-7b",
            "qwen2.5-72b", "gemma-2-9b", "deepseek-v3", "phi-3-mini-4k", "falcon-7b", "smollm2-135m-instruct",
            "opt-13b", "opt-66b", "opt-175b", "llama-13b"}  # the last four: the PagedAttention paper's models


def test_required_models_are_bundled():
    assert REQUIRED <= set(bundled_names())


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_bundled_config_loads_with_source(name):
    entry = bundled_entry(name)
    hub = entry["source"].startswith("https://huggingface.co/") and entry["source"].endswith("config.json")
    assert hub or (name == "opt-175b" and entry["source"] == "https://arxiv.org/abs/2205.01068")  # not on the Hub
    m = load_model(name)
    assert m.num_hidden_layers > 0 and m.head_dim > 0 and m.num_attention_heads % m.num_key_value_heads == 0


def _transformers_count(name: str) -> int:
    """Parameters (and stored buffers such as DeepSeek's router bias) of transformers' own module."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    cfg = dict(bundled_entry(name)["config"])
    cfg.pop("quantization_config", None)
    hf = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    buffers = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    return sum(p.numel() for p in model.parameters()) + buffers


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_param_count_matches_transformers_modules(name):
    assert count_params(load_model(name)).total == _transformers_count(name)


@pytest.mark.parametrize("name, billions", [
    ("llama-3-8b", 8.03), ("llama-3-70b", 70.55), ("llama-3.1-405b", 405.85), ("mixtral-8x7b", 46.70),
    ("deepseek-v3", 671.0), ("gemma-2-9b", 9.24), ("falcon-7b", 6.92), ("phi-3-mini-4k", 3.82),
    ("llama-13b", 13.02), ("opt-13b", 12.85), ("opt-66b", 65.72)])
def test_param_count_matches_published_totals(name, billions):
    assert count_params(load_model(name)).total / 1e9 == pytest.approx(billions, rel=2e-3)


def test_moe_active_params():
    assert count_params(load_model("mixtral-8x7b")).active / 1e9 == pytest.approx(12.88, rel=2e-3)
    assert count_params(load_model("deepseek-v3")).active / 1e9 == pytest.approx(37.55, rel=2e-3)
    m = load_model("mixtral-8x7b")
    assert expected_experts_touched(m, 1) == pytest.approx(2)
    assert expected_experts_touched(m, 1000) == pytest.approx(8)


def test_shapes_that_calculators_get_wrong():
    gemma = load_model("gemma-2-9b")
    assert gemma.head_dim == 256  # config's head_dim, not 3584 / 16 = 224
    assert gemma.layer_windows[:4] == (4096, None, 4096, None) and gemma.sliding_layers == 21
    assert load_model("falcon-7b").attention == "MQA"
    assert load_model("phi-3-mini-4k").attention == "MHA"
    assert load_model("mistral-7b-v0.1").layer_windows == (4096,) * 32
    assert load_model("qwen2.5-7b").layer_windows == ()  # use_sliding_window: false
    assert load_model("mixtral-8x7b").layer_windows == ()
    ds = load_model("deepseek-v3")
    assert ds.attention == "MLA" and ds.mla.latent_dim == 576 and ds.moe.first_dense_layers == 3


def test_config_json_path_and_folder(tmp_path):
    cfg = dict(bundled_entry("llama-3-8b")["config"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for where in (tmp_path, tmp_path / "config.json"):
        m = load_model(str(where))
        assert m.num_key_value_heads == 8 and count_params(m).total == count_params(load_model("llama-3-8b")).total


@pytest.mark.parametrize("text, message", [
    ("{not json", "cannot read"), ("[1, 2]", "not a config.json"),
    ('{"hidden_size": 64}', "lacks num_hidden_layers"),
    ('{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": -4, "vocab_size": 10}', "positive"),
    ('{"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 3,'
     ' "vocab_size": 10}', "do not divide")])
def test_malformed_config_raises(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_model(str(path))


def test_unknown_model_raises():
    with pytest.raises(ValueError, match="unknown model"):
        load_model("no-such-model")


def test_kv_heads_override_validation():
    m = load_model("llama-3-70b")
    assert m.with_kv_heads(1).attention == "MQA"
    with pytest.raises(ValueError, match="divide"):
        m.with_kv_heads(3)
    with pytest.raises(ValueError, match="MLA"):
        load_model("deepseek-v3").with_kv_heads(8)
