"""SamplingParams validation, the sampler (greedy, top-k, top-p, seeds, logprobs) and the
stop-string helpers ``find_stop`` / ``hold_back``."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.core.sampling_params import SamplingParams
from pagedkv.engine.stop_strings import find_stop, hold_back
from pagedkv.worker.sampler import _filter_top_k_top_p, first_argmax, sample, sample_row


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draws(logits: torch.Tensor, params: SamplingParams, seed: int, n: int = 2000) -> list[int]:
    g = gen(seed)
    return [sample_row(logits, params, g) for _ in range(n)]


def logits_of(probs: list[float]) -> torch.Tensor:
    """Logits ``[V]`` whose softmax is ``probs``."""
    return torch.log(torch.tensor(probs, dtype=torch.float64)).float()


# ---- SamplingParams ----------------------------------------------------------------------
@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(max_tokens=2.0), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(temperature=-0.01), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature="1"), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_p=1.0001), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_k=None), "top_k"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=1.0), "logprobs"),
    (dict(seed=1.5), "seed"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_sampling_params_rejects(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=1), dict(max_tokens=None), dict(temperature=0), dict(temperature=0.0),
    dict(temperature=100.0), dict(top_p=1.0), dict(top_p=1e-6), dict(top_k=-1), dict(top_k=0),
    dict(top_k=1), dict(logprobs=0), dict(logprobs=20), dict(seed=0), dict(seed=-5),
])
def test_sampling_params_accepts_boundaries(kwargs):
    SamplingParams(**kwargs)


def test_sampling_params_normalizes_stop():
    assert SamplingParams(stop="END").stop == ["END"]
    assert SamplingParams(stop=["a", "", "b"]).stop == ["a", "b"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.5).greedy


# ---- greedy ------------------------------------------------------------------------------
def test_greedy_is_argmax():
    torch.manual_seed(0)
    params = SamplingParams(temperature=0)
    for _ in range(20):
        row = torch.randn(100)
        assert sample_row(row, params, None) == int(row.argmax())


def test_greedy_ties_take_lowest_id():
    row = torch.tensor([0.0, 3.0, 1.0, 3.0, 3.0])
    assert sample_row(row, SamplingParams(temperature=0), None) == 1


def test_greedy_ignores_top_k_top_p_and_generator():
    row = torch.tensor([0.1, 0.2, 5.0, 0.3])
    p = SamplingParams(temperature=0, top_k=1, top_p=0.1)
    assert {sample_row(row, p, gen(s)) for s in range(5)} == {2}


# ---- top-k ----------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 5, 19])
def test_top_k_filter_keeps_exactly_k(k):
    row = torch.randn(20, generator=gen(k))
    kept = torch.isfinite(_filter_top_k_top_p(row, k, 1.0))
    assert int(kept.sum()) == k
    assert set(kept.nonzero().flatten().tolist()) == set(row.topk(k).indices.tolist())


@pytest.mark.parametrize("k", [0, -1, 20, 50])
def test_top_k_disabled_keeps_all(k):
    row = torch.randn(20, generator=gen(3))
    assert torch.equal(_filter_top_k_top_p(row, k, 1.0), row)


@pytest.mark.parametrize("k", [1, 3, 6])
def test_top_k_samples_never_leave_top_k(k):
    row = torch.randn(30, generator=gen(10 + k))
    top = set(row.topk(k).indices.tolist())
    got = draws(row, SamplingParams(temperature=3.0, top_k=k), seed=k)
    assert set(got) == top  # inside the top k, and every one of them is reachable


# ---- top-p ----------------------------------------------------------------------------------
PROBS = [0.5, 0.3, 0.15, 0.05]
ORDER = [3, 0, 4, 1]  # token ids of those probabilities; token 2 gets probability ~0


def nucleus_logits() -> torch.Tensor:
    row = torch.full((5,), -30.0)
    row[torch.tensor(ORDER)] = logits_of(PROBS)
    return row


@pytest.mark.parametrize("top_p,kept", [
    (0.1, {3}), (0.49, {3}),          # the most likely token alone reaches p
    (0.51, {3, 0}),                   # 0.5 < p: the token crossing p is included
    (0.79, {3, 0}), (0.81, {3, 0, 4}),
    (0.94, {3, 0, 4}), (0.96, {3, 0, 4, 1}),
])
def test_top_p_keeps_smallest_set_reaching_p(top_p, kept):
    row = nucleus_logits()
    filt = _filter_top_k_top_p(row, 0, top_p)
    assert set(torch.isfinite(filt).nonzero().flatten().tolist()) == kept
    assert torch.equal(filt[list(kept)], row[list(kept)])  # kept logits are unchanged
    got = draws(row, SamplingParams(temperature=1.0, top_p=top_p), seed=int(top_p * 100))
    assert set(got) == kept


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-46])
def test_top_p_below_fp32_resolution_keeps_the_top_token(top_p):
    """Issue 19 item 6: 1e-300 is 0 in fp32, so "cum - p >= top_p" dropped every token and
    the request aborted. The top token always stays: greedy-within-top-1."""
    row = nucleus_logits()
    filt = _filter_top_k_top_p(row, 0, top_p)
    assert torch.isfinite(filt).nonzero().flatten().tolist() == [3]
    assert set(draws(row, SamplingParams(temperature=1.0, top_p=top_p), seed=1, n=50)) == {3}


def test_top_p_one_keeps_all():
    row = nucleus_logits()
    assert torch.equal(_filter_top_k_top_p(row, 0, 1.0), row)


def test_top_p_applies_to_the_top_k_renormalized_distribution():
    row = logits_of([0.4, 0.3, 0.2, 0.1])
    # top-k 2 leaves [4/7, 3/7]; then 4/7 alone reaches p = 0.5
    kept = torch.isfinite(_filter_top_k_top_p(row, 2, 0.5)).nonzero().flatten().tolist()
    assert kept == [0]
    # without top-k, 0.4 < 0.5 so two tokens are needed
    assert torch.isfinite(_filter_top_k_top_p(row, 0, 0.5)).sum() == 2


def test_temperature_sharpens_before_top_p():
    row = logits_of([0.4, 0.3, 0.2, 0.1])
    assert set(draws(row, SamplingParams(temperature=1.0, top_p=0.5), seed=0, n=500)) == {0, 1}
    # T = 0.1 puts ~0.95 on token 0: now it alone reaches p
    assert set(draws(row, SamplingParams(temperature=0.1, top_p=0.5), seed=0, n=500)) == {0}


def test_sampling_follows_the_distribution():
    row = logits_of(PROBS)
    got = draws(row, SamplingParams(temperature=1.0), seed=123, n=20000)
    for tok, p in enumerate(PROBS):
        assert abs(got.count(tok) / len(got) - p) < 0.015


# ---- seeds ----------------------------------------------------------------------------------
def test_same_seed_same_draws_different_seed_different_draws():
    row = torch.randn(50, generator=gen(7))
    p = SamplingParams(temperature=1.5)
    a, b, c = draws(row, p, 42, 300), draws(row, p, 42, 300), draws(row, p, 43, 300)
    assert a == b
    assert a != c
    assert sum(x != y for x, y in zip(a, c)) > 100  # not a one-off difference


def test_sample_uses_each_rows_generator():
    logits = torch.randn(40, generator=gen(1)).expand(3, 40)
    params = [SamplingParams(temperature=1.0)] * 3
    rows = [[t.token_id for t in sample(logits, params, [gen(s), gen(s), gen(s + 1000)])]
            for s in range(60)]
    assert all(a == b for a, b, _ in rows)  # equal seeds, equal draws, whatever the row
    assert sum(a != c for a, _, c in rows) > 20


# ---- logprobs ---------------------------------------------------------------------------------
def test_no_logprobs_by_default():
    [tok] = sample(torch.randn(1, 10), [SamplingParams(temperature=0)], [None])
    assert tok.logprobs is None


def test_logprobs_zero_has_only_the_sampled_token():
    row = torch.randn(1, 10, generator=gen(2))
    [tok] = sample(row, [SamplingParams(temperature=0, logprobs=0)], [None])
    ref = torch.log_softmax(row[0].double(), -1)
    assert list(tok.logprobs) == [tok.token_id]
    assert tok.logprobs[tok.token_id] == pytest.approx(float(ref[tok.token_id]), abs=1e-5)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_logprobs_top_n_and_sampled_token(n):
    row = torch.zeros(1, 30)
    row[0, :10] = torch.linspace(3.0, 2.0, 10)  # tokens 0..9 favoured, the rest possible
    params = [SamplingParams(temperature=2.0, logprobs=n)]
    g = gen(0)
    outside = None
    for _ in range(500):  # find a draw outside the top n
        [tok] = sample(row, params, [g])
        assert tok.token_id in tok.logprobs
        assert set(range(n)) <= set(tok.logprobs)
        if tok.token_id >= n:
            outside = tok
            break
    assert outside is not None
    assert set(outside.logprobs) == set(range(n)) | {outside.token_id}
    # values: log-softmax of the model's logits (vLLM's default: before temperature/filters)
    ref = torch.log_softmax(row[0].double(), -1)
    for t, v in outside.logprobs.items():
        assert v == pytest.approx(float(ref[t]), abs=1e-5)


def test_logprobs_greedy_top1_is_sampled():
    row = torch.tensor([[0.0, 1.0, 4.0, 2.0]])
    [tok] = sample(row, [SamplingParams(temperature=0, logprobs=2)], [None])
    assert tok.token_id == 2
    ref = torch.log_softmax(row[0].double(), -1)
    assert set(tok.logprobs) == {2, 3}
    assert tok.logprobs[3] == pytest.approx(float(ref[3]), abs=1e-6)


# BUG (fails until fixed in src): see the docstring.
def test_tiny_positive_temperature_behaves_like_greedy():
    """BUG (src/pagedkv/worker/sampler.py, sample_row): a valid temperature so small that
    ``logits / temperature`` overflows to +-inf gives NaN probabilities and
    ``torch.multinomial`` raises. SamplingParams accepts it (any finite value >= 0)."""
    row = torch.tensor([1.0, 3.0, 2.0, -1.0])
    assert sample_row(row, SamplingParams(temperature=1e-3), gen(0)) == 1
    assert sample_row(row, SamplingParams(temperature=1e-40), gen(0)) == 1


# ---- stop strings ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text,stops,expect", [
    ("Hello world", ["wor"], (6, "wor")),
    ("Hello world", ["xyz"], None),
    ("Hello world", [], None),
    ("Hello world", ["world", "lo"], (3, "lo")),     # earliest match wins, not list order
    ("Hello world", ["lo", "world"], (3, "lo")),
    ("END at start", ["END"], (0, "END")),
    ("aaa", ["aa"], (0, "aa")),
    ("one. two. three.", [". t"], (3, ". t")),
    ("tail STOP", ["STOP"], (5, "STOP")),
])
def test_find_stop(text, stops, expect):
    assert find_stop(text, stops) == expect


def test_find_stop_overlapping_prefixes_cut_at_the_same_place():
    hit = find_stop("xxabcd", ["abc", "ab", "abcd"])
    assert hit is not None and hit[0] == 2 and hit[1].startswith("ab")
    hit = find_stop("xxabcd", ["bcd", "abcd"])
    assert hit == (2, "abcd")


@pytest.mark.parametrize("text,stops,expect", [
    ("Hello EN", ["END"], "Hello "),        # stop split across tokens: hold its start back
    ("Hello E", ["END"], "Hello "),
    ("Hello", ["END"], "Hello"),
    ("abcab", ["abd"], "abc"),
    ("xaa", ["aab"], "x"),                    # overlapping: longest partial match
    ("xaba", ["abab"], "x"),
    ("abz", ["zq", "bzw"], "a"),              # several stops: the longest hold wins
    ("a", ["abc"], ""),
    ("", ["abc"], ""),
    ("text", [], "text"),
])
def test_hold_back(text, stops, expect):
    assert hold_back(text, stops) == expect


def test_stop_split_across_tokens_streams_consistently():
    chunks, stops = ["Hel", "lo E", "N", "D and more"], ["END"]
    text, streamed = "", []
    for c in chunks:
        text += c
        hit = find_stop(text, stops)
        if hit:
            streamed.append(text[:hit[0]])
            break
        streamed.append(hold_back(text, stops))
    assert streamed == ["Hel", "Hello ", "Hello ", "Hello "]


@settings(max_examples=300, deadline=None)
@given(text=st.text("abc", max_size=14), stops=st.lists(st.text("abc", min_size=1, max_size=4),
                                                         min_size=1, max_size=3))
def test_streamed_text_is_never_retracted(text, stops):
    """Stream ``text`` one character at a time as the engine does (find_stop, else
    hold_back): every text shown extends the one before and is a prefix of the final text."""
    shown, final = [""], None
    for i in range(len(text) + 1):
        partial = text[:i]
        hit = find_stop(partial, stops)
        if hit:
            assert partial[hit[0]:].startswith(hit[1]) and hit[1] in stops
            final = partial[:hit[0]]
            break
        out = hold_back(partial, stops)
        assert partial.startswith(out)
        held = partial[len(out):]  # what is held back is a proper prefix of a stop string
        assert not held or any(s.startswith(held) and len(held) < len(s) for s in stops)
        shown.append(out)
    final = text if final is None else final
    for a, b in zip(shown, shown[1:]):
        assert b.startswith(a)
    assert final.startswith(shown[-1])


@pytest.mark.parametrize("rows,vocab", [(1, 49152), (5, 1000), (3, 7), (2, 128), (4, 129)])
def test_first_argmax_is_torch_argmax(rows, vocab):
    """The two-level argmax picks torch.argmax's index: the first maximum on ties, the
    first NaN where a row has one, +inf and all -inf rows, vocabularies that are not a
    whole number of blocks."""
    g = torch.Generator().manual_seed(rows * vocab)
    cases = [torch.randn(rows, vocab, generator=g),
             torch.randint(-2, 2, (rows, vocab), generator=g).float()]     # many ties
    nan_inf = torch.randn(rows, vocab, generator=g)
    nan_inf[0, torch.randint(0, vocab, (3,), generator=g)] = float("nan")
    nan_inf[-1, torch.randint(0, vocab, (2,), generator=g)] = float("inf")
    cases.append(nan_inf)
    cases.append(torch.full((rows, vocab), float("-inf")))
    for x in cases:
        assert torch.equal(first_argmax(x), torch.argmax(x, dim=-1))


def test_first_argmax_of_an_empty_batch_is_empty():
    assert first_argmax(torch.zeros(0, 300)).shape == (0,)
