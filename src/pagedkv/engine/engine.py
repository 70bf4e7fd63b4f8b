"""LLMEngine: requests in, streamed RequestOutputs out, one ``step()`` at a time.

``add_request`` validates and rejects at once what can never run (longer than
``max_model_len``, or needing more pages than the whole cache); ``step`` schedules,
runs the model on the paged cache, samples, applies stop rules and frees finished
requests' pages. One bad request raises in ``add_request`` and leaves the others alone.
"""

from __future__ import annotations

import itertools
import operator
import time

import torch

from pagedkv.config import EngineConfig
from pagedkv.engine.outputs import RequestOutput, find_stop, hold_back, make_output
from pagedkv.engine.request import Request
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.setup import EngineParts, build_parts
from pagedkv.engine.stats import EngineStats, collect_stats


class LLMEngine:
    """The engine loop around one model and one paged KV cache.

    Raises (constructor):
        FileNotFoundError / ValueError: model not found or unsupported; bad config.
    """

    def __init__(self, config: EngineConfig | None = None, **kwargs) -> None:
        self.config = config or EngineConfig(**kwargs)
        parts: EngineParts = build_parts(self.config)
        self.parts = parts
        self.model, self.tokenizer, self.kv = parts.model, parts.tokenizer, parts.kv
        self.max_model_len, self.eos_token_ids = parts.max_model_len, parts.eos_token_ids
        self.scheduler = Scheduler(self.kv, self.config.max_num_seqs, self.config.max_num_batched_tokens)
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self.runner = ModelRunner(self.model, parts.storage, self.kv, self.generator)
        self.requests: dict[str, Request] = {}
        self._ended: dict[str, Request] = {}   # recently aborted, for final_output
        self._ids = itertools.count()
        self.peak_blocks_used = 0
        self.num_generated_tokens = 0
        self.num_rejected = 0

    # ---- requests -------------------------------------------------------------------
    def tokenize(self, prompt) -> tuple[list[int], str | None]:
        """Token ids of a prompt: a string (tokenized with the tokenizer's special tokens,
        e.g. a BOS, as HF and vLLM do), ``{"prompt_token_ids": [...]}`` or ``{"prompt": str}``.

        Raises:
            ValueError: any other shape, non-integer ids, or text the tokenizer rejects.
        """
        if isinstance(prompt, str):
            try:
                return self.tokenizer(prompt, add_special_tokens=True).input_ids, prompt
            except (TypeError, UnicodeError) as e:
                raise ValueError(f"the prompt is not valid text ({type(e).__name__})") from None
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return _int_list(prompt["prompt_token_ids"]), prompt.get("prompt")
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return self.tokenize(prompt["prompt"])
        raise ValueError("a prompt is a string or a dict with 'prompt_token_ids' or 'prompt'")

    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    cache_salt: str | None = None) -> Request:
        """Queue a request.

        Raises:
            ValueError: empty prompt, token ids outside the vocabulary, a duplicate id,
                or a request that can never fit (the message names the numbers).
        """
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        try:
            if not isinstance(params or SamplingParams(), SamplingParams):
                raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
            params = params or SamplingParams()
            ids, text = self.tokenize(prompt)
            self._validate(rid, ids)
            max_tokens = self._resolve_max_tokens(len(ids), params)
        except ValueError:
            self.num_rejected += 1
            raise
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            cache_salt = str(prompt["cache_salt"])  # vLLM's per-prompt salt
        req = Request(rid, ids, params, prompt=text, cache_salt=cache_salt)
        req.max_tokens = max_tokens
        self.requests[rid] = req
        self.scheduler.add(req)
        return req

    def _validate(self, rid: str, ids: list[int]) -> None:
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        vocab = self.model.embed.shape[0]
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")

    def _resolve_max_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        """Output tokens this request may make; rejects what could never fit."""
        cache_tokens = self.kv.pool.num_blocks * self.kv.block_size
        limit = f"max_model_len ({self.max_model_len}" + (
            f", the whole KV cache: {self.kv.pool.num_blocks} blocks of {self.kv.block_size})"
            if self.max_model_len == cache_tokens else ")")
        if num_prompt >= self.max_model_len:
            raise ValueError(f"prompt of {num_prompt} tokens leaves no room for output: limit is {limit}")
        max_tokens = params.max_tokens or self.max_model_len - num_prompt
        total = num_prompt + max_tokens
        if total > self.max_model_len:
            raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {total} "
                             f"exceeds {limit}")
        blocks, pool = -(-total // self.kv.block_size), self.kv.pool.num_blocks
        if blocks > pool:
            raise ValueError(f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs {blocks} "
                             f"KV blocks of {self.kv.block_size} tokens, but the whole cache has {pool}")
        return max_tokens

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a queued or running request and free its pages; unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.finish(req, "abort")
        self._ended[request_id] = req
        while len(self._ended) > 1024:  # keep only recent ones
            self._ended.pop(next(iter(self._ended)))
        return make_output(req, self._text(req))

    def final_output(self, request_id: str) -> RequestOutput | None:
        """Output of a request that ended outside ``step`` (aborted), if known."""
        req = self._ended.get(request_id)
        return make_output(req, self._text(req)) if req is not None else None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the loop -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that produced a token."""
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return []
        try:
            sampled = self.runner.execute(sched)
        except Exception:
            # the step's KV writes are incomplete: end its requests rather than leave the
            # engine stuck on them, then let the caller see the error
            for s in sched.scheduled:
                self.requests.pop(s.request.request_id, None)
                self.scheduler.finish(s.request, "abort")
            raise
        self.scheduler.update(sched)
        self.peak_blocks_used = max(self.peak_blocks_used, self.kv.pool.num_used)
        now = time.perf_counter()
        outputs = []
        for s in sched.scheduled:
            req = s.request
            tok = sampled.get(req.request_id)
            if tok is None:
                continue
            if tok.error is not None:  # this request alone failed to sample
                req.error = tok.error
                self.scheduler.finish(req, "abort")
                self.requests.pop(req.request_id, None)
                outputs.append(make_output(req, self._text(req)))
                continue
            req.append_token(tok.token_id, now)
            if tok.logprobs is not None:
                req.logprobs.append(tok.logprobs)
            self.num_generated_tokens += 1
            outputs.append(self._process(req))
        if self.config.debug_invariants:
            self.kv.check_invariants()
        return outputs

    def _process(self, req: Request) -> RequestOutput:
        """Apply the stop rules after a new token; finish and free the request if one hits."""
        p, tok = req.sampling_params, req.output_token_ids[-1]
        text = self._text(req)
        reason = None
        if tok in p.stop_token_ids:  # the stop token is in token_ids, not in the text
            reason, req.stop_reason = "stop", tok
            text = self._text(req, exclude_last=True)
        elif tok in self.eos_token_ids and not p.ignore_eos:
            reason = "stop"
        elif p.stop and (hit := find_stop(text, p.stop)):
            reason, req.stop_reason, text = "stop", hit[1], text[:hit[0]]
        elif len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason:
            self.scheduler.finish(req, reason)
            self.requests.pop(req.request_id, None)
        elif p.stop:
            text = hold_back(text, p.stop)
        return make_output(req, text)

    def _text(self, req: Request, exclude_last: bool = False) -> str:
        ids = req.output_token_ids[:-1] if exclude_last else req.output_token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=req.sampling_params.skip_special_tokens)

    # ---- introspection -------------------------------------------------------------
    def stats(self) -> EngineStats:
        return collect_stats(self)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block (in-use blocks stay, unpublished). Returns the count."""
        return self.kv.reset_prefix_cache()


def _int_list(ids) -> list[int]:
    """Token ids as plain ints (numpy and torch integers are accepted).

    Raises:
        ValueError: if ``ids`` is not a sequence of integers.
    """
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}")
    try:
        return [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError("prompt_token_ids must be a list of integers") from None
