"""Bench workloads from the data bundled in the package (never ../shared)."""

from __future__ import annotations

import hashlib

import pytest

from pagedkv import data
from pagedkv.bench import workloads as w

SHA256 = {
    "arena-hard-v0.1_question.jsonl": "2650242d2883f22b2abd498f273b6a7e02253cce533f5c91a858e1d44aa3002f",
    "hh-rlhf_helpful-base_test.jsonl.gz": "8be3fc1a13b27901631696f2be6f184c799f1baeaf145f53ac5db24960adc37b",
    "sonnet.txt": "d58663195ba6780da5f029b920c7ac00cad1e435ee1df7e03bf9ec2470f8dea4",
}


@pytest.fixture(scope="module")
def tok(default_model_files):
    from pagedkv.model.loader import load_tokenizer

    return load_tokenizer(default_model_files.folder)


@pytest.mark.parametrize("name", sorted(SHA256))
def test_bundled_files_are_the_documented_bytes(name):
    path = data.data_path(name)
    assert "shared" not in path.parts
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SHA256[name]
    assert name in (path.parent / "README.md").read_text()


def test_raw_loaders():
    assert len(data.load_arena_hard()) == 500
    convs = data.load_hh_rlhf()
    assert len(convs) == 2344                       # 2,354 rows less the 10 malformed ones
    for c in convs[:200]:
        assert [r for r, _ in c] == ["user", "assistant"] * (len(c) // 2)
    assert data.load_sonnet().startswith("FROM fairest creatures")


def test_arena_hard_prompts_are_capped_and_keep_the_template(tok):
    reqs = w.arena_hard_workload(tok, 40, 128, 16)
    gen_prompt = w.chat_ids(tok, [{"role": "user", "content": "x"}])[-3:]   # "<|im_start|>assistant\n"
    assert len(reqs) == 40
    assert max(r.num_prompt_tokens for r in reqs) <= 128
    assert any(r.num_prompt_tokens > 120 for r in reqs)         # some prompts were cut, close to the cap
    for r in reqs:
        assert list(r.prompt_token_ids[-3:]) == gen_prompt
        assert r.output_len == r.max_tokens == 16 and r.arrival_s == 0
    short = w.arena_hard_workload(tok, 1, 10_000, 16)[0]
    assert list(short.prompt_token_ids) == w.chat_ids(tok, [{"role": "user", "content": data.load_arena_hard()[0]}])


def test_hh_rlhf_lengths_come_from_replies(tok):
    a = w.hh_rlhf_workload(tok, 20, 256, 64, seed=3)
    assert a == w.hh_rlhf_workload(tok, 20, 256, 64, seed=3)     # deterministic per seed
    assert a != w.hh_rlhf_workload(tok, 20, 256, 64, seed=4)
    assert all(r.num_prompt_tokens <= 256 and 1 <= r.output_len <= 64 and r.max_tokens == 64 for r in a)
    assert len({r.output_len for r in a}) > 5                    # a distribution, not a constant


def test_shared_prefix_workload(tok):
    reqs = w.shared_prefix_workload(tok, num_requests=6, prefix_tokens=200, question_tokens=20, max_tokens=4)
    a = reqs[0].prompt_token_ids
    common = min(next(i for i, (x, y) in enumerate(zip(a, r.prompt_token_ids)) if x != y) for r in reqs[1:])
    assert 200 <= common <= 260                                   # system prompt ~200 tokens + framing
    assert len({r.prompt_token_ids for r in reqs}) == 6
    assert all(r.num_prompt_tokens - common <= 20 + 12 for r in reqs)


def test_poisson_arrivals():
    base = [w.BenchRequest((1, 2), 3, 3) for _ in range(2000)]
    timed = w.with_poisson_arrivals(base, rate=4.0, seed=1)
    t = [r.arrival_s for r in timed]
    assert t == sorted(t) and t[0] > 0
    assert t[-1] / len(t) == pytest.approx(0.25, rel=0.1)         # mean gap 1 / rate
    assert all(r.arrival_s == 0 for r in w.with_poisson_arrivals(base[:3], float("inf")))
    with pytest.raises(ValueError):
        w.with_poisson_arrivals(base, 0)


def test_build_workload_names(tok):
    assert len(w.build_workload("arena-hard", tok, 2, 64, 4)) == 2
    with pytest.raises(ValueError, match="unknown dataset"):
        w.build_workload("sharegpt", tok, 2, 64, 4)
    s = w.workload_summary(w.build_workload("hh-rlhf", tok, 5, 128, 8))
    assert s["num_requests"] == 5 and s["max_tokens"] == 8 and s["output_len_max"] <= 8
