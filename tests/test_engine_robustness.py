"""Bad input never takes the engine down: each case found by trying to break it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedkv import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kwargs,field", [({"stop": [5]}, "stop"), ({"skip_special_tokens": None}, "skip_special"),
                                          ({"ignore_eos": 1}, "ignore_eos"), ({"seed": 10**23}, "seed"),
                                          ({"stop_token_ids": 5}, "stop_token_ids"), ({"top_p": True}, "top_p")])
def test_bad_sampling_params_fail_at_construction(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_engine_keeps_working_after_a_failed_sample(tiny_llm_factory, monkeypatch):
    llm = tiny_llm_factory(num_blocks=16)
    from pagedkv.worker import sampler

    real = sampler.sample_row
    monkeypatch.setattr(sampler, "sample_row", lambda *a: (_ for _ in ()).throw(ValueError("boom")))
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=1.0))[0]
    assert out.finish_reason == "abort" and out.error == "boom"
    monkeypatch.setattr(sampler, "sample_row", real)
    again = llm.generate([{"prompt_token_ids": [5, 6, 7]}], GREEDY)[0]
    assert again.finish_reason == "length" and llm.stats().blocks_used == 0


def test_forward_failure_frees_the_step_and_engine_recovers(tiny_llm_factory, monkeypatch):
    llm = tiny_llm_factory(num_blocks=16)
    eng = llm.engine
    monkeypatch.setattr(eng.runner, "execute", lambda so: (_ for _ in ()).throw(RuntimeError("kernel died")))
    eng.add_request({"prompt_token_ids": [1, 2, 3]}, GREEDY)
    with pytest.raises(RuntimeError, match="kernel died"):
        eng.step()
    assert not eng.has_unfinished_requests() and eng.kv_manager.pool.num_used == 0
    monkeypatch.undo()
    assert len(llm.generate([{"prompt_token_ids": [1, 2, 3]}], GREEDY)[0].token_ids) == 3


def test_generate_rolls_back_on_any_bad_prompt(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=16)
    for bad in [{"prompt_token_ids": None}, {"prompt_token_ids": 5}, {"prompt_token_ids": ["a"]}, 42]:
        with pytest.raises(ValueError, match="prompt 1:"):
            llm.generate([{"prompt_token_ids": [1, 2]}, bad], GREEDY)
        assert not llm.engine.requests and llm.engine.kv_manager.pool.num_used == 0
    with pytest.raises(ValueError, match="prompt 0: sampling params"):
        llm.generate(["hi"], ["greedy"])


def test_numpy_and_torch_token_ids_are_accepted(tiny_llm_factory):
    import numpy as np

    llm = tiny_llm_factory(num_blocks=16)
    a = llm.generate([{"prompt_token_ids": np.array([5, 6, 7])}], GREEDY)[0]
    b = llm.generate([{"prompt_token_ids": torch.tensor([5, 6, 7])}], GREEDY)[0]
    assert a.token_ids == b.token_ids


def test_per_prompt_cache_salt_isolates(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=32)
    ids = list(range(200, 240))
    llm.generate([{"prompt_token_ids": ids, "cache_salt": "A"}], GREEDY)
    assert llm.generate([{"prompt_token_ids": ids, "cache_salt": "B"}], GREEDY)[0].num_cached_tokens == 0
    assert llm.generate([{"prompt_token_ids": ids, "cache_salt": "A"}], GREEDY)[0].num_cached_tokens == 32


def test_stop_token_is_in_token_ids_not_in_text(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=16)
    free = llm.generate([{"prompt_token_ids": [9, 8, 7]}], SamplingParams(max_tokens=4, temperature=0.0))[0]
    stop = free.token_ids[1]
    out = llm.generate([{"prompt_token_ids": [9, 8, 7]}],
                       SamplingParams(max_tokens=4, temperature=0.0, stop_token_ids=[stop]))[0]
    cut = free.token_ids.index(stop)
    assert out.token_ids == free.token_ids[:cut + 1] and out.stop_reason == stop
    assert out.text == llm.get_tokenizer().decode(free.token_ids[:cut], skip_special_tokens=True)


def test_abort_during_run_returns_abort_output(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=16)
    eng = llm.engine
    outs = llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [3, 4]}],
                        [SamplingParams(max_tokens=1), SamplingParams(max_tokens=8, ignore_eos=True)],
                        on_output=lambda o: [eng.abort_request(r) for r in list(eng.requests)])
    assert [o.finish_reason for o in outs] == ["length", "abort"]


def test_max_tokens_none_fits_the_cache(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=3)  # 48 slots: max_model_len is capped there
    out = llm.generate([{"prompt_token_ids": list(range(100, 140))}],
                       SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 8


def test_chat_with_malformed_messages_is_a_value_error(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=16)
    for bad in [[{"role": "user"}], [], [{"role": "user", "content": 5}]]:
        with pytest.raises(ValueError, match="messages"):
            llm.chat(bad)


@pytest.mark.parametrize("edit,match", [
    ({"vocab_size": 60000}, "model.embed_tokens.weight"), ({"num_key_value_heads": 4}, "k_proj"),
    ({"head_dim": 8}, "q_proj"), ({"num_hidden_layers": 1}, "num_hidden_layers is 1 but the weights hold 2"),
    ({"hidden_size": "64"}, "hidden_size must be a positive integer"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),
    ({"max_position_embeddings": -5}, "max_position_embeddings must be a positive integer")])
def test_config_that_disagrees_with_weights_fails_at_load(tiny_model_dir, tmp_path, edit, match):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | edit))
    with pytest.raises(ValueError, match=match):
        LLM(model=str(folder), num_blocks=8)


def test_unreadable_files_give_clear_errors(tiny_model_dir, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        LLM(model=str(folder), num_blocks=8)
    shutil.copy(tiny_model_dir / "config.json", folder / "config.json")
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read weights"):
        LLM(model=str(folder), num_blocks=8)
    bad = tmp_path / "t.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00garbage")
    with pytest.raises(ValueError, match="t.gguf is not a readable GGUF"):
        LLM(model=str(bad), num_blocks=8)


def test_cache_larger_than_ram_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="does not fit in this machine's"):
        LLM(model=str(tiny_model_dir), num_blocks=10**12)
