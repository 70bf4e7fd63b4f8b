"""Shared fixtures: a tiny random Llama folder (with the real SmolLM2 tokenizer) and the
real default model, loaded once per session."""

from __future__ import annotations

import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("PAGEDKV_BATCH_INVARIANT", "1")  # tests assert bit-identical outputs across batching

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():  # the Triton kernels run interpreted on CPU tensors (set before they are imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_CONFIG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512,
                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True)


@pytest.fixture(scope="session", autouse=True)
def own_cpu_measurement(tmp_path_factory):
    """The planner's CPU measurement cached per test session, never in the user's cache: a
    suite loads the machine, and a measurement taken then would stay low for every later
    plan and simulation (the weight and extension caches stay shared: they do not drift)."""
    from pagedkv.planner import cpu

    path, users = tmp_path_factory.mktemp("cpu-measurement") / "cpu.json", cpu.cache_path
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu, "cache_path", lambda: path)
        yield users  # the real lookup (under $XDG_CACHE_HOME), for the test of it


@pytest.fixture(scope="session")
def default_model_files():
    from pagedkv.model.loader import resolve_model

    return resolve_model("smollm2-135m-instruct")


def make_hf_folder(path, seed: int = 0, tokenizer_from=None, **overrides):
    """Save a random ``LlamaForCausalLM`` (fp32 safetensors) plus a tokenizer to ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**(TINY_CONFIG | overrides))
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # HF inits small; widen so attention patterns are not uniform
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
    model.save_pretrained(str(path))
    if tokenizer_from is not None:
        for f in tokenizer_from.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, default_model_files):
    return make_hf_folder(tmp_path_factory.mktemp("tiny-llama"), tokenizer_from=default_model_files.folder)


@pytest.fixture(scope="session")
def tiny_llm_factory(tiny_model_dir):
    """Build an LLM on the tiny model with the given engine arguments."""
    from pagedkv import LLM

    def make(**kw):
        kw.setdefault("num_blocks", 64)
        kw.setdefault("debug_invariants", True)
        return LLM(model=str(tiny_model_dir), **kw)

    return make


@pytest.fixture(scope="session")
def smollm(default_model_files):
    """The real default model with a small cache (shared; tests must leave it idle)."""
    from pagedkv import LLM

    return LLM(num_blocks=256, debug_invariants=True)


def assert_rows_invariant(product, x) -> None:
    """``product(x)`` row by row equals it whole, and with one thread equals it with the
    default threads, bit for bit (a batch-invariant kernel)."""
    full = product(x)
    for i in range(x.shape[0]):
        assert torch.equal(product(x[i:i + 1]), full[i:i + 1])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(product(x), full)
    finally:
        torch.set_num_threads(before)


def assert_engine_batch_invariant(llm) -> None:
    """A prompt's greedy tokens and log-probs alone equal the same prompt's in a batch."""
    from pagedkv import SamplingParams

    assert not llm.engine.model.batch_invariant
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = ["a b c d", "the paged cache", "one more prompt here", "x"]
    alone = llm.generate([prompts[1]], params)[0]
    batch = llm.generate(prompts, params)[1]
    assert alone.token_ids == batch.token_ids and alone.logprobs == batch.logprobs
