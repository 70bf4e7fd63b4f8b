"""LLMEngine's text side and fault paths: a failed step, reused and bad request ids,
stop-token text, the final text of an output cut inside a character, non-finite logits."""

from __future__ import annotations

import pytest
import torch

from pagedkv import SamplingParams
from pagedkv.core.core_output import EngineCoreOutput
from pagedkv.engine.outputs import TextRequest
from pagedkv.worker.sampler import sample


def _run(engine, prompt, params, rid=None) -> object:
    rid = engine.add_request(prompt, params, request_id=rid).request_id
    last = None
    while engine.has_unfinished_requests():
        last = next((o for o in engine.step() if o.request_id == rid and o.finished), last)
    return last


def test_a_failed_step_is_reported_and_a_reused_seeded_id_starts_fresh(tiny_llm_factory):
    engine = tiny_llm_factory().engine
    seeded = SamplingParams(max_tokens=6, temperature=1.0, seed=123)
    ref = _run(engine, "Hello world", seeded, "A").token_ids
    engine.runner.execute = lambda out: (_ for _ in ()).throw(RuntimeError("boom"))
    engine.add_request("other", SamplingParams(max_tokens=2), request_id="B")
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()  # the step also carried "A"'s end to the runner: it never read it
    del engine.runner.execute
    failed = engine.final_output("B")
    assert failed.finish_reason == "abort" and "RuntimeError: boom" in failed.error
    assert _run(engine, "Hello world", seeded, "A").token_ids == ref
    engine.step()  # an idle step still tells the runner which requests ended
    assert engine.runner.generators == {} and engine.runner.requests == {} and engine.kv_manager.usage().used == 0


@pytest.mark.parametrize("rid", [5, "", ("t",)])
def test_request_ids_are_non_empty_strings(tiny_llm_factory, rid):
    with pytest.raises(ValueError, match="request id"):
        tiny_llm_factory().engine.add_request("hi", request_id=rid)


def test_automatic_ids_skip_ids_a_caller_took(tiny_llm_factory):
    llm = tiny_llm_factory()
    llm.engine.add_request("hi", SamplingParams(max_tokens=2), request_id="req-0")
    outs = llm.generate((p for p in ["a", "b"]), SamplingParams(max_tokens=2))  # any iterable
    assert [o.request_id for o in outs] == ["req-1", "req-2"] and all(o.finished for o in outs)


class _Tok:
    """A tokenizer whose ids 0..3 decode to 'Hello', ' world', '<eos>' and half a character."""
    backend_tokenizer = None
    pieces = {0: b"Hello", 1: b" world", 2: b"<eos>", 3: b"\xe2\x82"}

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.pieces[i] for i in ids if not (skip_special_tokens and i == 2)).decode(
            "utf-8", errors="replace")


def _text(ids, finish, stop_reason=None, **params) -> str:
    t = TextRequest("r", None, [9], SamplingParams(**params), 0.0, _Tok())
    t.apply(EngineCoreOutput("r", ids, token_time=1.0, finish_reason=finish, stop_reason=stop_reason))
    return t.output().text


def test_the_text_of_a_stopping_token_is_left_out():
    assert _text([0, 1, 2], "stop", skip_special_tokens=False) == "Hello world"          # EOS
    assert _text([0, 1, 1], "stop", 1, stop_token_ids=[1]) == "Hello world"             # a stop id
    assert _text([0, 1, 2], "length", skip_special_tokens=False) == "Hello world<eos>"  # not a stop


def test_the_final_text_is_the_full_decode_even_mid_character():
    assert _text([0, 3], "length") == "Hello\ufffd"
    assert _text([0, 3], None) == "Hello\ufffd"  # the fallback decoder (no fast backend) streams it too


def test_greedy_rows_with_non_finite_logits_fail_alone():
    logits = torch.zeros(3, 8)
    logits[1, 2] = float("nan")
    logits[0, 5] = 1.0
    out = sample(logits, [SamplingParams(temperature=0.0)] * 3, [None] * 3)
    assert [(o.token_id, o.error) for o in out][::2] == [(5, None), (0, None)]
    assert out[1].error == "the model produced non-finite logits"
