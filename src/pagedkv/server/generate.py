"""The generation path shared by both endpoints: fan out, add, then stream or collect.

One HTTP request becomes ``len(prompts) * n`` engine requests, added atomically (all or
none); choice ``i * n + j`` is prompt ``i``'s ``j``-th sample. Whatever way the response
ends (done, error, client gone, server shutting down), ``finally`` aborts the engine
requests it added; for finished ones that is a no-op.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedkv.engine.outputs import RequestOutput
from pagedkv.server import responses as R
from pagedkv.server.engine_loop import EngineLoop, EngineUnavailable, NewRequest, OutputSink
from pagedkv.server.protocol import APIError, ChatRequest, GenerateRequest

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass
class Job:
    """One HTTP request's engine requests and how to present them."""

    rid: str
    created: int
    model: str
    req: GenerateRequest
    request_ids: list[str]
    sink: OutputSink
    token_text: R.TokenText

    @property
    def chat(self) -> bool:
        return isinstance(self.req, ChatRequest)

    @property
    def echo(self) -> bool:
        return getattr(self.req, "echo", False)

    def shown(self, out: RequestOutput) -> RequestOutput:
        """``out`` as the client sees it: with ``echo`` and ``max_tokens: 0`` (prompt
        scoring), the one token the engine sampled is left out and a finished choice
        ends with ``length``, as vLLM answers."""
        if not getattr(self.req, "score_only", False):
            return out
        return replace(out, text="", token_ids=[], logprobs=[] if out.logprobs is not None else None,
                       finish_reason="length" if out.finished else None, stop_reason=None)


async def start(loop: EngineLoop, req: GenerateRequest, prompts: list[dict], model: str,
                default_max_tokens: Callable[[int], int], cache_salt: str | None,
                token_text: R.TokenText) -> Job:
    """Add the engine requests. Raises APIError 400 (never fits) or 503 (engine down)."""
    rid = f"{'chatcmpl' if isinstance(req, ChatRequest) else 'cmpl'}-{uuid.uuid4().hex}"
    new = []
    for i, p in enumerate(prompts):
        for j in range(req.n):
            params = _transfer_params(req.params, i, len(prompts))
            if params.max_tokens is None:  # chat without max_tokens; completions default to 16
                params = replace(params, max_tokens=default_max_tokens(len(p["prompt_token_ids"])))
            if req.n > 1 and params.seed is not None:
                params = replace(params, seed=params.seed + j)
            new.append(NewRequest(f"{rid}-{len(new)}", p, params, req.priority))
    sink = OutputSink()
    try:
        await loop.add(new, sink, cache_salt)
    except ValueError as e:
        code = "context_length_exceeded" if "max_model_len" in str(e) or "KV blocks" in str(e) else None
        raise APIError(400, str(e), code=code,
                       count=False) from None
    except EngineUnavailable as e:
        raise APIError(503, str(e), type="server_error", code="engine_unavailable") from None
    except BaseException:
        loop.abort([r.request_id for r in new])  # cancelled while adding: the add may still land
        raise
    return Job(rid, int(time.time()), model, req, [r.request_id for r in new], sink, token_text)


def _transfer_params(params, prompt_index: int, num_prompts: int):
    """With several prompts in one body, prompt ``i``'s KV transfer gets its own id
    (``T.i``: the producer's and the consumer's servers derive the same); the ``n`` choices
    of one prompt share it (the consumer pulls it once per step for all of them)."""
    kv = params.kv_transfer_params
    if not kv or not kv.get("transfer_id") or num_prompts == 1:
        return params
    return replace(params, kv_transfer_params={**kv, "transfer_id": f"{kv['transfer_id']}.{prompt_index}"})


# ---- non-streaming -------------------------------------------------------------------
async def respond(loop: EngineLoop, job: Job, request: Request) -> Response:
    """Wait for every choice (aborting if the client goes away) and answer in one body."""
    try:
        outs = await _until_disconnect(request, _collect(job))
        if outs is None:
            return Response(status_code=499)
        failed = next((e for o in outs if (e := _engine_error(o)) is not None), None)
        if failed is not None:
            raise failed
        if any(o.finish_reason == "abort" for o in outs):
            raise APIError(503, "the request was aborted: the server is shutting down",
                           type="server_error", code="aborted")
        return JSONResponse(_body(job, outs))
    finally:
        loop.abort(job.request_ids)


def _engine_error(out: RequestOutput) -> APIError | None:
    """A 500 carrying ``out.error`` if the engine ended this request because it failed
    (e.g. non-finite logits), else None. An abort without an error is a shutdown or a
    client abort, not a failure."""
    if out.finish_reason != "abort" or not out.error:
        return None
    return APIError(500, f"the engine failed this request: {out.error}", type="server_error",
                    code="engine_error")


async def _collect(job: Job) -> list[RequestOutput]:
    outs: list[RequestOutput | None] = [None] * len(job.request_ids)
    left = len(outs)
    while left:
        for tag, out in (await job.sink.get_batch()).items():
            if isinstance(out, BaseException):
                raise APIError(503, "the engine failed", type="server_error", code="engine_unavailable")
            if out.finished and outs[tag] is None:
                outs[tag], left = job.shown(out), left - 1
    return outs  # type: ignore[return-value]


async def _until_disconnect(request: Request, coro):
    """Run ``coro``; return its result, or None (cancelling it) if the client disconnects."""
    task = asyncio.ensure_future(coro)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def _body(job: Job, outs: list[RequestOutput]) -> dict:
    choices = []
    for i, o in enumerate(outs):
        ids, lps = o.token_ids, o.logprobs or []
        if job.chat:
            lp = R.chat_logprobs(ids, lps, job.req.top_logprobs, job.token_text) \
                if job.req.top_logprobs is not None else None
            choices.append({"index": i, "message": {"role": "assistant", "content": o.text},
                            "logprobs": lp, "finish_reason": o.finish_reason})
        else:
            st = R.ChoiceState()
            prefix, echo_lp = _echo(job, st, o)
            lp = None
            if job.req.params.logprobs is not None:
                lp = R.join_logprobs(echo_lp + [R.completion_logprobs(ids, lps, job.token_text, st,
                                                                       job.req.params.skip_special_tokens)])
            choices.append({"index": i, "text": prefix + o.text, "logprobs": lp, "finish_reason": o.finish_reason})
    make = R.chat_body if job.chat else R.completion_body
    return make(job.rid, job.created, job.model, choices, outs, job.req.n)


# ---- streaming -----------------------------------------------------------------------
class AbortingStream(StreamingResponse):
    """A StreamingResponse that aborts its engine requests however it ends, even when the
    client is gone before the body iterator ever starts."""

    def __init__(self, loop: EngineLoop, job: Job) -> None:
        super().__init__(_events(job), media_type="text/event-stream", headers=SSE_HEADERS)
        self._loop, self._job = loop, job

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._loop.abort(self._job.request_ids)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'), ensure_ascii=False)}\n\n"


async def _events(job: Job) -> AsyncIterator[str]:
    k = len(job.request_ids)
    states = [R.ChoiceState() for _ in range(k)]
    if job.chat:
        for i in range(k):
            yield _sse(R.chat_chunk(job.rid, job.created, job.model, i, {"role": "assistant", "content": ""},
                                    None, None))
    left = k
    while left:
        latest = await job.sink.get_batch()  # a slow client gets fewer, larger deltas
        for tag, out in latest.items():
            if isinstance(out, BaseException):
                yield _sse(APIError(503, "the engine failed", type="server_error", code="engine_unavailable").body())
                yield "data: [DONE]\n\n"
                return
            if states[tag].last is not None and states[tag].last.finished:
                continue
            if (failed := _engine_error(out)) is not None:  # an error event, not a silent abort
                yield _sse(failed.body())
                yield "data: [DONE]\n\n"
                return
            chunk = _chunk(job, tag, states[tag], out)
            if chunk is not None:
                yield _sse(chunk)
            left -= out.finished
    if job.req.include_usage:
        obj = "chat.completion.chunk" if job.chat else "text_completion"
        yield _sse(R.usage_chunk(job.rid, job.created, job.model, obj, [s.last for s in states], job.req.n))
    yield "data: [DONE]\n\n"


def _echo(job: Job, st: R.ChoiceState, out: RequestOutput) -> tuple[str, list[dict]]:
    """Under ``echo``, once per choice: the prompt's text and (with ``logprobs``) its
    logprobs part; else ``("", [])``."""
    if not job.echo or st.echoed:
        return "", []
    st.echoed = True
    text = R.prompt_text(out, job.token_text.tokenizer)
    st.base = len(text)
    return text, ([R.echo_logprobs(out, job.token_text)] if job.req.params.logprobs is not None else [])


def _chunk(job: Job, tag: int, st: R.ChoiceState, out: RequestOutput) -> dict | None:
    out = job.shown(out)
    text = st.delta(out)
    reason = R.finish_reason(out)
    want_lp = job.req.top_logprobs is not None if job.chat else job.req.params.logprobs is not None
    ids, lps = st.new_tokens(out)
    if job.chat:
        if not text and reason is None and not (want_lp and ids):
            return None
        lp = R.chat_logprobs(ids, lps, job.req.top_logprobs, job.token_text) if want_lp else None
        delta = {"content": text} if text or reason is None else {}
        return R.chat_chunk(job.rid, job.created, job.model, tag, delta, lp, reason)
    prefix, echo_lp = _echo(job, st, out)
    if not prefix and not text and reason is None and not (want_lp and ids):
        return None
    lp = R.join_logprobs(echo_lp + [R.completion_logprobs(ids, lps, job.token_text, st,
                                                           job.req.params.skip_special_tokens)]) if want_lp else None
    return R.completion_chunk(job.rid, job.created, job.model, tag, prefix + text, lp, reason)
