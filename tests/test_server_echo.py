"""Issue 18: what lm-evaluation-harness needs from the server, over real HTTP on loopback.

``/v1/completions`` with ``echo`` (+ ``logprobs``, ``max_tokens: 0``) scores prompts the
way lm-eval's ``loglikelihood`` and ``loglikelihood_rolling`` tasks ask, with the very
numbers ``pagedkv eval ppl`` computes; vLLM's ``/tokenize``, ``/detokenize`` and
``/tokenizer_info`` let lm-eval use the server's tokenizer.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedkv.engine.engine import LLMEngine
from pagedkv.eval.ppl import Window, rolling_windows, window_logprobs
from pagedkv.server import ServerConfig, build_app
from pagedkv.server.live import LiveServer

MODEL, MAX_MODEL_LEN = "tiny", 128
TEXT = "The quick brown fox jumps over the lazy dog. Paged attention keeps the cache in blocks."


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = LLMEngine(model=str(tiny_model_dir), num_blocks=48, max_model_len=MAX_MODEL_LEN,
                       debug_invariants=True)
    with LiveServer(build_app(engine, ServerConfig([MODEL, "alias"]))) as srv:
        yield srv


@pytest.fixture(scope="module")
def llm(tiny_llm_factory):
    return tiny_llm_factory(max_model_len=MAX_MODEL_LEN)


def client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


def score(srv, prompt, max_tokens=0, logprobs=1, **kw):
    kw = {"temperature": 0} | kw
    return client(srv).completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=logprobs,
                                          max_tokens=max_tokens, **kw)


def test_echo_scores_the_prompt_with_the_numbers_eval_ppl_computes(server, llm):
    ids = llm.get_tokenizer()(TEXT, add_special_tokens=False).input_ids
    ch = score(server, TEXT).choices[0]
    lp = ch.logprobs
    assert ch.text == TEXT and ch.finish_reason == "length"
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == TEXT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(ids))]
    assert lp.token_logprobs[1:] == window_logprobs(llm, [Window(ids)])[0]  # equal, not close
    for tok, v, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[tok] == v and max(top.values()) >= v and len(top) in (1, 2)


def test_max_tokens_zero_needs_echo_and_generates_nothing(server):
    r = score(server, "Hello there", logprobs=None)
    assert r.choices[0].text == "Hello there" and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens > 0
    bad = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def test_echo_then_the_completion(server):
    plain = client(server).completions.create(model=MODEL, prompt=TEXT, max_tokens=4, temperature=0,
                                              logprobs=2).choices[0]
    ch = score(server, TEXT, max_tokens=4, logprobs=2).choices[0]
    n_prompt = len(ch.logprobs.tokens) - 4
    assert ch.text == TEXT + plain.text
    assert ch.logprobs.tokens[n_prompt:] == plain.logprobs.tokens
    assert ch.logprobs.token_logprobs[n_prompt:] == plain.logprobs.token_logprobs
    assert ch.logprobs.text_offset[n_prompt] == len(TEXT)


def test_a_batch_of_token_id_prompts_as_lm_eval_sends_them(server, llm):
    """lm-eval sends token-id lists in one request, ``max_tokens: 1``, reading
    ``token_logprobs[ctxlen:-1]``; here with the rolling windows it builds for perplexity."""
    ids = llm.get_tokenizer()(TEXT * 3, add_special_tokens=False).input_ids
    wins = rolling_windows(ids, len(ids), 16, prefix_token_id=1)
    r = client(server).completions.create(model=MODEL, prompt=[w.token_ids for w in wins], echo=True,
                                          logprobs=1, max_tokens=1, temperature=0, seed=1234)
    got = [c.logprobs.token_logprobs[w.first_scored:-1] for w, c in zip(wins, sorted(r.choices, key=lambda c: c.index))]
    assert got == window_logprobs(llm, wins)
    assert sum(map(len, got)) == len(ids)  # every token scored once
    assert r.usage.prompt_tokens == sum(len(w.token_ids) for w in wins)


def test_a_warm_prefix_cache_does_not_change_the_scores(server):
    prompt = TEXT + " A warm cache must not change prompt scores."
    cold = score(server, prompt).choices[0].logprobs.token_logprobs
    for _ in range(2):  # warm the prefix cache with the same prompt
        client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    warm = score(server, prompt)
    assert warm.choices[0].logprobs.token_logprobs == cold
    assert warm.usage.prompt_tokens_details.cached_tokens == 0  # recomputed, not read


def test_streamed_echo_equals_the_answer_in_one_body(server):
    whole = score(server, TEXT, max_tokens=3, n=2, seed=5, temperature=1.0).choices
    chunks = list(client(server).completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=3,
                                                    n=2, seed=5, temperature=1.0, stream=True))
    for c in whole:
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == c.index]
        assert "".join(m.text for m in mine) == c.text and c.text.startswith(TEXT)
        tokens = [t for m in mine if m.logprobs for t in m.logprobs.tokens]
        values = [v for m in mine if m.logprobs for v in m.logprobs.token_logprobs]
        assert tokens == c.logprobs.tokens and values == c.logprobs.token_logprobs


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "echo": True, "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x " * 200, "echo": True, "max_tokens": 0}, 400, None),
    ({"prompt": "x", "echo": "yes"}, 400, "echo"),
])
def test_bad_echo_requests(server, body, status, param):
    r = post(server, "/v1/completions", {"model": MODEL} | body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_chat_echo_is_refused(server):
    r = post(server, "/v1/chat/completions", {"model": MODEL, "echo": True,
                                               "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


# ---- /tokenize, /detokenize, /tokenizer_info ---------------------------------------------
def test_tokenize_round_trips_through_detokenize(server, llm):
    tok = llm.get_tokenizer()
    r = post(server, "/tokenize", {"model": MODEL, "prompt": TEXT, "return_token_strs": True}).json()
    assert r["tokens"] == tok(TEXT).input_ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == MAX_MODEL_LEN and r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    assert post(server, "/detokenize", {"model": "alias", "tokens": r["tokens"]}).json() == {"prompt": TEXT}
    long = post(server, "/tokenize", {"prompt": TEXT * 40}).json()  # over the context: counted, not refused
    assert long["count"] > MAX_MODEL_LEN


def test_tokenize_messages_gives_the_chat_prompt(server, llm):
    msgs = [{"role": "user", "content": "hi"}]
    r = post(server, "/tokenize", {"messages": msgs}).json()
    text = llm.get_tokenizer().apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert r["tokens"] == llm.get_tokenizer()(text, add_special_tokens=False).input_ids
    chat = client(server).chat.completions.create(model=MODEL, messages=msgs, max_tokens=1)
    assert chat.usage.prompt_tokens == r["count"]


@pytest.mark.parametrize("path,body,status", [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400),
    ("/tokenize", {}, 400),
    ("/tokenize", {"prompt": 5}, 400),
    ("/tokenize", {"prompt": "a\ud800"}, 400),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404),
    ("/detokenize", {"tokens": [1, 10**9]}, 400),
    ("/detokenize", {"tokens": [True]}, 400),
    ("/detokenize", {}, 400),
])
def test_tokenizer_endpoints_refuse_bad_input(server, path, body, status):
    r = httpx.post(server.url + path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert "error" in r.json()


def test_tokenizer_info_has_what_lm_eval_reads(server, llm):
    info = httpx.get(server.url + "/tokenizer_info").json()
    tok = llm.get_tokenizer()
    assert (info["eos_token"], info["bos_token"]) == (tok.eos_token, tok.bos_token)
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == MAX_MODEL_LEN


def test_models_list_every_served_name_with_max_model_len(server):
    cards = httpx.get(server.url + "/v1/models").json()["data"]
    assert [(c["id"], c["max_model_len"]) for c in cards] == [(MODEL, MAX_MODEL_LEN), ("alias", MAX_MODEL_LEN)]


# ---- a new user's and a break-it pass's findings -------------------------------------------
MULTIBYTE = "I \U0001F600 \U0001F99C naïve 中文 done"


def test_text_offsets_index_the_text_when_characters_span_tokens(server):
    """Offsets were sums of per-token texts, where each piece of a split character counts as
    one U+FFFD: past the first emoji they pointed at the wrong characters."""
    ch = score(server, MULTIBYTE, max_tokens=4, logprobs=0, extra_body={"ignore_eos": True}).choices[0]
    text, lp = ch.text, ch.logprobs
    assert text.startswith(MULTIBYTE) and lp.text_offset == sorted(lp.text_offset)
    for tok, off in zip(lp.tokens, lp.text_offset):
        if "\ufffd" not in tok:  # a whole-character token's text sits at its offset
            assert text[off:off + len(tok)] == tok, (tok, off, text)
    assert lp.text_offset[len(lp.tokens) - 4] == len(MULTIBYTE)


def test_token_ids_keep_split_characters_apart_in_top_logprobs(server):
    """vLLM's return_tokens_as_token_ids: tokens holding pieces of a character all decode to
    U+FFFD, so as text they collide in top_logprobs; as ids every entry survives."""
    ch = score(server, MULTIBYTE, logprobs=5, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    lp = ch.logprobs
    assert all(t.startswith("token_id:") for t in lp.tokens)
    for tok, v, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[tok] == v and len(top) in (5, 6)


def test_completions_max_tokens_defaults_to_16(server):
    r = client(server).completions.create(model=MODEL, prompt="Count:", temperature=0,
                                          extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"
