"""Issue 19 items 8 and 10 on the Python side: bounded stop strings whose tail check is
exact, booleans refused as token ids, chat content as text parts, lone surrogates refused."""

from __future__ import annotations

import random

import pytest

from pagedkv import SamplingParams
from pagedkv.core.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS
from pagedkv.engine.stop_strings import PartialStopTracker, hold_back


def _brute_hold_back(text: str, stops: list[str]) -> str:
    cut = max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:k])),
              default=0)
    return text[:len(text) - cut]


def test_hold_back_equals_the_brute_force_on_random_texts():
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice("aab c") for _ in range(rng.randrange(0, 12)))
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(1, 4))]
        assert hold_back(text, stops) == _brute_hold_back(text, stops), (text, stops)


def test_the_incremental_tracker_equals_the_brute_force_as_text_streams_in():
    """Fed a growing text in random pieces (and once a text that does not extend the last),
    the KMP tracker holds back exactly what the brute force does after every piece."""
    rng = random.Random(1)
    for _ in range(500):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 7))) for _ in range(rng.randrange(1, 4))]
        tracker, text = PartialStopTracker(stops), ""
        for _ in range(rng.randrange(1, 10)):
            text += "".join(rng.choice("aab") for _ in range(rng.randrange(0, 4)))
            tracker.feed(text)
            assert text[:len(text) - tracker.held()] == _brute_hold_back(text, stops), (text, stops)
        text = "b" + text[1:] if text.startswith("a") else "a" + text[1:]
        tracker.feed(text)
        assert text[:len(text) - tracker.held()] == _brute_hold_back(text, stops), (text, stops)


def test_stop_strings_are_bounded():
    SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS)
    with pytest.raises(ValueError, match="at most"):
        SamplingParams(stop=["x"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match="at most"):
        SamplingParams(stop=["x" * (MAX_STOP_CHARS + 1)])


def test_booleans_are_not_token_ids(tiny_llm_factory):
    with pytest.raises(ValueError, match="booleans"):
        tiny_llm_factory().generate([{"prompt_token_ids": [True, 2]}])


def test_chat_takes_text_parts_and_refuses_lone_surrogates(tiny_llm_factory):
    llm = tiny_llm_factory()
    plain = llm.chat_prompt([{"role": "user", "content": "Hello there"}])
    parts = llm.chat_prompt([{"role": "user", "content": [{"type": "text", "text": "Hello "},
                                                           {"type": "text", "text": "there"}]}])
    assert parts == plain
    for bad in ("a\ud800", [{"type": "image_url", "image_url": "x"}], 5):
        with pytest.raises(ValueError, match="content"):
            llm.chat([{"role": "user", "content": bad}])


def test_chat_takes_none_content_as_the_server_does(tiny_llm_factory):
    llm = tiny_llm_factory()
    with_none = llm.chat_prompt([{"role": "system", "content": None}, {"role": "user", "content": "Hi"}])
    assert with_none == llm.chat_prompt([{"role": "system", "content": ""}, {"role": "user", "content": "Hi"}])


def test_huge_integers_in_float_fields_are_value_errors():
    for kw in ({"temperature": 10**400}, {"top_p": 10**400}, {"top_p": -10**400}):
        with pytest.raises(ValueError):
            SamplingParams(**kw)


def test_stop_token_ids_are_bounded_and_in_the_vocabulary(tiny_llm_factory):
    with pytest.raises(ValueError, match="at most"):
        SamplingParams(stop_token_ids=list(range(2000)))
    with pytest.raises(ValueError, match="stop_token_ids"):
        tiny_llm_factory().generate(["hi"], SamplingParams(stop_token_ids=[10**6]))


def test_chat_refuses_a_lone_surrogate_in_a_role(tiny_llm_factory):
    with pytest.raises(ValueError, match="messages: a role"):
        tiny_llm_factory().chat([{"role": "\ud800", "content": "hi"}])


@pytest.mark.parametrize("kw", [{"seed": 10**400}, {"seed": -(10**30)}, {"stop_token_ids": list(range(-5, 1000))},
                                {"max_tokens": -(10**5000)}])
def test_errors_quote_huge_values_briefly(kw):
    """An error quoting a 400-digit seed or a 1,000-id list stays one short line."""
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert len(str(e.value)) < 200, str(e.value)


@pytest.mark.parametrize("salt", [123, b"bytes", ["a"], ""])
def test_cache_salt_must_be_a_non_empty_string(tiny_llm_factory, salt):
    llm = tiny_llm_factory()
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate(["hi"], SamplingParams(max_tokens=1), cache_salt=salt)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt": "hi", "cache_salt": salt}], SamplingParams(max_tokens=1))
    assert llm.generate(["hi"], SamplingParams(max_tokens=1), cache_salt="tenant-a")[0].finished


@pytest.mark.parametrize("call", [
    lambda llm: llm.generate(None),
    lambda llm: llm.generate(5),
    lambda llm: llm.generate("hi", priority=5),
    lambda llm: llm.generate("hi", "greedy"),
    lambda llm: llm.generate([{"prompt_token_ids": {1: 2}}]),
    lambda llm: llm.generate([{"prompt_token_ids": (t for t in [1, 2])}]),
    lambda llm: llm.generate(["hi"], SamplingParams(max_tokens=10**300)),
], ids=["none", "int", "priority-int", "params-str", "ids-dict", "ids-generator", "huge-max-tokens"])
def test_bad_python_api_calls_are_short_value_errors(tiny_llm_factory, call):
    """Second break-it pass: these were TypeErrors, silently wrong, or an 8 KB message."""
    llm = tiny_llm_factory(num_blocks=16)
    with pytest.raises(ValueError) as e:
        call(llm)
    assert len(str(e.value)) < 300
    assert not llm.engine.requests and llm.engine.kv_manager.pool.num_used == 0


def test_a_lone_surrogate_cache_salt_is_refused_before_it_reaches_the_scheduler(tiny_llm_factory):
    llm = tiny_llm_factory(num_blocks=16)
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate(["hello"], SamplingParams(max_tokens=1), cache_salt="\ud800")
    with pytest.raises(ValueError, match="cache_salt"):
        llm.generate([{"prompt": "hello", "cache_salt": "\udc00"}], SamplingParams(max_tokens=1))
    assert llm.generate(["hello"], SamplingParams(max_tokens=1))[0].finished  # the engine is fine


def test_the_kernel_build_folder_depends_on_where_the_sources_are(monkeypatch, tmp_path):
    """Two checkouts of the same sources rebuilt over each other (torch's build.ninja
    records absolute paths): each now has its own folder."""
    import shutil

    from pagedkv.kernels.cpu import library as kernel

    here = kernel.source_fingerprint()
    copy = tmp_path / "csrc"
    shutil.copytree(kernel.CSRC, copy)
    monkeypatch.setattr(kernel, "CSRC", copy)
    assert kernel.source_fingerprint() != here
