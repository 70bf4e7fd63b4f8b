"""Batch-invariant mode (pagedkv.numerics): every matrix product in fixed 16-row tiles, so a
row's bits depend only on that row, on any x86 CPU (MKL's own reproducibility switch is
ignored on AMD). Checked on the product itself and through the whole engine."""

from __future__ import annotations

import pytest
import torch

from pagedkv import SamplingParams
from pagedkv.numerics import ROW_TILE, env_requests_invariance, invariant_linear, linear_for

ROWS = (1, 2, 3, 5, 8, 15, 16, 17, 33, 64)


@pytest.mark.parametrize("shape", [(1536, 576), (576, 1536), (192, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_rows_do_not_depend_on_the_batch(shape, with_bias):
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(*shape, generator=g), torch.randn(2048, shape[1], generator=g)
    bias = torch.randn(shape[0], generator=g) if with_bias else None
    full = invariant_linear(x, w, bias)
    for m in ROWS:
        assert torch.equal(invariant_linear(x[:m], w, bias), full[:m]), f"{m} rows"
    for i in (0, 7, 100, 2047):  # a row alone equals the same row anywhere in a big product
        assert torch.equal(invariant_linear(x[i:i + 1], w, bias), full[i:i + 1]), f"row {i}"
    other = torch.randn(40, shape[1], generator=g)  # and does not care what its neighbours are
    assert torch.equal(invariant_linear(torch.cat([x[:3], other]), w, bias)[:3], full[:3])


def test_invariant_linear_equals_a_plain_product_of_tile_rows():
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(64, 32, generator=g), torch.randn(ROW_TILE * 3, 32, generator=g)
    assert torch.equal(invariant_linear(x, w), torch.nn.functional.linear(x, w))
    assert invariant_linear(x[:5], w).shape == (5, 64)
    y = x[:5]
    assert torch.equal(linear_for(False)(y, w), torch.nn.functional.linear(y, w))
    assert torch.equal(linear_for(True)(y, w), invariant_linear(y, w))


def test_linear_for_hands_non_tensor_weights_their_own_kernel():
    """An int8 weight is called with (x, bias): its kernel is batch-invariant already."""
    from pagedkv.model.int8_weights import Int8Weight

    g = torch.Generator().manual_seed(2)
    w, x, b = Int8Weight.quantize(torch.randn(48, 32, generator=g)), torch.randn(5, 32, generator=g), torch.randn(48)
    for invariant in (False, True):
        assert torch.equal(linear_for(invariant)(x, w, b), w(x, b))


@pytest.mark.parametrize("value,expected", [("1", True), ("on", True), ("TRUE", True),
                                            ("0", False), ("", False), ("no", False)])
def test_env_values(monkeypatch, value, expected):
    monkeypatch.setenv("PAGEDKV_BATCH_INVARIANT", value)
    assert env_requests_invariance() is expected


def test_engine_logprobs_bit_identical_alone_and_in_a_batch(tiny_llm_factory, monkeypatch):
    """Log-probs (not only greedy tokens) of a request alone and beside 15 others; each row
    of a decode step sits in a product of 1 vs 16 rows, where plain GEMMs differ."""
    monkeypatch.delenv("PAGEDKV_BATCH_INVARIANT", raising=False)
    llm = tiny_llm_factory(batch_invariant=True, enable_prefix_caching=False)
    assert llm.engine.model.batch_invariant
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [{"prompt_token_ids": list(range(100 + i, 120 + 2 * i))} for i in range(16)]
    alone = llm.generate(prompts[:1], params)[0]
    batch = llm.generate(prompts, params)[0]
    assert batch.token_ids == alone.token_ids and batch.logprobs == alone.logprobs


def test_env_var_turns_it_on_for_every_engine(tiny_llm_factory, monkeypatch):
    monkeypatch.setenv("PAGEDKV_BATCH_INVARIANT", "1")
    assert tiny_llm_factory().engine.model.batch_invariant
    monkeypatch.setenv("PAGEDKV_BATCH_INVARIANT", "0")
    assert not tiny_llm_factory().engine.model.batch_invariant


def test_cli_flag_reaches_the_engine_config():
    from pagedkv.cli import build_parser, engine_kwargs
    from pagedkv.config.engine import EngineConfig

    a = build_parser().parse_args(["generate", "--batch-invariant", "hi"])
    assert EngineConfig(**engine_kwargs(a)).batch_invariant is True
    a = build_parser().parse_args(["generate", "hi"])
    assert EngineConfig(**engine_kwargs(a)).batch_invariant is False
