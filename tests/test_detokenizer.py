"""Incremental detokenization gives the text a full decode gives, one token at a time,
and the engine no longer re-decodes the whole output per token (once, at the end)."""

from __future__ import annotations

import random

import pytest

from pagedkv import SamplingParams
from pagedkv.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["The capital of France is Paris.", "naïve café — 東京 🚀 ok", "  two  spaces\nand a newline",
         "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def tokenizer(default_model_files):
    from pagedkv.model.loader import load_tokenizer

    return load_tokenizer(default_model_files.folder)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode(tokenizer, text, skip):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tokenizer, skip)
    pieces = [d.push(t) for t in ids]
    assert "".join(pieces) == d.text == tokenizer.decode(ids, skip_special_tokens=skip)


def test_random_token_runs_match_at_every_prefix_that_ends_a_character(tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(30)]
        d = IncrementalDetokenizer(tokenizer, True)
        for i, t in enumerate(ids):
            d.push(t)
            full = tokenizer.decode(ids[:i + 1], skip_special_tokens=True)
            if not full.endswith("\ufffd"):  # a split character is held back, not shown as U+FFFD
                assert d.text == full


def test_engine_does_not_redecode_the_output(tiny_llm_factory):
    llm = tiny_llm_factory()
    tok = llm.get_tokenizer()
    calls = []
    original = tok.decode
    tok.decode = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    finally:
        del tok.decode
    assert len(out.token_ids) == 24 and len(calls) == 1  # once, when the request ends; not per token
    assert out.text == original(out.token_ids, skip_special_tokens=True)
