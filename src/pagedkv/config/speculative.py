"""SpeculativeConfig: how a request's tokens are proposed (vLLM's ``speculative_config``).

Given as a dict (``LLM(speculative_config={...})``) or JSON text (``--speculative-config``)::

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}

    {"method": "draft_model", "model": "path/or/name", "num_speculative_tokens": 4}

As in vLLM, a missing ``prompt_lookup_min`` / ``_max`` takes the other's value, and both
default to 5. ``draft_model`` runs a second, smaller Llama-family model with the target's
vocabulary (:mod:`pagedkv.worker.spec_decode.draft_model`); ``model`` is a name or path as the
target's ``model`` is.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
DEFAULT_LOOKUP = 5
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Validated speculative settings.

    Attributes:
        method: ``ngram`` (prompt lookup) or ``draft_model``.
        num_speculative_tokens: draft tokens proposed per step (k), 1..16.
        prompt_lookup_min, prompt_lookup_max: the n-gram sizes tried, longest first (ngram).
        model: the draft model's name or path (draft_model), else None.
    """
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_LOOKUP
    prompt_lookup_max: int = DEFAULT_LOOKUP
    model: str | None = None

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots past a step's tokens the draft model writes its proposals' KV into (k;
        0 for n-gram, which writes none)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A config from a dict, JSON text, a SpeculativeConfig or None.

        Raises:
            ValueError: malformed JSON, unknown keys, an unknown or unbuilt method, or
                out-of-range numbers (the message names the key).
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object, e.g. "
                             '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        method = value.get("method")
        if method is None and value.get("model") is not None:
            method = "draft_model"  # as vLLM: a draft model named without a method
        if method is None:
            raise ValueError('speculative_config needs "method" (e.g. "ngram")')
        if method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {method!r}")
        k = _int(value, "num_speculative_tokens", None)
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {k}")
        if method == "draft_model":
            return cls._draft_model(value, k)
        if "model" in value:
            raise ValueError(f'speculative_config "model" names a draft model; method {method!r} uses none')
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        lo, hi = (lo if lo is not None else hi), (hi if hi is not None else lo)
        lo = _int({"prompt_lookup_min": lo}, "prompt_lookup_min", DEFAULT_LOOKUP)
        hi = _int({"prompt_lookup_max": hi}, "prompt_lookup_max", DEFAULT_LOOKUP)
        if not 1 <= lo <= hi:
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo}, {hi}")
        return cls(method, k, lo, hi)

    @classmethod
    def _draft_model(cls, value: dict, k: int) -> "SpeculativeConfig":
        model = value.get("model")
        if not isinstance(model, str) or not model.strip():
            raise ValueError('speculative_config method "draft_model" needs "model": the draft\'s name or path')
        lookup = sorted(key for key in value if key.startswith("prompt_lookup"))
        if lookup:
            raise ValueError(f"speculative_config {', '.join(lookup)}: prompt lookup is method 'ngram', "
                             "not 'draft_model'")
        return cls("draft_model", k, model=model)


def _int(d: dict, key: str, default: int | None) -> int:
    v = d.get(key)
    v = default if v is None else v
    if v is None:
        raise ValueError(f"speculative_config needs {key}")
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"speculative_config {key} must be an integer, got {v!r}")
    return v
