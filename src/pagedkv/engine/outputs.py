"""RequestOutput and the text side of a request: detokenization and stop strings."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.core.core_output import EngineCoreOutput
from pagedkv.core.sampling_params import SamplingParams
from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.stop_strings import PartialStopTracker, find_stop


@dataclass
class RequestOutput:
    """What a request has produced so far (cumulative), or in full once ``finished``.

    Timings are seconds: ``ttft`` arrival -> first token; ``tpot`` mean time per output
    token after the first; ``e2e`` arrival -> last token. ``num_cached_tokens`` is the
    prompt prefix served from the prefix cache. ``error`` says why a request that ended
    with ``finish_reason == "abort"`` failed (e.g. non-finite logits), else None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    error: str | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None  # per prompt position; None at 0
    prompt_top_logprobs: list[dict[int, float] | None] | None = None  # top-k per position (prompt_logprobs=k>0)
    token_times: list[float] = field(default_factory=list, repr=False)
    index: int = 0  # which of the prompt's n samples (SamplingParams.n) this is
    choices: list[RequestOutput] | None = field(default=None, repr=False)  # all n, set on the first by LLM

    @property
    def outputs(self) -> list[RequestOutput]:
        """The prompt's samples, as vLLM's ``RequestOutput.outputs`` (each has ``index``,
        ``text``, ``token_ids``, ``logprobs``, ``finish_reason``, ``stop_reason``): all n
        from ``LLM.generate`` with ``SamplingParams(n=...)``, else this output alone."""
        return self.choices or [self]


class TextRequest:
    """The text side's record of one request, built from the core's outputs."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, arrival_time: float, tokenizer) -> None:
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.params, self.arrival_time = params, arrival_time
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] = []
        self.token_times: list[float] = []
        self.prompt_logprobs: dict[int, float] = {}
        self.prompt_top_logprobs: dict[int, dict[int, float]] = {}
        self.finish_reason = self.stop_reason = self.error = None
        self.num_cached_tokens = self.num_preemptions = 0
        self._stop_text: str | None = None   # text cut at a stop string
        self._searched = 0                   # stop strings were looked for up to here
        self._partial = PartialStopTracker(params.stop) if params.stop else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def apply(self, out: EngineCoreOutput) -> bool:
        """Append the core's news. The text of a token that stopped the request (EOS or
        a stop token id) is left out, as vLLM does; at the end the text is the full decode.
        Several tokens at once (speculative decoding) are taken one by one: a stop string
        completed by one of them ends the request there, the rest are dropped, exactly as
        one token per step would. Returns whether that happened."""
        n, cut = len(out.new_token_ids), False
        for i, tok in enumerate(out.new_token_ids):
            self.token_ids.append(tok)
            self.token_times.append(out.token_time)
            if i < len(out.new_logprobs):
                self.logprobs.append(out.new_logprobs[i])
            # the core stops with "stop" on EOS or a stop token id: that token's text is left out
            if not (i == n - 1 and out.finish_reason == "stop"):
                self.detok.push(tok)
            if i < n - 1 and self.params.stop and self.stop_string_hit():
                cut = True
                break
        if out.finished or cut:
            self.detok.finish()
        if out.prompt_logprobs is not None:
            self.prompt_logprobs, self.prompt_top_logprobs = out.prompt_logprobs, out.prompt_top_logprobs or {}
        self.num_cached_tokens, self.num_preemptions = out.num_cached_tokens, out.num_preemptions
        if out.finished and not self.finished:
            self.finish_reason, self.stop_reason, self.error = out.finish_reason, out.stop_reason, out.error
        return cut

    def stop_string_hit(self) -> bool:
        """If a stop string now appears (and no id-based stop came first), finish with
        ``stop`` and cut the text before it. Returns whether it did."""
        stops = self.params.stop
        if not stops or self.finish_reason not in (None, "length") or self._stop_text is not None:
            return False
        text = self.detok.text
        hit = find_stop(text, stops, max(0, self._searched - max(map(len, stops)) + 1))
        self._searched = len(text)
        if hit is None:
            return False
        self.finish_reason, self.stop_reason, self._stop_text = "stop", hit[1], text[:hit[0]]
        return True

    def visible_text(self) -> str:
        if self._stop_text is not None:
            return self._stop_text
        text = self.detok.text
        if self._partial is None or self.finished:
            return text
        self._partial.feed(text)
        return text[:len(text) - self._partial.held()]

    def output(self) -> RequestOutput:
        ttft = tpot = e2e = None
        if self.token_times:
            first, last, n = self.token_times[0], self.token_times[-1], len(self.token_ids)
            ttft, e2e = first - self.arrival_time, last - self.arrival_time
            tpot = (last - first) / (n - 1) if n > 1 else 0.0
        p, n_prompt = self.params, len(self.prompt_token_ids)
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            text=self.visible_text(), token_ids=list(self.token_ids), finished=self.finished,
            finish_reason=self.finish_reason, num_prompt_tokens=n_prompt,
            num_cached_tokens=self.num_cached_tokens, num_preemptions=self.num_preemptions,
            stop_reason=self.stop_reason, error=self.error, ttft=ttft, tpot=tpot, e2e=e2e,
            logprobs=list(self.logprobs) if p.logprobs is not None else None,
            prompt_logprobs=([self.prompt_logprobs.get(i) for i in range(n_prompt)]
                             if p.prompt_logprobs is not None else None),
            prompt_top_logprobs=([self.prompt_top_logprobs.get(i) for i in range(n_prompt)]
                                 if p.prompt_logprobs else None),
            token_times=list(self.token_times))
