"""SamplingParams: how one request picks its tokens and when it stops (vLLM's names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedkv.reprs import brief

#: Temperatures below this are treated as greedy: dividing logits by a tinier value
#: overflows fp32 (vLLM uses the same cut-off).
SAMPLING_EPS = 1e-5


MAX_STOP_STRINGS = 32   # stop strings per request (OpenAI's API takes 4)
MAX_STOP_CHARS = 1000   # characters per stop string
MAX_STOP_TOKEN_IDS = 1024  # each token is checked against every one
MAX_N = 128             # samples per prompt (each is a request of its own)

@dataclass
class SamplingParams:
    """Per-request sampling and stopping settings.

    Attributes:
        n: samples per prompt (1..``MAX_N``), vLLM's name. ``LLM.generate``/``LLM.chat`` run
            them as n requests sharing the prompt's pages (prefix caching) and return them in
            ``RequestOutput.outputs``; choice j samples with ``seed + j`` when ``seed`` is set.
            ``LLMEngine.add_request`` takes n = 1.
        max_tokens: most tokens to generate; ``None`` = up to ``max_model_len``.
        temperature: 0 (or below 1e-5) = greedy; else logits are divided by it before sampling.
        top_k: keep the k most likely tokens; 0 or -1 = all.
        top_p: keep the smallest set of tokens whose probability reaches p; 1 = all.
        seed: per-request generator seed (reproducible sampling); ``None`` = engine's generator.
        stop: strings that end generation; the matched string is not in the text. At most
            ``MAX_STOP_STRINGS`` of at most ``MAX_STOP_CHARS`` characters each (each new
            token is checked against the text's tail that it can complete).
        stop_token_ids: token ids that end generation (in ``token_ids``, not in the text).
        ignore_eos: keep generating past the model's end-of-sequence token.
        logprobs: number of top log-probabilities to return per generated token (0 = only
            the sampled token's); ``None`` = none.
        prompt_logprobs: 0 = return each prompt token's log-probability given the tokens
            before it (for perplexity); k in 1..20 also returns the top-k tokens of each
            position (``RequestOutput.prompt_top_logprobs``, e.g. teacher-forced argmax);
            ``None`` = none. Such requests compute their whole prompt (no prefix-cache hits:
            a hit has no logits).
        skip_special_tokens: leave special tokens out of the text.
        kv_budget_tokens: tokens this request keeps in an engine with snapkv or h2o eviction
            (``--kv-eviction snapkv|h2o``), instead of the engine's ``kv_budget_tokens``;
            ``None`` = the engine's.
        kv_transfer_params: disaggregated prefill/decode (vLLM's name): ``{"do_remote_decode":
            true, "transfer_id": T}`` on the prefill leg keeps the prompt's KV for the decode
            instance; ``{"do_remote_prefill": true, "transfer_id": T}`` on the decode leg pulls
            it (:mod:`pagedkv.distributed`); ``None`` = neither.
    Raises:
        ValueError: on an out-of-range value, naming the field.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    kv_budget_tokens: int | None = None
    kv_transfer_params: dict | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {brief(self.stop)}")
        self.stop = [s for s in self.stop if s]
        if len(self.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise ValueError(f"stop takes at most {MAX_STOP_STRINGS} strings of at most "
                             f"{MAX_STOP_CHARS} characters each")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of integers, got {brief(self.stop_token_ids)}")
        self.stop_token_ids = list(self.stop_token_ids)
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be an integer >= 1, got {brief(self.max_tokens)}")
        if not _is_number(self.temperature) or not 0 <= _as_float(self.temperature) < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0, got {brief(self.temperature)}")
        if not _is_number(self.top_p) or not 0 < _as_float(self.top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {brief(self.top_p)}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (disabled) or a positive integer, got {brief(self.top_k)}")
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {brief(self.n)}")
        if self.seed is not None and (not _is_int(self.seed) or not -2**63 <= self.seed <= 2**63 - self.n):
            raise ValueError(f"seed must be a 64-bit integer (seed + n - 1 too: choice j samples with seed + j), "
                             f"got {brief(self.seed)}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {brief(getattr(self, name))}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise ValueError(f"logprobs must be an integer in [0, 20], got {brief(self.logprobs)}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= 20):
            raise ValueError(f"prompt_logprobs must be an integer in [0, 20], got {brief(self.prompt_logprobs)}")
        if self.kv_budget_tokens is not None and (not _is_int(self.kv_budget_tokens) or self.kv_budget_tokens < 1):
            raise ValueError(f"kv_budget_tokens must be a positive integer, got {brief(self.kv_budget_tokens)}")
        if self.kv_transfer_params is not None:
            _check_kv_transfer_params(self.kv_transfer_params)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {brief(self.stop_token_ids)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


KV_TRANSFER_KEYS = {"do_remote_decode": bool, "do_remote_prefill": bool, "transfer_id": str, "fault": str}


def _check_kv_transfer_params(p) -> None:
    """Raises ValueError unless ``p`` holds known keys of the right types and, when it asks
    for a transfer, a transfer id of 1..128 characters."""
    if not isinstance(p, dict):
        raise ValueError(f"kv_transfer_params must be an object, got {brief(p)}")
    for key, value in p.items():
        if key not in KV_TRANSFER_KEYS or not isinstance(value, KV_TRANSFER_KEYS[key]):
            raise ValueError(f"kv_transfer_params: {key!r} is not one of {sorted(KV_TRANSFER_KEYS)} "
                             "or has the wrong type")
    if p.get("do_remote_decode") and p.get("do_remote_prefill"):
        raise ValueError("kv_transfer_params: a request is either the prefill leg or the decode leg, not both")
    if (p.get("do_remote_decode") or p.get("do_remote_prefill")) and not 0 < len(p.get("transfer_id", "")) <= 128:
        raise ValueError("kv_transfer_params: a transfer needs a 'transfer_id' of 1 to 128 characters")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _as_float(v) -> float:
    """``v`` as a float; NaN for an integer too large for one (so range checks fail)."""
    try:
        return float(v)
    except OverflowError:
        return float("nan")
