"""Batch-invariant mode (pagedkv.numerics): opt-in, effective, and refused with the fix when
it is asked for too late. Each case runs in a fresh interpreter, since MKL fixes its mode at
the first matrix product of a process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROW_CHECK = """
import torch
torch.manual_seed(0)
w, x = torch.randn(1536, 576), torch.randn(64, 576)
full = torch.nn.functional.linear(x, w)
print(all(torch.equal(torch.nn.functional.linear(x[:m], w), full[:m]) for m in (1, 2, 3, 8, 15)))
"""


def run_py(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("MKL_CBWR", "PAGEDKV_BATCH_INVARIANT")}
    return subprocess.run([sys.executable, "-c", code], env=base | env, capture_output=True, text=True,
                          timeout=120)


def test_env_var_sets_strict_mode_and_rows_do_not_depend_on_batch():
    out = run_py("import os, pagedkv; print(os.environ.get('MKL_CBWR'))" + ROW_CHECK,
                 PAGEDKV_BATCH_INVARIANT="1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["AUTO,STRICT", "True"]


def test_default_leaves_mkl_alone():
    out = run_py("import os, pagedkv; from pagedkv.numerics import is_batch_invariant;"
                 "print(os.environ.get('MKL_CBWR'), is_batch_invariant())")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "False"]


def test_enable_before_first_matmul_works():
    out = run_py("from pagedkv.numerics import enable_batch_invariance as e; e(); e()" + ROW_CHECK)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"]


def test_enable_after_a_matmul_raises_with_the_fix():
    out = run_py("import torch; torch.randn(4, 4) @ torch.randn(4, 4)\n"
                 "from pagedkv.numerics import enable_batch_invariance\n"
                 "try:\n    enable_batch_invariance()\nexcept RuntimeError as e:\n    print('refused:', e)")
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "PAGEDKV_BATCH_INVARIANT=1" in out.stdout


@pytest.mark.parametrize("value", ["0", "", "no"])
def test_falsy_env_values_do_not_enable(value):
    out = run_py("import os, pagedkv; print(os.environ.get('MKL_CBWR'))", PAGEDKV_BATCH_INVARIANT=value)
    assert out.stdout.split() == ["None"]


def test_cli_flag_reaches_the_engine_config():
    from pagedkv.cli import build_parser, engine_kwargs
    from pagedkv.config import EngineConfig

    a = build_parser().parse_args(["generate", "--batch-invariant", "hi"])
    assert EngineConfig(**engine_kwargs(a)).batch_invariant is True
    a = build_parser().parse_args(["generate", "hi"])
    assert EngineConfig(**engine_kwargs(a)).batch_invariant is False
