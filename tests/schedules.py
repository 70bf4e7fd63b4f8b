"""Random add / abort / step schedules for engine tests (hypothesis strategies and a runner
shared by the scheduler tests and the KV tier tests)."""

from __future__ import annotations

from hypothesis import strategies as st

from pagedkv import SamplingParams

SHARED = list(range(1000, 1040))  # a 40-token prefix several prompts share

OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 5), st.integers(1, 48), st.integers(1, 12)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 4))), min_size=1, max_size=25)


def schedule_prompt(kind: int, length: int) -> list[int]:
    """Even kinds share :data:`SHARED`; odd kinds have prompts of their own."""
    base = SHARED if kind % 2 == 0 else list(range(2000 + kind * 50, 2100 + kind * 50))
    return (base + list(range(3000 + kind, 3000 + kind + length)))[:length]


def solo_tokens(solo, ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of one request run alone on the engine ``solo``."""
    solo.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    while solo.has_unfinished_requests():
        for o in solo.step():
            if o.finished:
                return o.token_ids


def run_schedule(eng, schedule, check) -> tuple[dict, dict, set]:
    """Apply ``schedule`` to ``eng``, calling ``check(eng)`` after every step, then drain it.
    Returns ``(added: id -> (ids, max_tokens), done: id -> tokens, aborted ids)``."""
    added, done, aborted = {}, {}, set()

    def step():
        done.update({o.request_id: o.token_ids for o in eng.step() if o.finished})
        check(eng)
    for op in schedule:
        if op[0] == "add":
            ids = schedule_prompt(op[1], op[2])
            r = eng.add_request({"prompt_token_ids": ids},
                                SamplingParams(max_tokens=op[3], temperature=0, ignore_eos=True))
            added[r.request_id] = (ids, op[3])
        elif op[0] == "abort" and added:
            rid = sorted(added)[op[1] % len(added)]
            if rid not in done:
                eng.abort_request(rid)
                aborted.add(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                step()
    while eng.has_unfinished_requests():
        step()
    return added, done, aborted


def check_with_connector(eng) -> None:
    """After every step: the KV manager's and the connector's invariants."""
    eng.kv_manager.check_invariants()
    eng.scheduler.connector.check_invariants()


def assert_solo_outputs(solo, added: dict, done: dict, aborted: set) -> None:
    """Every request of a schedule that was not aborted got the tokens it gets alone on ``solo``."""
    for rid, (ids, n) in added.items():
        if rid not in aborted:
            assert done[rid] == solo_tokens(solo, ids, n), f"{rid} differs from its solo run"
