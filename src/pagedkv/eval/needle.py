"""Passkey retrieval ("needle in a haystack"): can a KV setting still find one fact?

A haystack of real text (by default the bundled Monte Cristo chapters) is cut to a prompt
of exactly ``length`` tokens: an instruction, the text with a passkey sentence planted at
``depth`` (0: right after the instruction, 1: right before the question; moved back to the
nearest sentence end), and the question, which the model completes greedily. A trial is
correct when the passkey's digits appear in the first ``max_tokens`` generated tokens.
This is the passkey task of Mohtashami & Jaggi (2023, *Landmark Attention*) with depths as
in Kamradt's needle-in-a-haystack test; the wording here is ours.

Trials run one after the other with prefix caching on, so the haystack before a needle is
computed once per (length, depth) and shared by the other passkeys of that cell.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

from pagedkv.core.sampling_params import SamplingParams

INTRO = ("There is a passkey hidden in the long passage below. Find it and remember it: you will be asked "
         "for it at the end.\n\n")
NEEDLE = "\n\nThe passkey is {key}. Remember it. {key} is the passkey.\n\n"
QUESTION = "\n\nWhat is the passkey hidden in the passage above? The passkey is"
ANSWER_TOKENS = 8  # greedy tokens generated per trial


@dataclass(frozen=True)
class NeedleCell:
    """Accuracy of the trials at one haystack ``length`` (tokens) and needle ``depth`` (0-1)."""
    length: int
    depth: float
    correct: int
    trials: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.trials

    def to_dict(self) -> dict:
        return asdict(self) | {"accuracy": self.accuracy}


def sentence_end_before(tokenizer, ids: list[int], index: int, lookback: int = 64) -> int:
    """The largest ``i <= index`` (at most ``lookback`` back) such that ``ids[:i]`` ends a
    sentence ('.', '!' or '?', possibly closed by a quote), else ``index``."""
    for i in range(index, max(0, index - lookback) - 1, -1):
        if i == 0 or tokenizer.decode(ids[i - 1:i]).rstrip().rstrip("\"'”’").endswith((".", "!", "?")):
            return i
    return index


def build_prompt(tokenizer, text_ids: list[int], length: int, depth: float, key: str) -> list[int]:
    """A prompt of exactly ``length`` token ids: instruction, the first tokens of
    ``text_ids`` with the passkey sentence at ``depth`` of them, the question.

    Raises:
        ValueError: ``depth`` outside [0, 1], or ``length`` too short for the fixed parts,
            or longer than the text allows.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids  # noqa: E731
    intro, needle, question = enc(INTRO), enc(NEEDLE.format(key=key)), enc(QUESTION)
    room = length - len(intro) - len(needle) - len(question)
    if room < 1:
        raise ValueError(f"a haystack of {length} tokens leaves no room for text around the passkey")
    if room > len(text_ids):
        raise ValueError(f"the text has {len(text_ids)} tokens, fewer than the {room} a {length}-token "
                         "haystack needs")
    hay = text_ids[:room]
    at = sentence_end_before(tokenizer, hay, round(depth * room))
    return intro + hay[:at] + needle + hay[at:] + question


def check_lengths(tokenizer, text_ids: list[int], lengths: list[int]) -> None:
    """Raise the ValueError :func:`build_prompt` would, before any trial runs."""
    for length in lengths:
        build_prompt(tokenizer, text_ids, length, 0.0, "00000")


def passkeys(trials: int, seed: int) -> list[str]:
    """``trials`` distinct 5-digit passkeys from ``seed``."""
    return [str(k) for k in random.Random(seed).sample(range(10000, 100000), trials)]


def needle_eval(llm, text_ids: list[int], lengths: list[int], depths: list[float], trials: int = 3,
                max_tokens: int = ANSWER_TOKENS, seed: int = 0, progress=None,
                budget_fraction: float | None = None) -> list[NeedleCell]:
    """Passkey accuracy per (length, depth) cell under ``llm`` (a :class:`pagedkv.LLM`);
    ``progress(cell)`` is called after each cell. ``budget_fraction``: with snapkv
    or h2o eviction, each request keeps that fraction of its prompt (``kv_budget_tokens``).

    Raises:
        ValueError: no length, depth or trial, or a prompt that cannot be built
            (:func:`build_prompt`).
    """
    if not lengths or not depths or trials < 1:
        raise ValueError("the needle eval needs at least one length, one depth and one trial")
    tok = llm.get_tokenizer()
    keys, cells = passkeys(trials, seed), []
    for length in lengths:
        budget = None if budget_fraction is None else max(1, round(budget_fraction * length))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, kv_budget_tokens=budget)
        for depth in depths:
            prompts = [build_prompt(tok, text_ids, length, depth, k) for k in keys]
            correct = 0
            for key, ids in zip(keys, prompts):  # one at a time: later trials hit the shared haystack
                out = llm.generate([{"prompt_token_ids": ids}], params)[0]
                correct += key in out.text.replace(",", "").replace(" ", "")
            cells.append(NeedleCell(length, depth, correct, trials))
            if progress is not None:
                progress(cells[-1])
    return cells
