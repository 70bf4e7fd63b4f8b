"""LLMEngine: the text side around an EngineCore; prompts in, streamed RequestOutputs out.

``add_request`` tokenizes, validates and rejects at once what can never run (longer than
``max_model_len``, or needing more pages than the whole cache), then hands token ids to
the core. ``step`` runs one core step and turns its token ids into text: incremental
detokenization, stop strings (the core applies the id-based stop rules). One bad request
raises in ``add_request`` and leaves the others alone.
"""

from __future__ import annotations

import itertools
import operator
import warnings

from pagedkv.config.engine import SCORED_EVICTIONS, EngineConfig
from pagedkv.connectors.base import KVConnector
from pagedkv.connectors.offload.disk_records import check_directory_free
from pagedkv.core.admission import resolve_max_tokens
from pagedkv.core.core_output import EngineCoreOutput
from pagedkv.core.limits import step_tokens
from pagedkv.core.request import Request
from pagedkv.core.sampling_params import SamplingParams
from pagedkv.distributed.executor import TPExecutor
from pagedkv.distributed.group import tp_env_rank
from pagedkv.engine.build import build_connector, build_engine_core, start_tensor_parallel
from pagedkv.engine.outputs import RequestOutput, TextRequest
from pagedkv.engine.parts import EngineParts, build_parts
from pagedkv.engine.stats import EngineStats, collect_stats
from pagedkv.reprs import brief

ENDED_KEPT = 1024  # recently ended requests whose final output ``final_output`` can still give


class LLMEngine:
    """The engine loop around one model and one paged KV cache.

    Args:
        config: the engine settings (or pass its fields as keywords).
        kv_connector: a KV connector (:mod:`pagedkv.connectors.base`) to load and save pages
            elsewhere, or None.

    Raises (constructor):
        FileNotFoundError / ValueError: model not found or unsupported; bad config.
    """

    def __init__(self, config: EngineConfig | None = None, kv_connector: KVConnector | None = None,
                 **kwargs) -> None:
        self.config = config or EngineConfig(**kwargs)
        if self.config.tensor_parallel_size > 1 and kv_connector is not None:
            raise ValueError("a kv_connector cannot be combined with tensor_parallel_size > 1 yet")
        if self.config.tensor_parallel_size == 1 and tp_env_rank() is not None:
            warnings.warn("pagedkv: torchrun started several ranks but tensor_parallel_size is 1: every rank runs "
                          "an engine of its own (pass --tensor-parallel-size to split the model)", RuntimeWarning,
                          stacklevel=2)
        if self.config.kv_offload_dir and self.config.kv_offload_memory:
            check_directory_free(self.config.kv_offload_dir)  # before minutes of loading, not after
        tp = start_tensor_parallel(self.config)
        try:
            self.parts: EngineParts = build_parts(self.config, tp.group if tp else None)
            self.connector = build_connector(self.config, self.parts, kv_connector)  # both sides, or None
            self.core = build_engine_core(self.config, self.parts, self.connector, tp)
        except BaseException:
            if tp is not None:  # the workers wait for rank 0: stop them
                tp.close()
            raise
        self.model, self.tokenizer, self.kv_manager = self.parts.model, self.parts.tokenizer, self.parts.kv_manager
        self.max_model_len, self.eos_token_ids = self.parts.max_model_len, self.parts.eos_token_ids
        self._texts: dict[str, TextRequest] = {}
        self._ended: dict[str, TextRequest] = {}   # recently ended, for final_output
        self._kept: dict[str, TextRequest | None] = {}  # ended records kept past the cap, by id
        self._ids = itertools.count()
        self.num_generated_tokens = 0
        self.num_rejected = 0

    # the parts, by their usual names
    scheduler = property(lambda self: self.core.scheduler)
    runner = property(lambda self: self.core.runner)
    requests = property(lambda self: self.core.scheduler.requests, doc="live requests by id")
    peak_blocks_used = property(lambda self: self.core.peak_blocks_used)
    kv_cache = property(lambda self: self.parts.kv_cache, doc="the page tensors (KVCacheStorage)")
    model_files = property(lambda self: self.parts.files, doc="the model's files (folder, config, GGUF)")
    kv_spec = property(lambda self: self.parts.kv_spec, doc="the target model's KV spec (bytes per token, page)")

    @property
    def vocab_size(self) -> int:
        """Token ids the model takes: ``[0, vocab_size)``."""
        return self.model.embed.shape[0]

    @property
    def capacity_tokens(self) -> int:
        """Tokens the whole KV pool holds (blocks x block size; a window group's pages count once)."""
        return self.kv_manager.pool.num_blocks * self.kv_manager.block_size

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
                    cache_salt: str | None = None, arrival_time: float | None = None,
                    priority: int = 0) -> Request:
        """Queue a request; ``arrival_time`` (the core clock's seconds) defaults to now;
        ``priority`` orders admission under ``scheduling_policy="priority"`` (lower first).

        Raises:
            ValueError: empty prompt, token ids outside the vocabulary, a duplicate id, a
                ``cache_salt`` that is not a non-empty string, or a request that can never fit
                (the message names the numbers).
        """
        rid = request_id if request_id is not None else self._new_id()
        try:
            if not isinstance(rid, str) or not rid:
                raise ValueError(f"a request id is a non-empty string, got {brief(rid)}")
            if not isinstance(priority, int) or isinstance(priority, bool):
                raise ValueError(f"priority must be an integer, got {brief(priority)}")
            if not isinstance(params or SamplingParams(), SamplingParams):
                raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
            params = params or SamplingParams()
            if params.n != 1:
                raise ValueError(f"n={params.n}: LLMEngine.add_request runs one sample; LLM.generate runs n "
                                 "requests (or add n, with seed + j for choice j)")
            if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
                cache_salt = prompt["cache_salt"]  # vLLM's per-prompt salt
            if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt
                                           or not _is_unicode(cache_salt)):
                raise ValueError(f"cache_salt must be a non-empty string of valid Unicode, got {brief(cache_salt)}")
            ids, text = self.tokenize(prompt)
            self._validate(rid, ids, params)
            max_tokens = self._resolve_max_tokens(len(ids), params)
        except ValueError:
            self.num_rejected += 1
            self.release_transfer(params)
            raise
        req = Request(rid, ids, params, cache_salt=cache_salt, max_tokens=max_tokens, arrival_time=arrival_time,
                      priority=priority)
        self.core.add_request(req)
        self._texts[rid] = TextRequest(rid, text, ids, params, req.arrival_time, self.tokenizer)
        return req

    def release_transfer(self, params) -> None:
        """A decode leg that will not run (refused, or not added with its batch): the producer
        frees its lease now (:meth:`release_kv_transfer`). ``params``: the leg's SamplingParams,
        or None to send only what is pending (the releases of requests aborted just before)."""
        self.release_kv_transfer(params.kv_transfer_params if isinstance(params, SamplingParams) else None)

    def release_kv_transfer(self, kv_transfer_params: dict | None) -> None:
        """The request carrying ``kv_transfer_params`` (a decode leg's ``do_remote_prefill``
        and ``transfer_id``) was refused before it reached the scheduler: tell the producer
        now, in a step that computes nothing, rather than leaving its pages leased for
        ``kv_lease_s``. No-op without a connector, or with nothing to release."""
        connector = self.scheduler.connector
        if connector is None:
            return
        if isinstance(kv_transfer_params, dict):
            connector.reject(kv_transfer_params)
        if connector.has_pending_releases():
            self.core.connector_step()

    def _new_id(self) -> str:
        """``req-N`` for the next N not in use (a caller may have used such an id itself)."""
        while self.core.scheduler.is_id_in_use(rid := f"req-{next(self._ids)}"):
            pass
        return rid

    def _validate(self, rid: str, ids: list[int], params: SamplingParams) -> None:
        if self.core.scheduler.is_id_in_use(rid):
            raise ValueError(f"request id {rid!r} is already in use")
        if not ids:
            raise ValueError("the prompt is empty (0 tokens)")
        vocab = self.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab})")
        if params.kv_budget_tokens is not None:
            c = self.config
            if c.kv_eviction not in SCORED_EVICTIONS:
                raise ValueError("kv_budget_tokens needs an engine with snapkv or h2o eviction "
                                 "(--kv-eviction snapkv|h2o)")
            if params.kv_budget_tokens < c.num_sink_tokens + c.kv_window_tokens:
                raise ValueError(f"kv_budget_tokens {params.kv_budget_tokens} is under the engine's sinks + window "
                                 f"({c.num_sink_tokens} + {c.kv_window_tokens} tokens)")

    def _resolve_max_tokens(self, num_prompt: int, params: SamplingParams) -> int:
        """Output tokens this request may make; rejects what could never fit."""
        return resolve_max_tokens(self.kv_manager, self.max_model_len, step_tokens(self.config), num_prompt, params,
                                  self.config.kv_eviction == "streaming", self.scheduler.eviction)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort a queued or running request and free its pages; unknown ids are ignored."""
        outs = self.core.abort_requests([request_id])
        return self._process(outs[0]) if outs else None

    def final_output(self, request_id: str) -> RequestOutput | None:
        """Output of a recently ended request (e.g. aborted outside ``step``), if known:
        the last ``ENDED_KEPT`` ended ones, and any whose ids are kept."""
        t = self._kept.get(request_id) or self._ended.get(request_id)
        return t.output() if t is not None else None

    def is_known(self, request_id) -> bool:
        """Whether ``request_id`` is queued, running, or recently ended (its output kept)."""
        return isinstance(request_id, str) and (
            request_id in self.requests or request_id in self._ended or request_id in self._kept)

    def keep_final_outputs(self, request_ids) -> None:
        """Keep the final outputs of ``request_ids`` for ``final_output`` however many other
        requests end, until ``release_final_outputs``."""
        for rid in request_ids:
            self._kept.setdefault(rid, self._ended.get(rid))

    def release_final_outputs(self, request_ids) -> None:
        for rid in request_ids:
            self._kept.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # ---- the loop -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that produced a token.
        If the model fails, the step's requests end (``abort``) and the error propagates."""
        try:
            core_outputs = self.core.step()
        except Exception:
            for o in self.core.failed_outputs:  # they end as "abort" with the error
                self._process(o)
            raise
        return [self._process(o) for o in core_outputs]

    def _process(self, out: EngineCoreOutput) -> RequestOutput:
        """Apply a core output to the request's text: detokenize, then stop strings."""
        t = self._texts[out.request_id]
        before = len(t.token_ids)
        cut = t.apply(out)
        self.num_generated_tokens += len(t.token_ids) - before
        if (cut or t.stop_string_hit()) and not out.finished:
            self.core.abort_requests([out.request_id], reason="stop")
        if t.finished:
            self._end(t)
        return t.output()

    def _end(self, t: TextRequest) -> None:
        self._texts.pop(t.request_id, None)
        self._ended[t.request_id] = t
        if t.request_id in self._kept:
            self._kept[t.request_id] = t
        while len(self._ended) > ENDED_KEPT:
            self._ended.pop(next(iter(self._ended)))

    # ---- introspection -------------------------------------------------------------
    def stats(self) -> EngineStats:
        return collect_stats(self)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix block (in-use blocks stay, unpublished). Returns the count."""
        return self.kv_manager.reset_prefix_cache()

    def check_health(self) -> None:
        """Raise if the engine cannot step again (a tensor-parallel rank was lost:
        :class:`~pagedkv.distributed.executor.TPGroupError`); else nothing."""
        if isinstance(self.runner, TPExecutor):
            self.runner.check_health()

    def close(self) -> None:
        """Finish what the KV connector has in flight (disk writes) and release what it holds
        (the ``--kv-offload-dir`` lock), so another engine can open it. Idempotent; the
        engine may still step afterwards, its disk tier no longer written. Tensor-parallel
        workers stop here, and such an engine cannot step after."""
        if isinstance(self.runner, TPExecutor):
            self.runner.close()
        if self.connector is not None:
            self.core.connector_step()  # plan and start the disk writes still owed
            self.connector.worker.close()  # wait for them; release the directory
            self.core.connector_step()  # report them: counters, pins


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def _int_list(ids) -> list[int]:
    """Token ids as plain ints (numpy and torch integers are accepted).

    Raises:
        ValueError: if ``ids`` is not a sequence of integers (a set, dict or generator is not).
    """
    if isinstance(ids, (str, bytes, dict, set, frozenset)) or not hasattr(ids, "__len__"):
        raise ValueError(f"prompt_token_ids must be a list of integers, got {type(ids).__name__}")
    ids = list(ids)
    if any(isinstance(t, bool) for t in ids):
        raise ValueError("prompt_token_ids must be a list of integers, not booleans")
    try:
        return [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError("prompt_token_ids must be a list of integers") from None
