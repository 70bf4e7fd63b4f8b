"""LLM: the offline facade, shaped after vLLM's ``LLM`` class.

    llm = LLM()   # smollm2-135m-instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    llm.chat([{"role": "user", "content": "Hi"}])
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Callable, Sequence

from pagedkv.config.engine import EngineConfig
from pagedkv.core.sampling_params import SamplingParams
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.outputs import RequestOutput

Prompt = str | dict


class LLM:
    """A model on a paged KV cache. Keyword arguments are :class:`EngineConfig` fields.

    Raises:
        TypeError: for an unknown keyword argument.
        FileNotFoundError / ValueError: as :class:`LLMEngine`.
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        unknown = set(engine_args) - EngineConfig.field_names()
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        if model is not None:
            engine_args["model"] = model
        self.engine = LLMEngine(EngineConfig(**engine_args))

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 on_output: Callable[[RequestOutput], None] | None = None,
                 cache_salt: str | None = None, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        A prompt is a string or ``{"prompt_token_ids": [...]}`` (a ``"prompt"`` text beside the
        ids is only echoed back as the output's ``prompt``, not tokenized). ``sampling_params`` is one
        for all or one per prompt. ``on_output`` sees each request's output when it finishes.
        ``priority``: one per prompt, used with ``scheduling_policy="priority"`` (lower first).

        With ``SamplingParams(n=k)`` a prompt runs as k requests (``on_output`` sees each, with
        its ``index``); its output is the first sample's, with all k in ``.outputs``.

        Raises:
            ValueError: if any prompt is invalid or can never fit (naming its index and the
                numbers); then no prompt of this call is run.
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif hasattr(prompts, "__iter__"):
            prompts = list(prompts)  # (a generator is read once)
        ids = self.add_requests(prompts, sampling_params, cache_salt, priority)
        counts = [sp.n if isinstance(sp, SamplingParams) else 1  # (checked by add_requests; None: defaults)
                  for sp in self._params_list(sampling_params, len(prompts))]
        ends = list(itertools.accumulate(counts))
        groups = [ids[end - n:end] for n, end in zip(counts, ends)]  # each prompt's samples' ids, in order
        index = {rid: j for group in groups for j, rid in enumerate(group)}
        shown = None if on_output is None else (lambda o: on_output(replace(o, index=index[o.request_id])))
        outs = dict(zip(ids, self.run(ids, shown)))
        return [_choices([outs[rid] for rid in group]) for group in groups]

    def add_requests(self, prompts: Prompt | Sequence[Prompt],
                     sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                     cache_salt: str | None = None, priority: Sequence[int] | None = None) -> list[str]:
        """Queue every prompt, or none: on the first invalid one, abort those already queued.
        A prompt whose ``SamplingParams.n`` is k > 1 is queued as k requests (choice j with
        ``seed + j`` when seeded): their ids follow each other in the list.

        Raises:
            ValueError: naming the prompt's index and the reason, or a ``priority`` list
                whose length is not the number of prompts.
        """
        if not isinstance(prompts, (str, dict)) and not hasattr(prompts, "__iter__"):
            raise ValueError(f"prompts must be a string, a dict or an iterable of them, got {type(prompts).__name__}")
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params = self._params_list(sampling_params, len(prompts))
        if priority is not None and (isinstance(priority, (str, bytes)) or not hasattr(priority, "__iter__")):
            raise ValueError(f"priority must be a list of integers, one per prompt, got {type(priority).__name__}")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        return self._add_all(prompts, params, cache_salt, priority)

    def run(self, request_ids: list[str],
            on_output: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Step the engine until every one of ``request_ids`` has ended; their final
        outputs, in order. ``on_output`` sees each of them (and no other request) as it ends.

        Other requests in the engine make progress in the same steps but are not run to the
        end. If this call exits with an exception (``on_output`` raised, Ctrl-C, a failed
        step), its own unfinished requests are aborted, so none keeps KV pages. Requests
        that end outside this call's steps (aborted from ``on_output``, or finished in a
        nested ``generate`` it started) reach ``on_output`` too.

        Raises:
            ValueError: ``request_ids`` is not a list of ids of requests in the engine.
        """
        if isinstance(request_ids, str) or not isinstance(request_ids, (list, tuple)):
            raise ValueError(f"request_ids must be a list of request ids, got {type(request_ids).__name__}")
        unknown = [r for r in request_ids if not self.engine.is_known(r)]
        if unknown:
            raise ValueError(f"unknown request id(s): {', '.join(map(repr, unknown[:5]))}")
        own, results = list(request_ids), {}
        pending = set(own)
        self.engine.keep_final_outputs(own)  # an abort outside step() must not be forgotten
        try:
            while pending and self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        results[out.request_id] = out
                        if on_output:
                            on_output(out)
                for rid in self._ended_outside_step(pending, results):
                    pending.discard(rid)
                    if on_output:
                        on_output(results[rid])
        finally:
            for rid in pending:
                self.engine.abort_request(rid)
            self._ended_outside_step(pending, results)
            self.engine.release_final_outputs(own)
        return [results.get(i) for i in own]

    def _ended_outside_step(self, pending: set[str], results: dict) -> set[str]:
        """Ids of ``pending`` that ended without a step output (aborted, e.g. from
        ``on_output``); their final outputs go into ``results``."""
        ended = {rid for rid in pending if rid not in self.engine.requests}
        for rid in ended:
            results[rid] = self.engine.final_output(rid)
        return ended

    def _add_all(self, prompts, params, cache_salt, priority) -> list[str]:
        ids: list[str] = []
        try:
            for i, (p, sp, prio) in enumerate(zip(prompts, params, priority)):
                try:
                    for one in _samples(sp):
                        ids.append(self.engine.add_request(p, one, cache_salt=cache_salt, priority=prio).request_id)
                except (ValueError, TypeError) as e:
                    raise type(e)(f"prompt {i}: {e}") from None
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return ids

    @staticmethod
    def _params_list(sp, n: int) -> list[SamplingParams]:
        if sp is None or isinstance(sp, SamplingParams):
            return [sp or SamplingParams()] * n
        if not isinstance(sp, (list, tuple)):
            raise ValueError("sampling_params must be a SamplingParams or a list of them, one per prompt")
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} SamplingParams for {n} prompts")
        return list(sp)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None, **kwargs) -> list[RequestOutput]:
        """Apply the model's chat template (with the generation prompt) and generate.
        ``messages`` is one conversation or a list of them."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of messages (or of conversations)")
        convs = [messages] if isinstance(messages[0], dict) else messages
        return self.generate([self.chat_prompt(c) for c in convs], sampling_params, **kwargs)

    def chat_prompt(self, messages: list[dict]) -> dict:
        """``{"prompt_token_ids", "prompt"}`` of one conversation under the chat template.

        A message's content is a string, ``None`` (empty) or, as in OpenAI's API, a list of
        ``{"type": "text", "text": str}`` parts (joined). Roles and other keys go to the
        template as given (the server allows OpenAI's roles only).

        Raises:
            ValueError: a message that is not ``{"role": str, "content": ...}``, text that is
                not valid Unicode (e.g. a lone surrogate), or a model without a chat template.
        """
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise ValueError('messages must be a non-empty list of {"role": str, "content": str}')
        messages = [{**m, "role": _valid_text(m["role"], "role"),
                     "content": _content_text(m["content"] if "content" in m else ...)}
                    for m in messages]
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template")
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001 - jinja2 template errors
            raise ValueError(f"the chat template failed: {e}") from None
        ids = tok(text, add_special_tokens=False).input_ids
        return {"prompt_token_ids": list(ids), "prompt": text}

    def reset_prefix_cache(self) -> int:
        return self.engine.reset_prefix_cache()

    def close(self) -> None:
        """See :meth:`LLMEngine.close`: finishes the KV tiers' writes, releases ``kv_offload_dir``."""
        self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self):
        return self.engine.stats()


def _samples(sp) -> list:
    """``sp`` as the requests of its ``n`` samples: n = 1 each, choice j seeded ``seed + j``."""
    if not isinstance(sp, SamplingParams) or sp.n == 1:
        return [sp]  # (the engine names a wrong type)
    return [replace(sp, n=1, seed=None if sp.seed is None else sp.seed + j) for j in range(sp.n)]


def _choices(outs: list[RequestOutput | None]) -> RequestOutput | None:
    """A prompt's output from its samples' outputs: the first, with each one's ``index`` and,
    when there are several, all of them in ``choices``."""
    group = [o if o is None else replace(o, index=j) for j, o in enumerate(outs)]
    if len(group) > 1 and group[0] is not None:
        group[0].choices = group
    return group[0]


def _content_text(content) -> str:
    """A chat message's text: a string, or the joined texts of ``{"type": "text"}`` parts.

    Raises:
        ValueError: any other shape, or text with a lone surrogate (not valid Unicode).
    """
    if content is None:  # OpenAI's shape for e.g. an assistant turn without text, as the server
        return ""           # (a missing content, passed as ..., is refused below)
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ValueError('messages: each content is a string or a list of {"type": "text", "text": str} parts')
    return _valid_text(content, "content")


def _valid_text(text: str, what: str) -> str:
    """``text`` if it is valid Unicode. Raises ValueError (e.g. a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"messages: a {what} is not valid Unicode (a lone surrogate?)") from None
    return text
