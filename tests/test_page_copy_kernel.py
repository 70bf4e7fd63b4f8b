"""The Triton page-copy kernel (issue 54: the GPU tier's copies in one launch), interpreted on
CPU tensors: every page dtype and scale layout byte for byte against torch's indexing, pages
in any order, page sizes that are not whole 32-bit words, pools past one chunk, and clear
errors for pools that do not match."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
from pagedkv.kernels.triton.page_copy import CHUNK, copy_pages  # noqa: E402

CASES = {
    "float32 pages": ((16, 2, 8), torch.float32),
    "bf16 pages": ((16, 3, 64), torch.bfloat16),
    "int8 pages": ((16, 2, 8), torch.int8),
    "fp8 pages": ((16, 1, 16), torch.float8_e4m3fn),
    "bf16 per-token scales, odd bytes": ((3, 1), torch.bfloat16),     # 6 bytes: not whole words
    "int8, odd bytes": ((5, 3), torch.int8),
    "a page past one chunk": ((16, 4, 40), torch.float32),             # 2,560 words
}


def _pool(pages: int, shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (pages, *shape, torch.empty((), dtype=dtype).element_size()), generator=g,
                        dtype=torch.uint8)
    return raw.view(dtype).reshape(pages, *shape)


@pytest.mark.parametrize("name", list(CASES))
def test_pages_move_byte_for_byte(name):
    shape, dtype = CASES[name]
    src, dst = _pool(9, shape, dtype, 1), _pool(12, shape, dtype, 2)
    want = dst.view(torch.uint8).clone()
    src_pages, dst_pages = torch.tensor([7, 0, 3, 8, 1]), torch.tensor([2, 11, 5, 0, 9])
    want[dst_pages] = src.view(torch.uint8)[src_pages]
    copy_pages(dst, dst_pages, src, src_pages)
    assert torch.equal(dst.view(torch.uint8), want)
    if name == "a page past one chunk":
        assert src[0].numel() > CHUNK


def test_no_pages_is_a_no_op_and_mismatches_are_refused():
    a, b = torch.zeros(4, 2, 8), torch.ones(4, 2, 8)
    copy_pages(a, torch.tensor([], dtype=torch.int64), b, torch.tensor([], dtype=torch.int64))
    assert a.abs().sum() == 0
    with pytest.raises(ValueError, match="pages of"):
        copy_pages(a, torch.tensor([0]), torch.ones(4, 2, 4), torch.tensor([0]))
    with pytest.raises(ValueError, match="pages of"):
        copy_pages(a, torch.tensor([0]), b.to(torch.bfloat16), torch.tensor([0]))
    with pytest.raises(ValueError, match="contiguous"):
        copy_pages(a, torch.tensor([0]), torch.ones(4, 8, 2).transpose(1, 2), torch.tensor([0]))
    with pytest.raises(ValueError, match="2 pages into 1"):
        copy_pages(a, torch.tensor([0]), b, torch.tensor([0, 1]))
