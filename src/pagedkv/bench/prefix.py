"""The prefix-caching benchmark: a shared system prompt, and a multi-turn replay.

Shared prefix: ``num_requests`` requests share a ~1,024-token system prompt (sonnets),
each with a different ~64-token question. The first request runs alone (it fills the
cache); then the others arrive together. With prefix caching on and off, in one run:
prompt tokens computed (prefill) and the TTFT of the requests after the first.

Multi-turn replay: hh-rlhf conversations replayed turn by turn, each turn resent with its
history (the model's own earlier replies, as a chat client would), all conversations'
turn k in one wave. Hit rate = cached prompt tokens / prompt tokens, for turns >= 2 and
overall; ``possible`` is the most a block-granular cache could hit (the longest common
prefix with the previous turn's prompt + reply, in whole blocks, leaving one token).
"""

from __future__ import annotations

from pagedkv.bench import report
from pagedkv.bench.driver import drive
from pagedkv.bench.load import LoadMeter
from pagedkv.bench.metrics import distribution
from pagedkv.bench.suite import Context, Settings, checkpoint, finish, make_context, make_engine, roofline_entry
from pagedkv.bench.workloads import BenchRequest, chat_ids, hh_rlhf_conversations, shared_prefix_workload

BEST_KEY = "metrics.rest_ttft_s.mean"   # a prefix run's best repeat: lowest mean TTFT after the first


def shared_prefix_run(ctx: Context, caching: bool, workload: list[BenchRequest]):
    """First request alone, then the rest at once; returns ``(metrics, run of the rest)``."""
    engine = make_engine(ctx, enable_prefix_caching=caching)
    first = drive(engine, workload[:1])
    rest = drive(engine, workload[1:])
    r = rest.metrics()
    out = {"prefill_tokens_computed": first.metrics()["prefill_tokens_computed"] + r["prefill_tokens_computed"],
           "first_ttft_s": first.records[0].ttft, "rest_ttft_s": distribution(x.ttft for x in rest.records),
           "rest_cached_tokens": r["cached_prompt_tokens"], "rest_prompt_tokens": r["prompt_tokens"],
           "rest_duration_s": r["duration_s"], "rest_output_tokens_per_s": r["output_tokens_per_s"],
           "peak_kv_blocks": max(first.metrics()["peak_kv_blocks"], r["peak_kv_blocks"])}
    return out, rest


def replay(ctx: Context, num_conversations: int, max_turns: int, max_tokens: int, max_len: int) -> dict:
    """Multi-turn replay with prefix caching on; hit rates per turn. Conversations whose
    last turn could exceed ``max_len`` tokens (human turns + ``max_tokens`` per reply) are
    left out, so no history is ever cut (a cut would change every later prefix)."""
    tok = ctx.tokenizer
    engine = make_engine(ctx, enable_prefix_caching=True)
    pool = hh_rlhf_conversations(10 * num_conversations, max_turns=max_turns, seed=ctx.settings.seed)
    convs = [c for c in pool if _replay_len(tok, c, max_tokens) <= max_len][:num_conversations]
    history = [[] for _ in convs]
    previous: list[list[int] | None] = [None] * len(convs)
    turns = []
    bs = engine.kv_manager.block_size
    for k in range(max_turns):
        live = [i for i, c in enumerate(convs) if len(c) > k]
        if not live:
            break
        prompts = []
        for i in live:
            history[i].append({"role": "user", "content": convs[i][k]})
            prompts.append(chat_ids(tok, history[i]))
        wave = [BenchRequest(tuple(p), max_tokens, max_tokens) for p in prompts]
        records = sorted(drive(engine, wave, ignore_eos=False).records, key=lambda r: r.index)
        outs = [(r.num_cached_tokens, r.output_token_ids) for r in records]
        for i, p, (cached, out_ids) in zip(live, prompts, outs):
            possible = _possible_hit(previous[i], p, bs) if k else 0
            turns.append({"turn": k + 1, "prompt_tokens": len(p), "cached_tokens": cached, "possible": possible})
            previous[i] = p + out_ids
            history[i].append({"role": "assistant", "content": tok.decode(out_ids, skip_special_tokens=True)})
    return _hit_rates(turns) | {"conversations": len(convs), "max_turns": max_turns, "max_tokens": max_tokens}


def _replay_len(tok, human_turns: list[str], max_tokens: int) -> int:
    msgs = []
    for h in human_turns:
        msgs += [{"role": "user", "content": h}, {"role": "assistant", "content": ""}]
    return len(chat_ids(tok, msgs[:-1])) + (max_tokens + 8) * len(human_turns)


def _possible_hit(prev: list[int] | None, prompt: list[int], block_size: int) -> int:
    if not prev:
        return 0
    n = 0
    while n < min(len(prev), len(prompt)) and prev[n] == prompt[n]:
        n += 1
    return min(n, len(prompt) - 1) // block_size * block_size


def _hit_rates(turns: list[dict]) -> dict:
    later = [t for t in turns if t["turn"] > 1]
    rate = lambda ts, key: sum(t[key] for t in ts) / max(1, sum(t["prompt_tokens"] for t in ts))  # noqa: E731
    return {"hit_rate_all_turns": rate(turns, "cached_tokens"), "hit_rate_turns_2plus": rate(later, "cached_tokens"),
            "possible_hit_rate_turns_2plus": rate(later, "possible"), "requests": len(turns),
            "prompt_tokens": sum(t["prompt_tokens"] for t in turns),
            "cached_tokens": sum(t["cached_tokens"] for t in turns), "turns": turns}


def prefix(settings: Settings, replay_conversations: int = 16, replay_turns: int = 4,
           replay_max_tokens: int = 32, prefix_tokens: int = 1024, question_tokens: int = 64) -> dict:
    """Shared-prefix caching on vs off (repeats interleaved) and the multi-turn replay
    (its prompts stay within ``settings.max_prompt_tokens``)."""
    ctx = make_context(settings)
    workload = shared_prefix_workload(ctx.tokenizer, settings.num_prompts, prefix_tokens, question_tokens,
                                      settings.max_tokens)
    result = report.new_result("prefix", settings.to_dict())
    result["workload"] = {"dataset": "shared-prefix", "num_requests": len(workload),
                          "shared_prefix_tokens": _common_prefix(workload),
                          "prompt_len_mean": sum(r.num_prompt_tokens for r in workload) / len(workload)}
    for rep in range(settings.repeats):
        for system, caching in (("prefix-caching-on", True), ("prefix-caching-off", False)):
            ctx.probe(f"{system} repeat {rep}")
            with LoadMeter() as load:
                m, rest = shared_prefix_run(ctx, caching, workload)
            run = {"system": system, "repeat": rep, "metrics": m, "load": load.result()}
            ctx.roofline(run, lambda rm=rest.metrics(), st=rest.steps: roofline_entry(ctx, rm, st, workload[1:], False))
            result["runs"].append(run)
            checkpoint(ctx, result)
    finish(ctx, result, BEST_KEY, higher=False)
    ratio = report.add_ratio(result, "off/on mean TTFT after the first", "prefix-caching-off", "prefix-caching-on",
                             "metrics.rest_ttft_s.mean")
    report.add_ratio(result, "off/on prefill tokens", "prefix-caching-off", "prefix-caching-on",
                     "metrics.prefill_tokens_computed")
    report.add_goal(result, "mean TTFT after the first, caching off / on", ratio, 5.0,
                    best=result["ratios"]["off/on mean TTFT after the first"]["best_of_each"])
    if replay_conversations:
        result["replay"] = replay(ctx, replay_conversations, replay_turns, replay_max_tokens,
                                  settings.max_prompt_tokens)
    return finish(ctx, result, BEST_KEY, higher=False)


def _common_prefix(workload: list[BenchRequest]) -> int:
    a = workload[0].prompt_token_ids
    n = len(a)
    for r in workload[1:]:
        n = next((i for i, (x, y) in enumerate(zip(a[:n], r.prompt_token_ids)) if x != y), min(n, r.num_prompt_tokens))
    return n
