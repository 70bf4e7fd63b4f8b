"""Benchmark workloads from the bundled real data (:mod:`pagedkv.data`).

A workload is a list of :class:`BenchRequest`: prompt token ids (chat-templated and
capped), how many tokens the request produces (``output_len``), the most it may produce
(``max_tokens``, what a contiguous allocator reserves) and when it arrives (seconds after
the run starts; 0 = offline, all at once).

- ``arena-hard``: 500 real Chatbot Arena prompts, one user turn each.
- ``hh-rlhf``: the history up to each conversation's last human turn is the prompt; the
  token length of the last assistant reply is ``output_len`` (the length distribution).
- ``shared-prefix``: one ~1,024-token system prompt from ``sonnet.txt`` shared by every
  request, each with a different arena-hard question of ~64 tokens.
- ``hh_rlhf_conversations``: the human turns of multi-turn conversations, for a replay.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from pagedkv.data import load_arena_hard, load_hh_rlhf, load_sonnet

DATASETS = ("arena-hard", "hh-rlhf", "shared-prefix")


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload. Lengths are tokens; ``arrival_s`` is seconds after start."""
    prompt_token_ids: tuple[int, ...]
    output_len: int
    max_tokens: int
    arrival_s: float = 0.0
    label: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


# ---- tokenization helpers -----------------------------------------------------------
def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of ``messages`` under the model's chat template, generation prompt added."""
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


def capped_chat_ids(tokenizer, messages: list[dict], cap: int) -> list[int]:
    """Chat-templated ids of at most ``cap`` tokens: drop the oldest turns (keeping any
    system message), then cut the end of the last message's text, so the template's
    framing and generation prompt stay intact."""
    msgs = list(messages)
    ids = chat_ids(tokenizer, msgs)
    while len(ids) > cap and sum(m["role"] != "system" for m in msgs) > 1:
        i = next(i for i, m in enumerate(msgs) if m["role"] != "system")
        msgs.pop(i)
        ids = chat_ids(tokenizer, msgs)
    text_ids = tokenizer(msgs[-1]["content"], add_special_tokens=False).input_ids
    keep = len(text_ids) - (len(ids) - cap)
    while len(ids) > cap and keep > 0:
        msgs[-1] = {**msgs[-1], "content": tokenizer.decode(text_ids[:keep])}
        ids = chat_ids(tokenizer, msgs)
        keep -= max(1, len(ids) - cap)
    if len(ids) > cap:
        floor = len(chat_ids(tokenizer, msgs[:-1] + [{**msgs[-1], "content": ""}]))
        raise ValueError(f"the chat template alone needs {floor} tokens (the last message emptied), and this "
                         f"prompt cut to fit reads {len(ids)}: over the cap of {cap}")
    return ids


def num_tokens(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False).input_ids)


# ---- workloads ----------------------------------------------------------------------
def arena_hard_workload(tokenizer, num_prompts: int, max_prompt_tokens: int, max_tokens: int,
                        start: int = 0) -> list[BenchRequest]:
    """The first ``num_prompts`` arena-hard prompts (from ``start``), each producing ``max_tokens``."""
    prompts = load_arena_hard()[start:start + num_prompts]
    return [BenchRequest(tuple(capped_chat_ids(tokenizer, [{"role": "user", "content": p}], max_prompt_tokens)),
                         max_tokens, max_tokens, label=f"arena-hard/{start + i}") for i, p in enumerate(prompts)]


def hh_rlhf_workload(tokenizer, num_prompts: int, max_prompt_tokens: int, max_tokens: int,
                     seed: int = 0) -> list[BenchRequest]:
    """``num_prompts`` conversations drawn with ``seed``: prompt = history up to the last
    human turn; ``output_len`` = tokens of the last reply, at least 1 and at most ``max_tokens``."""
    convs = load_hh_rlhf()
    picks = random.Random(seed).sample(range(len(convs)), min(num_prompts, len(convs)))
    out = []
    for i in picks:
        msgs = [{"role": r, "content": t} for r, t in convs[i]]
        ids = capped_chat_ids(tokenizer, msgs[:-1], max_prompt_tokens)
        reply = max(1, min(max_tokens, num_tokens(tokenizer, msgs[-1]["content"])))
        out.append(BenchRequest(tuple(ids), reply, max_tokens, label=f"hh-rlhf/{i}"))
    return out


def sonnet_system_prompt(tokenizer, prefix_tokens: int) -> str:
    """Whole lines of ``sonnet.txt`` (repeated if needed) up to about ``prefix_tokens`` tokens."""
    lines, text = load_sonnet().splitlines(), ""
    i = 0
    while True:
        nxt = text + lines[i % len(lines)] + "\n"
        if num_tokens(tokenizer, nxt) > prefix_tokens:
            return text
        text, i = nxt, i + 1


def shared_prefix_workload(tokenizer, num_requests: int = 32, prefix_tokens: int = 1024,
                           question_tokens: int = 64, max_tokens: int = 32) -> list[BenchRequest]:
    """``num_requests`` prompts sharing one system prompt of ~``prefix_tokens`` tokens, each
    with a different arena-hard question cut to ``question_tokens`` tokens."""
    system = "Answer the question after these sonnets.\n\n" + sonnet_system_prompt(tokenizer, prefix_tokens)
    out = []
    for i, q in enumerate(load_arena_hard()[:num_requests]):
        q_ids = tokenizer(q, add_special_tokens=False).input_ids[:question_tokens]
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": tokenizer.decode(q_ids)}]
        out.append(BenchRequest(tuple(chat_ids(tokenizer, msgs)), max_tokens, max_tokens,
                                label=f"shared-prefix/{i}"))
    return out


def hh_rlhf_conversations(num_conversations: int, min_turns: int = 2, max_turns: int = 4,
                          seed: int = 0) -> list[list[str]]:
    """Human messages of ``num_conversations`` conversations with >= ``min_turns`` human
    turns (drawn with ``seed``), each cut to ``max_turns`` turns; for a multi-turn replay."""
    convs = [[t for r, t in c if r == "user"] for c in load_hh_rlhf()]
    convs = [c[:max_turns] for c in convs if len(c) >= min_turns]
    return random.Random(seed).sample(convs, min(num_conversations, len(convs)))


def build_workload(name: str, tokenizer, num_prompts: int, max_prompt_tokens: int, max_tokens: int,
                   seed: int = 0) -> list[BenchRequest]:
    """A workload by name (one of :data:`DATASETS`).

    Raises:
        ValueError: for an unknown name.
    """
    if name == "arena-hard":
        return arena_hard_workload(tokenizer, num_prompts, max_prompt_tokens, max_tokens)
    if name == "hh-rlhf":
        return hh_rlhf_workload(tokenizer, num_prompts, max_prompt_tokens, max_tokens, seed)
    if name == "shared-prefix":
        return shared_prefix_workload(tokenizer, num_prompts, max_tokens=max_tokens)
    raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASETS)}")


def with_poisson_arrivals(requests: list[BenchRequest], rate: float, seed: int = 0) -> list[BenchRequest]:
    """The same requests arriving as a Poisson process of ``rate`` requests per second
    (exponential gaps, first at its first gap); ``rate = inf`` means all at once.

    Raises:
        ValueError: for a rate that is not positive.
    """
    if not rate > 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    rng, t, out = random.Random(seed), 0.0, []
    for r in requests:
        t += 0.0 if rate == float("inf") else rng.expovariate(rate)
        out.append(BenchRequest(r.prompt_token_ids, r.output_len, r.max_tokens, t, r.label))
    return out


def workload_summary(requests: list[BenchRequest]) -> dict:
    """Counts and token lengths of a workload, for the JSON result."""
    p = [r.num_prompt_tokens for r in requests]
    o = [r.output_len for r in requests]
    return {"num_requests": len(requests), "prompt_tokens": sum(p), "output_tokens": sum(o),
            "prompt_len_mean": sum(p) / len(p) if p else 0, "prompt_len_max": max(p, default=0),
            "output_len_mean": sum(o) / len(o) if o else 0, "output_len_max": max(o, default=0),
            "max_tokens": max((r.max_tokens for r in requests), default=0),
            "last_arrival_s": max((r.arrival_s for r in requests), default=0.0)}
