"""Request bodies of the OpenAI API, checked field by field into plain dataclasses.

Every problem raises :class:`APIError` with the HTTP status and an OpenAI-style body::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": null}}

Unknown fields are ignored, as OpenAI does. Known fields whose non-default values this
server cannot honour (penalties, ``logit_bias``, ``tools``, chat's ``echo``, ...) are rejected
rather than silently ignored. ``null`` means "the default" for every optional field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedkv.core.sampling_params import MAX_STOP_CHARS, SamplingParams
from pagedkv.reprs import brief

MAX_N = 8                  # choices per request
MAX_PROMPTS = 64           # prompts in one /v1/completions request
MAX_STOP = 16              # stop strings
MAX_LOGPROBS = 20
SEED_RANGE = (-2**63, 2**63 - 1)   # what SamplingParams accepts: a signed 64-bit integer
PRIORITY_RANGE = SEED_RANGE        # vLLM's request priority: any integer; lower runs first
CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}
UNSUPPORTED_MESSAGE_KEYS = ("tool_calls", "tool_call_id", "function_call")


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-style JSON body. ``count=False``
    keeps it out of the server's rejected-requests metric (the engine counted it);
    ``reason`` is its label there for a 4xx other than 401."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, count: bool = True,
                 reason: str = "invalid") -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.count, self.reason = count, reason

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _unicode(s: str, where: str) -> str:
    """``s`` if it is valid Unicode. Raises APIError 400 on a lone surrogate (JSON's
    ``"\\ud800"`` decodes to one; no tokenizer or UTF-8 encoder accepts it)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(where, f"'{where}' is not valid Unicode: a lone surrogate at character {e.start}") from None
    return s


@dataclass
class GenerateRequest:
    """What both endpoints share once the body is checked."""

    model: str | None
    params: SamplingParams
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    cache_salt: str | None = None
    priority: int = 0               # under --scheduling-policy priority, lower is admitted first
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:<id>"


@dataclass
class CompletionRequest(GenerateRequest):
    """``echo``: the response repeats each prompt (and, with ``logprobs``, scores its
    tokens, as lm-evaluation-harness asks); ``score_only``: ``echo`` with ``max_tokens: 0``,
    so the engine's one sampled token is not shown."""

    prompts: list = field(default_factory=list)   # each a str or a list of token ids
    echo: bool = False
    score_only: bool = False


@dataclass
class ChatRequest(GenerateRequest):
    messages: list[dict] = field(default_factory=list)
    top_logprobs: int | None = None                # None = no logprobs


# ---- field readers ---------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, name: str, default, lo=None, hi=None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise bad(name, f"'{name}' must be an integer, got {type(v).__name__}", "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(name, f"'{name}' must be {rng}, got {brief(v)}")
    return v


def _float(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise bad(name, f"'{name}' must be a number, got {type(v).__name__}", "invalid_type")
    try:
        finite = math.isfinite(v)
    except OverflowError:  # an integer beyond float range, e.g. 10**400
        finite = False
    if not finite:
        raise bad(name, f"'{name}' must be finite")
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"'{name}' must be a boolean, got {type(v).__name__}", "invalid_type")
    return v


def _str(body: dict, name: str, default: str | None = None) -> str | None:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, str):
        raise bad(name, f"'{name}' must be a string, got {type(v).__name__}", "invalid_type")
    return _unicode(v, name)


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop", "'stop' must be a string or a list of strings", "invalid_type")
    if len(v) > MAX_STOP:
        raise bad("stop", f"'stop' takes at most {MAX_STOP} strings, got {len(v)}")
    if any(len(s) > MAX_STOP_CHARS for s in v):
        raise bad("stop", f"a stop string has at most {MAX_STOP_CHARS} characters, got {max(map(len, v))}")
    return [_unicode(s, "stop") for s in v]


def _token_ids(body: dict, name: str) -> list[int]:
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(_is_int(t) and t >= 0 for t in v):
        raise bad(name, f"'{name}' must be a list of non-negative integers", "invalid_type")
    return v


_UNSUPPORTED = {  # field -> values that mean "off"
    "echo": (False,), "suffix": ("",), "best_of": (1,), "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0), "logit_bias": ({},),
    "tools": ([],), "functions": ([],), "audio": (), "prediction": (),
    "tool_choice": ("none", "auto"),   # with no tools, "auto" can only mean "none"
    "function_call": ("none", "auto"), "min_tokens": (0,), "min_p": (0, 0.0), "bad_words": ([],),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "structured_outputs": (), "prompt_logprobs": (),
}


def _is_off(v, off) -> bool:
    """``v`` is the "off" value ``off`` (numbers compare by value: 1.0 is 1; never a bool)."""
    if isinstance(v, (int, float)) and isinstance(off, (int, float)) and not isinstance(v, bool) \
            and not isinstance(off, bool):
        return v == off
    return v == off and type(v) is type(off)


def _reject_unsupported(body: dict, allowed: tuple[str, ...] = ()) -> None:
    for name, off in _UNSUPPORTED.items():
        if name in allowed:
            continue
        v = body.get(name)
        if v is not None and not any(_is_off(v, o) for o in off):
            raise bad(name, f"'{name}' is not supported by this server", "unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and not (isinstance(rf, dict) and rf.get("type") == "text"):
        raise bad("response_format", "only response_format {'type': 'text'} is supported",
                  "unsupported_parameter")


# ---- the shared part ---------------------------------------------------------------
def _common(body: dict, max_tokens_names: tuple[str, ...], default_max_tokens: int | None,
            logprobs: int | None, prompt_logprobs: int | None = None, echo: bool = False) -> dict:
    """The fields both endpoints share, checked. With ``echo``, ``max_tokens: 0`` is allowed
    (prompt scoring only): the engine then samples one token nobody sees."""
    _reject_unsupported(body, ("echo",) if echo else ())
    model = _str(body, "model")
    max_tokens = default_max_tokens
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens = _int(body, name, None, lo=0 if echo else 1)
            break
    if max_tokens == 0:
        max_tokens = 1
    temperature = _float(body, "temperature", 1.0)
    if temperature < 0:
        raise bad("temperature", f"'temperature' must be >= 0, got {brief(temperature)}")
    top_p = _float(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad("top_p", f"'top_p' must be in (0, 1], got {brief(top_p)}")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad("stream_options", "'stream_options' must be an object", "invalid_type")
    n = _int(body, "n", 1, 1, MAX_N)
    params = _params(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                     top_k=_int(body, "top_k", 0, lo=-1), seed=_seed(body, n),
                     stop=_stop(body), stop_token_ids=_token_ids(body, "stop_token_ids"),
                     ignore_eos=_bool(body, "ignore_eos", False), logprobs=logprobs,
                     prompt_logprobs=prompt_logprobs, skip_special_tokens=_bool(body, "skip_special_tokens", True),
                     kv_budget_tokens=_int(body, "kv_budget_tokens", None, lo=1),
                     kv_transfer_params=_kv_transfer_params(body))
    return dict(model=model, params=params, n=n,
                stream=_bool(body, "stream", False),
                include_usage=_bool(stream_options or {}, "include_usage", False),
                user=_str(body, "user"), cache_salt=_str(body, "cache_salt"),
                priority=_int(body, "priority", 0, *PRIORITY_RANGE),
                return_tokens_as_token_ids=_bool(body, "return_tokens_as_token_ids", False))


def _kv_transfer_params(body: dict) -> dict | None:
    """vLLM's ``kv_transfer_params`` (disaggregated prefill/decode; checked by SamplingParams)."""
    value = body.get("kv_transfer_params")
    if value is not None and not isinstance(value, dict):
        raise bad("kv_transfer_params", "'kv_transfer_params' must be an object", "invalid_type")
    return value


def _seed(body: dict, n: int) -> int | None:
    """The seed of choice 0; choice ``j`` gets ``seed + j``, so all ``n`` must fit in 64 bits."""
    seed = _int(body, "seed", None, *SEED_RANGE)
    if seed is not None and seed + n - 1 > SEED_RANGE[1]:
        raise bad("seed", f"'seed' + n - 1 must be <= {SEED_RANGE[1]} (choice j samples with seed + j), "
                  f"got seed {seed} with n {n}")
    return seed


def _params(**kw) -> SamplingParams:
    """SamplingParams from checked fields. Raises APIError 400 if it still refuses them
    (a check this module missed must not become a 500)."""
    try:
        return SamplingParams(**kw)
    except ValueError as e:
        raise bad(None, str(e)) from None


def parse_completion(body: dict) -> CompletionRequest:
    """Check a ``/v1/completions`` body. Raises :class:`APIError` (400)."""
    logprobs = _int(body, "logprobs", None, 0, MAX_LOGPROBS)
    echo = _bool(body, "echo", False)
    common = _common(body, ("max_tokens",), 16, logprobs, logprobs if echo else None, echo=echo)
    score_only = echo and body.get("max_tokens") is not None and body["max_tokens"] == 0
    return CompletionRequest(**common, prompts=_prompts(body.get("prompt")), echo=echo, score_only=score_only)


def _prompts(v) -> list:
    if v is None:
        raise bad("prompt", "'prompt' is required", "missing_required_parameter")
    if isinstance(v, str) or (isinstance(v, list) and v and all(_is_int(t) for t in v)):
        v = [v]
    if not isinstance(v, list) or not v:
        raise bad("prompt", "'prompt' must be a non-empty string, a list of strings, a list of "
                  "token ids or a list of token-id lists", "invalid_type")
    if len(v) > MAX_PROMPTS:
        raise bad("prompt", f"at most {MAX_PROMPTS} prompts per request, got {len(v)}")
    if len({isinstance(p, str) for p in v}) > 1:
        raise bad("prompt", "a prompt list holds either strings or token-id lists, not both", "invalid_type")
    for p in v:
        if isinstance(p, str):
            if not p:
                raise bad("prompt", "the prompt is empty")
            _unicode(p, "prompt")
        elif isinstance(p, list) and p and all(_is_int(t) and t >= 0 for t in p):
            pass
        elif isinstance(p, list) and not p:
            raise bad("prompt", "the prompt is empty")
        else:
            raise bad("prompt", "each prompt must be a string or a list of non-negative integer "
                      "token ids", "invalid_type")
    return v


def parse_chat(body: dict) -> ChatRequest:
    """Check a ``/v1/chat/completions`` body. Raises :class:`APIError` (400)."""
    want = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    top = (top or 0) if want else None
    common = _common(body, ("max_completion_tokens", "max_tokens"), None, top)
    return ChatRequest(**common, messages=parse_messages(body.get("messages")), top_logprobs=top)


def parse_messages(v) -> list[dict]:
    """Chat ``messages`` checked: roles, text content. Raises APIError 400."""
    if not isinstance(v, list) or not v:
        raise bad("messages", "'messages' must be a non-empty list of messages",
                  "missing_required_parameter" if v is None else "invalid_type")
    out = []
    for i, m in enumerate(v):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, f"{where} must be an object", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:  # a list or dict is unhashable
            raise bad(f"{where}.role", f"{where}.role must be one of {sorted(CHAT_ROLES)}, got {brief(role)}")
        for key in UNSUPPORTED_MESSAGE_KEYS:
            if m.get(key) not in (None, []):  # as 'tools': refused, not dropped (an empty list is none)
                raise bad(f"{where}.{key}", f"{where}.{key}: tool calls are not supported", "unsupported_parameter")
        msg = {"role": "system" if role == "developer" else role,
               "content": _content(m.get("content"), f"{where}.content")}
        if m.get("name") is not None:  # a participant's name: the template's to use or ignore
            if not isinstance(m["name"], str):
                raise bad(f"{where}.name", f"{where}.name must be a string, got {brief(m['name'])}", "invalid_type")
            msg["name"] = _unicode(m["name"], f"{where}.name")
        out.append(msg)
    if not any(m["content"] for m in out):
        raise bad("messages", "the messages are empty")
    return out


def _content(c, where: str) -> str:
    if c is None:
        return ""
    if isinstance(c, str):
        return _unicode(c, where)
    if isinstance(c, list):
        parts = []
        for p in c:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise bad(where, f"{where}: only text content parts are supported", "unsupported_parameter")
            parts.append(_unicode(p["text"], where))
        return "".join(parts)
    raise bad(where, f"{where} must be a string or a list of text parts", "invalid_type")
