"""The OpenAI-compatible server, live on a loopback port, driven by the official openai
client and raw HTTP: completions, chat, streaming, stop strings, logprobs, bad input,
auth, prefix-cache isolation, continuous batching under load, aborts that free blocks.

The model is the tiny random Llama with the real SmolLM2 tokenizer (and chat template);
the cache is small on purpose (24 blocks = 384 tokens < max_model_len 512), so one
server can reject both a prompt over the context and one over the whole cache, and the
load test runs under block pressure (queueing and preemption).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.engine.engine import LLMEngine
from pagedkv.server import ServerConfig, build_app
from pagedkv.server.guards import GuardConfig
from pagedkv.server.http_limits import HTTPLimits
from pagedkv.server.live import LiveServer
from pagedkv.server.loadtest import run_load

MODEL = "tiny"
NUM_BLOCKS, MAX_MODEL_LEN = 24, 512
KEYS = ["sk-alpha", "sk-beta"]


@pytest.fixture(scope="module")
def one_thread():
    """Tiny per-sequence attention ops run far faster on one intra-op thread here."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def no_server_errors():
    """Whatever a test does, the server logs no error (no unhandled exception)."""
    handler = _Errors()
    loggers = [logging.getLogger(n) for n in ("pagedkv.server", "uvicorn.error")]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler
    for lg in loggers:
        lg.removeHandler(handler)
    assert not handler.records, [r.getMessage() for r in handler.records]


def _serve(model_dir, live=None, num_blocks=NUM_BLOCKS, **guards):
    """``live``: LiveServer keywords (limits, shutdown_timeout); ``guards``: GuardConfig's."""
    engine = LLMEngine(model=str(model_dir), num_blocks=num_blocks, max_model_len=MAX_MODEL_LEN,
                       debug_invariants=True)
    config = ServerConfig([MODEL, "tiny-alias"], GuardConfig(**{k: tuple(v) if isinstance(v, list) else v
                                                               for k, v in guards.items()}))
    return LiveServer(build_app(engine, config), **(live or {})).start()


@pytest.fixture(scope="module")
def server(tiny_model_dir, one_thread):
    srv = _serve(tiny_model_dir, max_body_bytes=64 * 1024, allowed_hosts=["gpu-box.lan"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def proxy(server):
    """``pagedkv proxy`` with the server's guards in front of it (the server as both
    instances: a plain server ignores the legs' transfer params)."""
    from pagedkv.server.proxy import build_proxy

    guard = GuardConfig(allowed_hosts=("gpu-box.lan",), max_body_bytes=64 * 1024)
    p = LiveServer(build_proxy(server.url, server.url, timeout=30, guard=guard)).start()
    yield p
    p.stop()


@pytest.fixture(params=["server", "proxy"])
def listener(request):
    """Each process that listens on a port: the guard tests hold for both (issue 51)."""
    return request.getfixturevalue(request.param)


@pytest.fixture(scope="module")
def keyed_server(tiny_model_dir, one_thread):
    srv = _serve(tiny_model_dir, api_keys=KEYS)
    yield srv
    srv.stop()


def client(srv, key="none") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=30)


def metrics(srv) -> dict[str, float]:
    """``name{label="v",...}`` -> value, from /metrics."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def wait_idle(srv, timeout=10.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no block is in use."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(srv)
        if (m['pagedkv_kv_blocks{state="used"}'] == 0 and m["pagedkv_num_requests_running"] == 0
                and m["pagedkv_num_requests_waiting"] == 0):
            return m
        assert time.monotonic() < deadline, f"server not idle: {m}"
        time.sleep(0.05)


JSON_TYPE = {"Content-Type": "application/json"}


def post(srv, path, body=None, content=None, headers=None) -> httpx.Response:
    """``body`` is sent as JSON; raw ``content`` is declared JSON unless ``headers`` say otherwise."""
    headers = (JSON_TYPE if content is not None else {}) | (headers or {})
    return httpx.post(srv.url + path, json=body, content=content, headers=headers, timeout=30)


GREEDY = dict(model=MODEL, temperature=0.0)


# ---- completions and chat ------------------------------------------------------------
def test_completion_shape_and_usage(server):
    r = client(server).completions.create(prompt="Once upon a time", max_tokens=8, **GREEDY)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    (c,) = r.choices
    assert c.index == 0 and c.finish_reason == "length" and isinstance(c.text, str) and c.text
    assert r.usage.completion_tokens == 8 and r.usage.prompt_tokens == 4
    assert r.usage.total_tokens == 12 and r.usage.prompt_tokens_details.cached_tokens == 0


def test_greedy_is_deterministic_and_stream_matches(server):
    c = client(server)
    a = c.completions.create(prompt="The quick brown fox", max_tokens=12, **GREEDY).choices[0].text
    b = c.completions.create(prompt="The quick brown fox", max_tokens=12, **GREEDY).choices[0].text
    chunks = list(c.completions.create(prompt="The quick brown fox", max_tokens=12, stream=True, **GREEDY))
    assert a == b == "".join(ch.choices[0].text for ch in chunks)
    assert len(chunks) > 1 and chunks[-1].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1])


def test_chat_uses_the_chat_template(server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    r = client(server).chat.completions.create(messages=msgs, max_tokens=6, **GREEDY)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    tok = server.server.config.app.state.server.tokenizer
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.usage.prompt_tokens == len(ids)
    raw = client(server).completions.create(prompt=list(ids), max_tokens=6, **GREEDY)
    assert r.choices[0].message.content == raw.choices[0].text


def test_chat_stream_deltas(server):
    c = client(server)
    msgs = [{"role": "user", "content": "Tell me a story"}]
    full = c.chat.completions.create(messages=msgs, max_tokens=10, **GREEDY).choices[0].message.content
    chunks = list(c.chat.completions.create(messages=msgs, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == full
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_stop_strings_plain_and_streamed(server):
    c = client(server)
    text = c.completions.create(prompt="Hello world", max_tokens=24, **GREEDY).choices[0].text
    # a stop string starting mid-text, at its first occurrence
    stop = next(text[i:i + 3] for i in range(3, len(text) - 3) if text.find(text[i:i + 3]) == i)
    want = text[:text.index(stop)]
    r = c.completions.create(prompt="Hello world", max_tokens=24, stop=[stop], **GREEDY)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    chunks = list(c.completions.create(prompt="Hello world", max_tokens=24, stop=stop, stream=True, **GREEDY))
    assert "".join(ch.choices[0].text for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs(server):
    r = client(server).completions.create(prompt="Hello", max_tokens=5, logprobs=3, **GREEDY)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert v <= 0 and len(top) == 3 and max(top.values()) == pytest.approx(v)  # greedy: the top one


def test_chat_logprobs_and_top_logprobs(server):
    r = client(server).chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                               logprobs=True, top_logprobs=2, **GREEDY)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob and t.bytes == list(t.token.encode())


def test_seeded_sampling_and_n_and_prompt_lists(server):
    c = client(server)
    kw = dict(model=MODEL, prompt="Seeds", max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    a, b = (c.completions.create(**kw).choices[0].text for _ in range(2))
    assert a == b
    r = c.completions.create(**(kw | {"n": 3}))
    assert [ch.index for ch in r.choices] == [0, 1, 2] and r.choices[0].text == a
    assert len({ch.text for ch in r.choices}) > 1  # seeds 7, 8, 9
    topk = [c.completions.create(**kw, extra_body={"top_k": 1}).choices[0].text for _ in range(2)]
    assert topk[0] == topk[1] == c.completions.create(**(kw | {"temperature": 0})).choices[0].text
    r = c.completions.create(model=MODEL, prompt=["one", "two"], max_tokens=3, n=2, temperature=0)
    assert len(r.choices) == 4 and r.usage.completion_tokens == 12
    assert r.choices[0].text == r.choices[1].text  # greedy: both samples of prompt 0 agree


def test_usage_counts_each_prompt_once_whatever_n(server):
    """Issue 19 item 4: n samples of one prompt bill its tokens (and cached tokens) once."""
    c = client(server)
    prompt = "Usage is counted per prompt, not per sample, as OpenAI and vLLM count it. " * 3
    one = c.completions.create(prompt=prompt, max_tokens=2, **GREEDY).usage   # also warms the cache
    four = c.completions.create(prompt=prompt, max_tokens=2, n=4, **GREEDY).usage
    assert one.prompt_tokens > 16 and four.prompt_tokens == one.prompt_tokens
    assert four.completion_tokens == 8 and four.total_tokens == one.prompt_tokens + 8
    assert 16 <= four.prompt_tokens_details.cached_tokens < four.prompt_tokens
    two = c.completions.create(prompt=["one", "two words"], max_tokens=1, n=3, **GREEDY).usage
    singles = [c.completions.create(prompt=p, max_tokens=1, **GREEDY).usage.prompt_tokens
               for p in ("one", "two words")]
    assert two.prompt_tokens == sum(singles) and two.completion_tokens == 6
    msgs = [{"role": "user", "content": "Count me once"}]
    chat1 = c.chat.completions.create(messages=msgs, max_tokens=1, **GREEDY).usage.prompt_tokens
    assert c.chat.completions.create(messages=msgs, max_tokens=1, n=3, **GREEDY).usage.prompt_tokens == chat1
    last = list(c.chat.completions.create(messages=msgs, max_tokens=1, n=3, stream=True,
                                          stream_options={"include_usage": True}, **GREEDY))[-1]
    assert last.usage.prompt_tokens == chat1 and last.usage.completion_tokens == 3
    last = list(c.completions.create(prompt=prompt, max_tokens=1, n=4, stream=True,
                                     stream_options={"include_usage": True}, **GREEDY))[-1]
    assert last.usage.prompt_tokens == one.prompt_tokens and last.usage.completion_tokens == 4


def test_models_health_and_served_aliases(server):
    ids = [m.id for m in client(server).models.list().data]
    assert ids == [MODEL, "tiny-alias"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = client(server).completions.create(model="tiny-alias", prompt="x", max_tokens=1)
    assert r.model == MODEL


def test_prefix_cache_hit_is_reported(server):
    prompt = "A long shared prefix that spans more than two blocks of sixteen tokens each, " * 4
    c = client(server)
    c.completions.create(prompt=prompt, max_tokens=1, **GREEDY)
    r = c.completions.create(prompt=prompt, max_tokens=1, **GREEDY)
    assert r.usage.prompt_tokens_details.cached_tokens >= 32


def test_metrics_exposition(server):
    client(server).completions.create(prompt="metrics", max_tokens=3, **GREEDY)
    m = wait_idle(server)
    assert m["pagedkv_kv_blocks_total"] == NUM_BLOCKS
    assert m['pagedkv_kv_blocks{state="free"}'] + m['pagedkv_kv_blocks{state="cached"}'] == NUM_BLOCKS
    assert m["pagedkv_kv_cache_usage_ratio"] == 0
    for name in ("pagedkv_prompt_tokens_total", "pagedkv_generation_tokens_total",
                 "pagedkv_prefix_cache_queries_tokens_total", "pagedkv_time_to_first_token_seconds_count",
                 "pagedkv_time_per_output_token_seconds_count", "pagedkv_e2e_request_latency_seconds_count",
                 'pagedkv_requests_finished_total{finish_reason="length"}'):
        assert m[name] > 0, name
    for name in ("pagedkv_num_preemptions_total", 'pagedkv_requests_rejected_total{reason="never_fits"}',
                 "pagedkv_prefix_cache_hits_tokens_total"):
        assert name in m


# ---- bad input -------------------------------------------------------------------------
LONG_PROMPT = [17] * 600   # over max_model_len (512)
CACHE_PROMPT = [17] * 450  # under max_model_len, over the whole cache (24 * 16 = 384 tokens)
BAD = [  # (path, body, status, param or None, code or None)
    ("/v1/completions", b"{not json", 400, None, "invalid_json"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json"),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None, "invalid_json"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ("/v1/completions", b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", 400, "temperature", "invalid_value"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "top_p": -1' + b"0" * 400 + b"}",
     400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "stop": [1]}, 400, "stop", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "model": 3}, 400, "model", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**12}, 400, None, "context_length_exceeded"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, 400, "temperature", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.01}, 400, "top_p", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "logprobs": 99}, 400, "logprobs", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "seed": 2**70}, 400, "seed", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400, "echo",
     "unsupported_parameter"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {"prompt": []}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": ["ok", ""]}, 400, "prompt", "invalid_value"),
    ("/v1/completions", {}, 400, "prompt", "missing_required_parameter"),
    ("/v1/completions", {"prompt": [[1, 2], [10**9]]}, 400, "prompt", "invalid_value"),  # outside the vocabulary
    ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 4}, 400, None, "context_length_exceeded"),
    ("/v1/completions", {"prompt": CACHE_PROMPT, "max_tokens": 4}, 400, None, "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "invalid_type"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}]}, 400, "messages", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, 400, "messages[0].content",
     "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "top_logprobs", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400,
     "max_completion_tokens", "invalid_value"),
    # issue 19 item 3: these were 500s. Seeds must fit SamplingParams' signed 64 bits, also seed + n - 1
    ("/v1/completions", {"prompt": "x", "seed": 2**63}, 400, "seed", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64 - 1}, 400, "seed", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "seed": 2**63 - 1, "n": 2}, 400, "seed", "invalid_value"),
    # a lone surrogate (raw bytes: httpx cannot encode one) wherever request text goes
    ("/v1/completions", b'{"prompt": "a\\ud800"}', 400, "prompt", "invalid_value"),
    ("/v1/completions", b'{"prompt": ["ok", "a\\ud800"]}', 400, "prompt", "invalid_value"),
    ("/v1/completions", b'{"prompt": "x", "model": "a\\ud800"}', 400, "model", "invalid_value"),
    ("/v1/completions", b'{"prompt": "x", "stop": ["\\udc00"]}', 400, "stop", "invalid_value"),
    ("/v1/completions", b'{"prompt": "x", "user": "\\udfff"}', 400, "user", "invalid_value"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', 400,
     "messages[0].content", "invalid_value"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     400, "messages[0].content", "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "x"}]}, 400, "messages[0].role",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": {"a": 1}, "content": "x"}]}, 400, "messages[0].role",
     "invalid_value"),
    # issue 19 item 10: known fields the server cannot honour were silently ignored; mixed prompt lists accepted
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "tool_choice", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400,
     "tool_choice", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 4}, 400, "min_tokens", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "object"}}, 400, "guided_json",
     "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "guided_regex": "a+"}, 400,
     "guided_regex", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "x", "min_p": 0.1}, 400, "min_p", "unsupported_parameter"),
    ("/v1/completions", {"prompt": ["hi", [1, 2]]}, 400, "prompt", "invalid_type"),
    ("/v1/completions", {"prompt": [[1, 2], "hi"]}, 400, "prompt", "invalid_type"),
    # issue 19 item 9: vLLM's request priority is an integer
    ("/v1/completions", {"prompt": "x", "priority": "high"}, 400, "priority", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "priority": 1.5}, 400,
     "priority", "invalid_type"),
    ("/v1/completions", {"prompt": "x", "priority": 2**64}, 400, "priority", "invalid_value"),
    # second break-it pass: out-of-vocabulary stop ids were "never_fits" with param null
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [49152]}, 400, "stop_token_ids", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [2**70]}, 400, "stop_token_ids", "invalid_value"),
    ("/v1/completions", {"prompt": "x", "stop": ["y" * 1001]}, 400, "stop", "invalid_value"),
    # a third break-it pass: tool calls in messages were dropped silently (as 'tools', refused)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None,
                              "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f"}}]}]},
     400, "messages[1].tool_calls", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "1", "tool_call_id": "a"}]}, 400,
     "messages[0].tool_call_id", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "name": 3}]}, 400, "messages[0].name",
     "invalid_type"),
    # issue 14: SnapKV's per-request budget
    ("/v1/completions", {"prompt": "x", "kv_budget_tokens": 0}, 400, "kv_budget_tokens", "invalid_value"),
]


@pytest.mark.parametrize("path,body,status,param,code", BAD,
                         ids=[f"{i}-{str(b)[:40]}" for i, (_, b, *_r) in enumerate(BAD)])
def test_bad_input_gets_4xx_with_openai_error(server, path, body, status, param, code):
    r = post(server, path, **({"content": body} if isinstance(body, bytes) else {"body": body}))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in r.text
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code


@pytest.mark.parametrize("field,value", [("best_of", 1.0), ("min_tokens", 0.0), ("frequency_penalty", 0),
                                         ("presence_penalty", 0.0)])
def test_off_values_of_unsupported_fields_are_accepted_as_numbers(server, field, value):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, field: value})
    assert r.status_code == 200, r.text


def test_a_kv_budget_needs_a_snapkv_engine(server):
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "kv_budget_tokens": 64})
    assert r.status_code == 400 and "--kv-eviction snapkv|h2o" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "kv_budget_tokens"


def test_out_of_vocabulary_stop_ids_are_counted_as_such(server):
    before = metrics(server).get('pagedkv_requests_rejected_total{reason="out_of_vocabulary"}', 0.0)
    assert post(server, "/v1/completions", {"prompt": "x", "stop_token_ids": [10**6]}).status_code == 400
    assert metrics(server)['pagedkv_requests_rejected_total{reason="out_of_vocabulary"}'] == before + 1


@pytest.mark.parametrize("raw", [b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nHost: evil\r\n"
                                 b"Content-Length: 2\r\n\r\n{}",
                                 b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: abc\r\n\r\n{}",
                                 b"GARBAGE\r\n\r\n"], ids=["two-hosts", "bad-length", "garbage"])
def test_malformed_http_gets_a_json_400(server, raw):
    s = _raw(server, raw)
    s.settimeout(10)
    data = b""
    while chunk := s.recv(4096):
        data += chunk
    s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, data
    assert json.loads(body)["error"]["code"] == "invalid_http"


def test_an_unexpected_exception_is_a_500_json_logged_once(server, no_server_errors):
    """Any exception escaping a route: a 500 OpenAI-style body, no traceback in it, and one
    log record (Starlette's last-resort handler re-raised, so uvicorn logged it again)."""
    state = server.server.config.app.state.server

    def boom(p):
        raise RuntimeError("secret internal detail")
    state.prompts.completion_prompt = boom  # runs in the tokenizer thread: the error still comes back
    try:
        r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    finally:
        del state.prompts.completion_prompt
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "secret" not in r.text and "Traceback" not in r.text
    assert [rec.getMessage() for rec in no_server_errors.records] == ["unhandled error on POST /v1/completions"]
    no_server_errors.records.clear()  # the one expected error
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 200


def test_never_fits_counts_as_rejected(server):
    before = metrics(server)['pagedkv_requests_rejected_total{reason="never_fits"}']
    r = post(server, "/v1/completions", {"prompt": CACHE_PROMPT, "max_tokens": 4})
    assert r.status_code == 400 and "whole cache has 24" in r.json()["error"]["message"]
    assert metrics(server)['pagedkv_requests_rejected_total{reason="never_fits"}'] == before + 1


def test_out_of_vocabulary_ids_have_their_own_reject_reason(server):
    before = metrics(server)
    r = post(server, "/v1/completions", {"prompt": [1, 10**9], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    after = metrics(server)
    assert after['pagedkv_requests_rejected_total{reason="out_of_vocabulary"}'] == \
        before['pagedkv_requests_rejected_total{reason="out_of_vocabulary"}'] + 1
    assert after['pagedkv_requests_rejected_total{reason="never_fits"}'] == \
        before['pagedkv_requests_rejected_total{reason="never_fits"}']


def test_tool_choice_none_or_auto_is_accepted(server):
    for choice in ("none", "auto"):
        r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                  "tool_choice": choice, "max_tokens": 1})
        assert r.status_code == 200, r.text


def test_models_retrieve(server):
    """GET /v1/models/{id} for each served name (the openai client's models.retrieve)."""
    c = client(server)
    for name in (MODEL, "tiny-alias"):
        m = c.models.retrieve(name)
        assert m.id == name and m.object == "model" and m.owned_by == "pagedkv"
    with pytest.raises(openai.NotFoundError) as e:
        c.models.retrieve("gpt-4")
    assert e.value.body["code"] == "model_not_found"
    r = httpx.get(server.url + "/v1/models/org/gpt-4")  # names may hold '/'
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_priority_reaches_the_engine(server, monkeypatch):
    engine = server.server.config.app.state.server.loop.engine
    seen = []
    real = engine.add_request

    def spy(*args, priority=0, **kw):
        seen.append(priority)
        return real(*args, priority=priority, **kw)
    monkeypatch.setattr(engine, "add_request", spy)
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "priority": -3}).status_code == 200
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                              "max_tokens": 1, "priority": 7, "n": 2})
    assert r.status_code == 200 and seen == [-3, 7, 7]


class _SlowTokenizer:
    """Wraps the tokenizer: each call sleeps ``delay`` and records whether an event loop
    runs on its thread (it must not: tokenizing on the loop stalls every stream)."""

    def __init__(self, tokenizer, delay: float) -> None:
        self.tokenizer, self.delay, self.on_loop = tokenizer, delay, []

    def __call__(self, *args, **kw):
        try:
            asyncio.get_running_loop()
            self.on_loop.append(True)
        except RuntimeError:
            self.on_loop.append(False)
        time.sleep(self.delay)
        return self.tokenizer(*args, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture
def slow_tokenizer(server):
    prompts = server.server.config.app.state.server.prompts
    slow = _SlowTokenizer(prompts.tokenizer, delay=1.5)
    prompts.tokenizer = slow
    yield slow
    prompts.tokenizer = slow.tokenizer


def test_tokenizing_does_not_block_the_event_loop(server, slow_tokenizer):
    """Issue 19 item 1: while a prompt is tokenized, /health and other requests go on."""
    done = {}
    t = threading.Thread(target=lambda: done.update(r=post(server, "/v1/completions",
                                                            {"prompt": "slow", "max_tokens": 1})))
    t.start()
    time.sleep(0.3)  # the request is inside the tokenizer now
    t0 = time.monotonic()
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert time.monotonic() - t0 < 0.5
    t.join(10)
    assert done["r"].status_code == 200 and slow_tokenizer.on_loop == [False]


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "ab" * (16 * MAX_MODEL_LEN) + "c"}),
    ("/v1/completions", {"prompt": ["ok", "x" * (32 * MAX_MODEL_LEN + 1)]}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x" * (16 * MAX_MODEL_LEN)},
                                           {"role": "user", "content": "y" * (16 * MAX_MODEL_LEN + 1)}]}),
    # many empty messages: each counts its template framing (they once rendered to ~5 tokens apiece uncounted)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": ""}] * (2 * MAX_MODEL_LEN + 100)
                              + [{"role": "user", "content": "hi"}]}),
])
def test_a_prompt_over_the_character_cap_is_refused_untokenized(server, slow_tokenizer, path, body):
    """Over 32 characters per token x max_model_len: a 400 at once, before the tokenizer."""
    t0 = time.monotonic()
    r = post(server, path, body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert r.json()["error"]["param"] == ("prompt" if "prompt" in body else "messages")
    assert time.monotonic() - t0 < 1.0 and slow_tokenizer.on_loop == []


def test_body_over_limit_is_413(listener):
    r = post(listener, "/v1/completions", content=json.dumps({"prompt": "x" * 100_000}).encode())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit is enforced while reading
        for _ in range(100):
            yield b" " * 1024
    r = httpx.post(listener.url + "/v1/completions", content=chunked(), headers=JSON_TYPE, timeout=30)
    assert r.status_code == 413


def test_unknown_fields_are_ignored_and_unknown_routes_are_openai_errors(server):
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1, "frobnicate": {"a": 1},
                                         "user": "u1", "presence_penalty": 0, "logit_bias": {}})
    assert r.status_code == 200, r.text


def test_unknown_routes_and_methods_are_openai_errors(listener):
    r = httpx.get(listener.url + "/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(listener.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_raises_typed_errors(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4, stream=True)


def test_bad_input_never_disturbs_a_running_request(server):
    result = {}

    def long_stream():
        chunks = list(client(server).completions.create(prompt="steady", max_tokens=60, stream=True,
                                                        extra_body={"ignore_eos": True}, **GREEDY))
        result["text"] = "".join(ch.choices[0].text for ch in chunks)
        result["finish"] = chunks[-1].choices[0].finish_reason
    ref = client(server).completions.create(prompt="steady", max_tokens=60, extra_body={"ignore_eos": True},
                                            **GREEDY).choices[0].text
    t = threading.Thread(target=long_stream)
    t.start()
    for path, body, status, *_ in BAD:
        r = post(server, path, **({"content": body} if isinstance(body, bytes) else {"body": body}))
        assert r.status_code == status
    t.join(30)
    assert result == {"text": ref, "finish": "length"}
    wait_idle(server)


# ---- browsers: content type, Host, Origin ----------------------------------------------
ONE = json.dumps({"prompt": "x", "max_tokens": 1}).encode()


@pytest.mark.parametrize("headers", [{"Content-Type": "text/plain"}, {"Content-Type": ""},
                                     {"Content-Type": "application/x-www-form-urlencoded"},
                                     {"Content-Type": "multipart/form-data; boundary=x"},
                                     JSON_TYPE | {"Content-Encoding": "gzip"}])
def test_post_bodies_must_be_plain_json(listener, headers):
    """A page can POST text/plain or a form cross-site with no CORS preflight: refuse them."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        r = post(listener, path, content=ONE, headers=headers)
        assert r.status_code == 415, r.text
        assert r.json()["error"]["code"] == "unsupported_media_type"
    r = post(listener, "/v1/completions", content=ONE, headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.2", "", "[::1",
                                  "localhost#evil.example", "evil.example@localhost", "localhost/x", "localhost:80x"])
def test_unknown_host_is_refused_without_a_key(listener, host):
    """DNS rebinding: the attacker's page reaches 127.0.0.1 under its own name."""
    for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"), ("GET", "/metrics"),
                         ("GET", "/health")):
        r = httpx.request(method, listener.url + path, content=ONE, headers=JSON_TYPE | {"Host": host})
        assert r.status_code == 403, (path, r.text)
        assert r.json()["error"]["code"] == "host_not_allowed"


@pytest.mark.parametrize("host", ["localhost", "LOCALHOST:1", "127.0.0.1:80", "[::1]:8000", "gpu-box.lan:8000"])
def test_loopback_and_allowed_hosts_are_served(listener, host):
    r = post(listener, "/v1/completions", content=ONE, headers={"Host": host})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("origin,status", [("http://evil.example", 403), ("null", 403), ("file://", 403),
                                           ("https://127.0.0.1.evil.example", 403),
                                           ("http://evil.example@localhost", 403), ("http://localhost/x", 403),
                                           ("http://localhost:3000", 200), ("http://[::1]:8000", 200),
                                           ("https://gpu-box.lan", 200)])
def test_cross_origin_browser_requests_are_refused(listener, origin, status):
    r = post(listener, "/v1/completions", content=ONE, headers={"Origin": origin})
    assert r.status_code == status, r.text
    if status == 403:
        assert r.json()["error"]["code"] == "origin_not_allowed"


def test_errors_quote_huge_numbers_briefly(server):
    for body in ({"prompt": "x", "seed": 10**400}, {"prompt": "x", "max_tokens": -(10**300)},
                 {"prompt": "x", "n": 10**100}, {"prompt": "x", "max_tokens": 1e300},
                 {"prompt": "x", "max_tokens": 10**4000}):
        r = post(server, "/v1/completions", body)
        assert r.status_code == 400 and len(r.json()["error"]["message"]) < 200, r.text


@pytest.mark.parametrize("repeated", [b"Host: localhost\r\nHost: evil.example\r\n",
                                      b"Host: localhost\r\nOrigin: http://localhost\r\n"
                                      b"Origin: http://evil.example\r\n",
                                      b"Host: localhost\r\nContent-Type: application/json\r\n"
                                      b"Content-Type: text/plain\r\n",
                                      b"Host: localhost\r\nContent-Encoding: identity\r\n"
                                      b"Content-Encoding: gzip\r\n"],
                         ids=["host", "origin", "content-type", "content-encoding"])
def test_repeated_security_headers_are_refused(listener, repeated):
    """Which of two Host (or Origin, Content-Type, Content-Encoding) headers counts is a
    parser's guess: a request that repeats one is refused, not checked against either."""
    if not repeated.startswith(b"Host: localhost\r\nContent-Type"):
        repeated += b"Content-Type: application/json\r\n"
    s = _raw(listener, b"POST /v1/completions HTTP/1.1\r\n" + repeated
             + f"Content-Length: {len(ONE)}\r\nConnection: close\r\n\r\n".encode() + ONE)
    s.settimeout(10)
    head = s.recv(4096)
    s.close()
    assert head.startswith(b"HTTP/1.1 400"), head


def test_with_a_key_any_host_is_served(keyed_server):
    r = post(keyed_server, "/v1/completions", content=ONE,
             headers={"Host": "api.example.com", "Authorization": f"Bearer {KEYS[0]}"})
    assert r.status_code == 200, r.text


# ---- auth and prefix-cache isolation ---------------------------------------------------
def test_api_key_required(keyed_server):
    with pytest.raises(openai.AuthenticationError) as e:
        client(keyed_server, "sk-wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    r = post(keyed_server, "/v1/completions", {"prompt": "x"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(keyed_server.url + "/v1/models").status_code == 401
    assert httpx.get(keyed_server.url + "/health").status_code == 200
    r = client(keyed_server, KEYS[1]).completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert r.usage.completion_tokens == 1
    assert metrics(keyed_server)['pagedkv_requests_rejected_total{reason="unauthorized"}'] >= 3


def test_a_utf8_key_works_and_a_non_ascii_header_is_a_401_on_server_and_proxy(tiny_model_dir, one_thread):
    """Issue 51: an Authorization header is bytes; the proxy passed it on as text, and a
    non-ASCII one crashed it (500) where the server answered."""
    from pagedkv.server.proxy import build_proxy

    key = "sk-ünï cöde"
    srv = _serve(tiny_model_dir, api_keys=[key])
    proxy = LiveServer(build_proxy(srv.url, srv.url, timeout=30, guard=GuardConfig(api_keys=(key,)))).start()
    try:
        for listener in (srv, proxy):
            good = {"Authorization": b"Bearer " + key.encode(), **JSON_TYPE}
            r = httpx.post(listener.url + "/v1/completions", content=ONE, headers=good, timeout=30)
            assert r.status_code == 200, r.text
            for bad in (b"Bearer caf\xc3\xa9", b"Bearer \xff\xfe"):
                r = httpx.post(listener.url + "/v1/completions", content=ONE, timeout=30,
                               headers={"Authorization": bad, **JSON_TYPE})
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    finally:
        proxy.stop()
        srv.stop()


def test_prefix_cache_is_isolated_per_api_key(keyed_server):
    prompt = "Tenant secret: the launch code is 0000, and the meeting is on Tuesday at noon. " * 4
    a, b = client(keyed_server, KEYS[0]), client(keyed_server, KEYS[1])
    cached = lambda c: c.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage \
        .prompt_tokens_details.cached_tokens  # noqa: E731
    assert cached(a) == 0
    assert cached(a) >= 32          # the same tenant hits its own cache
    assert cached(b) == 0           # another tenant does not see it
    assert cached(b) >= 32


# ---- load, batching, aborts -----------------------------------------------------------
def test_load_32_clients_all_complete_and_blocks_return(server):
    before = metrics(server)
    r = asyncio.run(run_load(server.url, MODEL, clients=32, requests=64, max_tokens=12, timeout=30))
    assert r.failed == 0 and r.completed == 64, r.errors
    assert r.output_tokens == 64 * 12 and r.ttft_p50_s is not None
    after = wait_idle(server)
    assert after['pagedkv_kv_blocks{state="used"}'] == 0
    # continuous batching across connections: some steps served many requests at once
    big = (after["pagedkv_step_num_requests_count"] - after['pagedkv_step_num_requests_bucket{le="4.0"}']) \
        - (before["pagedkv_step_num_requests_count"] - before['pagedkv_step_num_requests_bucket{le="4.0"}'])
    assert big > 0
    assert after["pagedkv_generation_tokens_total"] - before["pagedkv_generation_tokens_total"] >= 64 * 12


def _aborts(srv) -> float:
    return metrics(srv).get('pagedkv_requests_finished_total{finish_reason="abort"}', 0.0)


def test_client_closing_a_stream_aborts_and_frees_blocks(server):
    before = _aborts(server)
    stream = client(server).completions.create(prompt="never ending", max_tokens=300, stream=True,
                                               extra_body={"ignore_eos": True}, **GREEDY)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    assert metrics(server)['pagedkv_kv_blocks{state="used"}'] > 0
    stream.close()
    wait_idle(server)
    assert _aborts(server) == before + 1


def test_client_leaving_a_non_streaming_request_aborts_it(server):
    before = _aborts(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={"prompt": "wait", "max_tokens": 300, "ignore_eos": True},
                   timeout=httpx.Timeout(30, read=0.05))
    wait_idle(server)
    assert _aborts(server) == before + 1


# ---- slow clients ------------------------------------------------------------------------
FAST = HTTPLimits(header_timeout_s=0.5, body_timeout_s=1.0, limit_concurrency=4)
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def strict_server(tiny_model_dir, one_thread):
    srv = _serve(tiny_model_dir, live={"limits": FAST})
    yield srv
    srv.stop()


def _raw(srv, data: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=10)
    s.sendall(data)
    return s


def _closed_within(s: socket.socket, seconds: float) -> bool:
    """True if the server closes ``s`` (EOF; what it sends before is skipped) within ``seconds``."""
    deadline = time.monotonic() + seconds
    try:
        while True:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            if s.recv(4096) == b"":
                return True
    except (TimeoutError, socket.timeout):
        return False
    except ConnectionResetError:
        return True
    finally:
        s.close()


@pytest.mark.parametrize("data", [b"", b"POST /v1/compl", HEAD,
                                  HEAD + b"Content-Length: 100\r\n\r\n" + b'{"prompt": "x"'],
                         ids=["silent", "partial-line", "partial-headers", "partial-body"])
def test_stalled_client_is_disconnected(strict_server, data):
    t0 = time.monotonic()
    assert _closed_within(_raw(strict_server, data), 5.0)
    assert time.monotonic() - t0 < 3.0
    assert httpx.get(strict_server.url + "/health").status_code == 200


def test_stalled_second_request_on_a_kept_alive_connection(strict_server):
    s = _raw(strict_server, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    s.sendall(b"GET /health HTTP/1.1\r\n")  # and nothing more: keep-alive's timer is off now
    assert _closed_within(s, 5.0)


def test_slow_but_steady_upload_within_the_deadline_is_served(strict_server):
    body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    s = _raw(strict_server, HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode())
    for i in range(0, len(body), 10):
        time.sleep(0.05)
        s.sendall(body[i:i + 10])
    s.settimeout(10)
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    s.close()


def test_connections_over_the_limit_get_503(strict_server):
    idle = [_raw(strict_server) for _ in range(FAST.limit_concurrency - 1)]
    try:  # the limit's last connection is served (uvicorn's own count would refuse it)
        time.sleep(0.1)
        assert httpx.get(strict_server.url + "/health").status_code == 200
    finally:
        for s in idle:
            s.close()
    idle = [_raw(strict_server) for _ in range(FAST.limit_concurrency)]
    try:
        time.sleep(0.1)
        assert httpx.get(strict_server.url + "/health").status_code == 503
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 5
    while httpx.get(strict_server.url + "/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_shutdown_keeps_its_timeout_with_a_client_stuck_mid_upload(tiny_model_dir, one_thread):
    srv = _serve(tiny_model_dir, live={"shutdown_timeout": 1.0, "limits": HTTPLimits(body_timeout_s=60)})
    stuck = _raw(srv, HEAD + b"Content-Length: 100\r\n\r\n{")
    time.sleep(0.2)
    t0 = time.monotonic()
    srv.stop(timeout=15)
    took = time.monotonic() - t0
    stuck.close()
    assert not srv._thread.is_alive() and took < 2.5, took


def _non_reading_stream(srv) -> socket.socket:
    """A client that asks for a long, wordy stream (8 choices, 20 log-probs per token) and
    never reads it; returns once the server's writing to it is paused (buffers full)."""
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 480, "n": 8, "logprobs": 20,
                       "ignore_eos": True, "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.connect(("127.0.0.1", srv.port))
    s.sendall(HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.monotonic() + 60
    while not any(getattr(c, "flow", None) is not None and c.flow.write_paused
                  for c in list(srv.server.server_state.connections)):
        assert time.monotonic() < deadline, "the server never filled the client's buffers"
        time.sleep(0.05)
    return s


def test_a_client_that_stops_reading_a_stream_is_cut_and_its_requests_aborted(tiny_model_dir, one_thread):
    """Issue 19: a stream nobody reads held its connection and its engine requests until
    they finished (and its queue kept a copy of every output): now writing paused for
    ``write_timeout_s`` aborts the connection, the requests and their blocks."""
    srv = _serve(tiny_model_dir, num_blocks=320, live={"limits": HTTPLimits(write_timeout_s=0.5)})
    try:
        s = _non_reading_stream(srv)
        t0 = time.monotonic()
        m = wait_idle(srv, timeout=20)
        assert m['pagedkv_requests_finished_total{finish_reason="abort"}'] == 8, m
        assert time.monotonic() - t0 < 10
        assert _closed_within(s, 5.0)
    finally:
        srv.stop()


def test_shutdown_during_a_long_engine_step_ends_streams_cleanly(tiny_model_dir, one_thread, caplog):
    """Second break-it pass: a step outliving the drain + uvicorn's 5 s margin got the
    request cancelled (a plain-text 500 or a cut stream, a CancelledError traceback). Now
    the engine step in flight ends, the abort lands, the stream ends with [DONE]; and once
    shutdown starts, steps are capped at 256 tokens."""
    srv = _serve(tiny_model_dir, live={"shutdown_timeout": 0.3})
    engine = srv.server.config.app.state.server.loop.engine
    inner, slow = engine.step, threading.Event()

    def step():
        if slow.is_set():
            slow.clear()
            time.sleep(6.0)  # a long prefill chunk on a slow CPU
        return inner()
    engine.step = step
    r = httpx.stream("POST", srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 300, "ignore_eos": True,
                                                                "stream": True}, timeout=30)
    lines = []
    stopper = threading.Thread(target=srv.stop, kwargs={"timeout": 40})
    with caplog.at_level(logging.WARNING), r as resp:
        for line in resp.iter_lines():
            if not line:
                continue
            lines.append(line)
            if len(lines) == 1:
                slow.set()
                time.sleep(0.2)
                t0 = time.monotonic()
                stopper.start()
    stopper.join(40)
    took = time.monotonic() - t0
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" and events[-1]["choices"][0]["finish_reason"] == "abort", lines[-3:]
    assert took < 10 and not srv._thread.is_alive(), took
    assert "Traceback" not in caplog.text and "Cancel" not in caplog.text, caplog.text
    assert engine.scheduler.max_num_batched_tokens <= 256


def test_shutdown_keeps_its_timeout_with_a_client_that_stops_reading(tiny_model_dir, one_thread, caplog):
    """Issue 19: at shutdown such a stream waited for uvicorn's hard stop (drain + 5 s) and
    logged a CancelledError traceback."""
    srv = _serve(tiny_model_dir, num_blocks=320,
                 live={"shutdown_timeout": 1.0, "limits": HTTPLimits(write_timeout_s=60)})
    s = _non_reading_stream(srv)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        srv.stop(timeout=15)
    took = time.monotonic() - t0
    s.close()
    assert not srv._thread.is_alive() and took < 3.0, took
    assert "Cancel" not in caplog.text and "Traceback" not in caplog.text, caplog.text


def test_output_sink_keeps_only_the_latest_output_per_choice():
    """A client that reads nothing costs one (cumulative) output per choice, and a finished
    output or an error is never replaced by a later item."""
    from pagedkv.engine.outputs import RequestOutput
    from pagedkv.server.engine_loop import OutputSink

    def out(n: int, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", None, [1], "x" * n, list(range(n)), finished, "length" if finished else None, 1, 0)

    sink = OutputSink()
    for n in range(1, 1001):
        sink.put_nowait((0, out(n)))
        sink.put_nowait((1, out(n)))
    assert sink.pending() == 2
    sink.put_nowait((0, out(1001, finished=True)))
    sink.put_nowait((0, out(1002)))
    err = RuntimeError("engine failed")
    sink.put_nowait((1, err))
    sink.put_nowait((1, out(1003)))
    batch = asyncio.run(sink.get_batch())
    assert len(batch[0].token_ids) == 1001 and batch[0].finished and batch[1] is err
    assert sink.pending() == 0


# ---- engine failure -------------------------------------------------------------------
def test_top_p_below_fp32_resolution_is_greedy_not_an_abort(server):
    """Issue 19 item 6: top_p 1e-300 is 0 in fp32; every token was dropped and the client
    got 503 "shutting down" (streamed: finish_reason abort). Now it keeps the top token."""
    c = client(server)
    greedy = c.completions.create(prompt="Tiny top_p", max_tokens=6, **GREEDY).choices[0]
    kw = dict(model=MODEL, prompt="Tiny top_p", max_tokens=6, temperature=1.0, top_p=1e-300, seed=3)
    r = c.completions.create(**kw).choices[0]
    assert (r.text, r.finish_reason) == (greedy.text, greedy.finish_reason)
    chunks = list(c.completions.create(**kw, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks) == greedy.text
    assert chunks[-1].choices[0].finish_reason == greedy.finish_reason


def _fail_sampling_when_top_k_is(marker: int, monkeypatch) -> None:
    """Rows with ``top_k == marker`` fail to sample, as non-finite logits do."""
    from pagedkv.worker import model_runner as runner
    from pagedkv.worker.sampler import SampledToken, sample

    def failing(logits, params, generators):
        out = sample(logits, params, generators)
        return [SampledToken(-1, None, "the model produced non-finite logits") if p.top_k == marker else t
                for t, p in zip(out, params)]
    monkeypatch.setattr(runner, "sample", failing)


def test_an_engine_error_reaches_the_client_as_500_not_shutdown(server, monkeypatch):
    """Issue 19 item 6: a request the engine ends with ``RequestOutput.error`` is a 500 with
    that message (streamed: an error event), not 503 "shutting down" or a silent abort."""
    _fail_sampling_when_top_k_is(7, monkeypatch)
    body = {"model": MODEL, "prompt": "fail me", "max_tokens": 4, "top_k": 7}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "engine_error" and "non-finite" in err["message"]
    with pytest.raises(openai.APIError, match="non-finite"):
        list(client(server).completions.create(model=MODEL, prompt="fail me", max_tokens=4, stream=True,
                                               extra_body={"top_k": 7}))
    r = post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                               "max_tokens": 4, "top_k": 7, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.status_code == 200 and events[-1]["error"]["code"] == "engine_error"
    assert all(ch["choices"][0]["finish_reason"] is None for ch in events[:-1])
    assert r.text.endswith("data: [DONE]\n\n")
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "fine", "max_tokens": 2, "top_k": 3})
    assert r.status_code == 200  # other requests go on
    wait_idle(server)


def test_engine_failure_is_503_not_a_hang(tiny_model_dir, one_thread, no_server_errors):
    srv = _serve(tiny_model_dir)
    engine = srv.server.config.app.state.server.loop.engine

    def boom():
        raise RuntimeError("secret internal detail")
    engine.step = boom
    try:
        r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
        assert "secret" not in r.text and "Traceback" not in r.text
        assert httpx.get(srv.url + "/health").status_code == 503
        r = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stream": True})
        assert r.status_code == 503
    finally:
        srv.stop()
    messages = [rec.getMessage() for rec in no_server_errors.records]
    assert messages == ["engine step failed; the server stops serving"]
    no_server_errors.records.clear()  # the one expected error


def test_messages_keep_a_name_and_take_an_empty_tool_calls_list():
    from pagedkv.server.protocol import parse_messages

    out = parse_messages([{"role": "user", "content": "x", "name": "ann"},
                          {"role": "assistant", "content": None, "tool_calls": []}])
    assert out == [{"role": "user", "content": "x", "name": "ann"}, {"role": "assistant", "content": ""}]


def test_an_idle_engine_loop_refreshes_its_stats():
    """/metrics reads the loop's snapshot: an engine with no requests still refreshes it
    (a KV link that went down showed link_up 1 until the next request)."""
    from pagedkv.server import engine_loop

    class Idle:
        calls = 0

        def stats(self):
            Idle.calls += 1
            return Idle.calls

        def has_unfinished_requests(self):
            return False

        def close(self):
            pass

    loop = engine_loop.EngineLoop(Idle())
    loop.start()
    try:
        time.sleep(2.5 * engine_loop.IDLE_STATS_REFRESH_S)
        assert loop.stats >= 3  # the first snapshot, then one a second
    finally:
        loop.stop()
