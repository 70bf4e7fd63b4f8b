"""Response and stream-chunk bodies for ``/v1/completions`` and ``/v1/chat/completions``.

``RequestOutput.text`` is cumulative (it already holds back a partial stop string);
:class:`ChoiceState` turns successive outputs of one choice into text deltas and the
logprobs of the tokens not yet sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.outputs import RequestOutput

REPLACEMENT = "\ufffd"  # what a token ending inside a UTF-8 character decodes to, for now


@dataclass
class ChoiceState:
    """What has been sent of one choice so far."""

    text: str = ""
    num_tokens: int = 0
    base: int = 0                      # text_offset of the output's first character (after an echo)
    decoder: IncrementalDetokenizer | None = field(default=None, repr=False)  # the output so far
    role_sent: bool = False
    echoed: bool = False               # the prompt was sent (completions with echo)
    last: RequestOutput | None = field(default=None, repr=False)

    def delta(self, out: RequestOutput) -> str:
        """New text since the last call. A trailing U+FFFD (an unfinished multi-byte
        character) is held back until the output finishes."""
        self.last = out
        text = out.text
        if not out.finished:
            text = text.rstrip(REPLACEMENT)
        if text.startswith(self.text):
            new = text[len(self.text):]
        else:  # the decoded prefix changed (rare): send only what extends the common part
            common = _common_prefix_len(text, self.text)
            new = text[common:] if len(text) > len(self.text) else ""
        self.text = self.text + new
        return new

    def new_tokens(self, out: RequestOutput) -> tuple[list[int], list[dict[int, float]]]:
        ids = out.token_ids[self.num_tokens:]
        lps = (out.logprobs or [])[self.num_tokens:]
        self.num_tokens = len(out.token_ids)
        return ids, lps


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


def usage(outs: list[RequestOutput], n: int) -> dict:
    """OpenAI ``usage`` of choices ``outs`` (choice ``i * n + j`` is prompt ``i``'s ``j``-th
    sample). Completion tokens are summed over choices; each prompt counts once, as OpenAI
    and vLLM count it, with the cached tokens of its least-cached sample."""
    samples = [outs[i:i + n] for i in range(0, len(outs), n)]
    prompt = sum(s[0].num_prompt_tokens for s in samples)
    cached = sum(min(o.num_cached_tokens for o in s) for s in samples)
    completion = sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ---- logprobs ----------------------------------------------------------------------
class TokenText:
    """Token id -> its text, for logprobs (decoded one token at a time, cached). A token
    holding part of a character's bytes decodes to U+FFFD, so two tokens can share a text;
    ``TokenIdText`` (vLLM's ``return_tokens_as_token_ids``) keeps them apart."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self.tokenizer.decode([token_id])
        return s


class TokenIdText(TokenText):
    """Token id -> ``"token_id:<id>"``, as vLLM writes tokens under ``return_tokens_as_token_ids``."""

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def completion_logprobs(ids: list[int], lps: list[dict[int, float]], tt: TokenText,
                        state: ChoiceState, skip_special_tokens: bool = True) -> dict:
    """Legacy completions ``logprobs``: tokens, token_logprobs, top_logprobs, text_offset
    (where each token's text starts in the choice's ``text``: the output decoded so far)."""
    if state.decoder is None:
        state.decoder = IncrementalDetokenizer(tt.tokenizer, skip_special_tokens)
    tokens, offsets = _tokens_and_offsets(ids, tt, state.decoder, state.base)
    return {"tokens": tokens, "token_logprobs": [lp.get(t) for t, lp in zip(ids, lps)],
            "top_logprobs": [_top_by_text(lp, tt) for lp in lps], "text_offset": offsets}


def echo_logprobs(out: RequestOutput, tt: TokenText) -> dict:
    """The prompt's part of legacy ``logprobs`` under ``echo`` (OpenAI's legacy API and
    vLLM's shape): every prompt token with its log-probability given the tokens before it,
    ``null`` (and ``null`` top_logprobs) for the first, which nothing predicts; each
    ``top_logprobs`` entry holds the top-k and the prompt token itself."""
    ids = out.prompt_token_ids
    values = out.prompt_logprobs or [None] * len(ids)
    tops = out.prompt_top_logprobs or [None] * len(ids)
    tokens, offsets = _tokens_and_offsets(ids, tt, IncrementalDetokenizer(tt.tokenizer, False), 0)
    top_logprobs: list[dict | None] = [None]
    for t, v, top in zip(ids[1:], values[1:], tops[1:]):
        lp = dict(top or {})
        if v is not None:
            lp.setdefault(t, v)
        top_logprobs.append(_top_by_text(lp, tt))
    return {"tokens": tokens, "token_logprobs": [None, *values[1:]][:len(ids)], "top_logprobs": top_logprobs,
            "text_offset": offsets}


def join_logprobs(parts: list[dict]) -> dict:
    """Legacy ``logprobs`` objects one after the other (the echoed prompt, then the output)."""
    return {key: [x for p in parts for x in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs",
                                                                  "text_offset")}


def prompt_text(out: RequestOutput, tokenizer) -> str:
    """The prompt as text: as sent, or decoded from the token ids it was sent as."""
    return out.prompt if out.prompt is not None else tokenizer.decode(out.prompt_token_ids)


def _tokens_and_offsets(ids: list[int], tt: TokenText, decoder: IncrementalDetokenizer,
                        base: int) -> tuple[list[str], list[int]]:
    """Each token's text and its ``text_offset``: ``base`` + the length of what ``decoder``
    had decoded before it (a character split across tokens counts once, at its first
    token, so offsets index the decoded text, not the sum of the tokens' U+FFFD pieces)."""
    tokens, offsets = [], []
    for t in ids:
        tokens.append(tt(t))
        offsets.append(base + len(decoder.text))
        decoder.push(t)
    return tokens, offsets


def _top_by_text(lp: dict[int, float], tt: TokenText) -> dict[str, float]:
    """``{token text: log-prob}``, most likely first; two ids with the same text (e.g. both
    halves of a character, U+FFFD) keep the higher value."""
    out: dict[str, float] = {}
    for k, v in _ranked(lp):
        out.setdefault(tt(k), v)
    return out


def chat_logprobs(ids: list[int], lps: list[dict[int, float]], top: int, tt: TokenText) -> dict:
    """Chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    def entry(t: int, v: float | None) -> dict:
        s = tt(t)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}
    content = []
    for t, lp in zip(ids, lps):
        content.append(entry(t, lp.get(t)) | {"top_logprobs": [entry(k, v) for k, v in _ranked(lp)[:top]]})
    return {"content": content}


def _ranked(lp: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(lp.items(), key=lambda kv: (-kv[1], kv[0]))


# ---- bodies --------------------------------------------------------------------------
def completion_body(rid: str, created: int, model: str, choices: list[dict], outs, n: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage(outs, n)}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     logprobs: dict | None, reason: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]}


def chat_body(rid: str, created: int, model: str, choices: list[dict], outs, n: int) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage(outs, n)}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict,
               logprobs: dict | None, reason: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}]}


def usage_chunk(rid: str, created: int, model: str, obj: str, outs, n: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(outs, n)}
