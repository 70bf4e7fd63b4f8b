"""The kernels' AVX2 code paths (paged attention, int8, GGML-block and W8A8 linear, the
one-call decoder layer), on a machine with AVX-512.

The kernel picks vector code by the ISA it is compiled for (a 16-float vector is one
AVX-512 register or two AVX2 ones, and a few helpers have AVX2 versions), and CI may run on
either CPU kind. Where ``-march=native`` is AVX-512, this builds the kernel again with
``PAGEDKV_KERNEL_MARCH=x86-64-v3`` (AVX2 + FMA) and runs the kernel's test files against
that build in a subprocess: the same checks against the reference, the same bit-identical
invariances. On an AVX2-only CPU the native build already is that build, so it skips.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


@pytest.mark.skipif(platform.machine() != "x86_64" or not {"avx2", "fma", "avx512f"} <= _cpu_flags(),
                    reason="needs an x86-64 CPU with AVX-512 (on AVX2-only CPUs the native build is the AVX2 one)")
def test_the_avx2_build_passes_the_kernel_tests():
    env = dict(os.environ, PAGEDKV_KERNEL_MARCH="x86-64-v3")
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts=", "-q",
                        str(HERE / "test_attention_kernel.py"), str(HERE / "test_attention_kernel_quant.py"),
                        str(HERE / "test_int8_weights.py"), str(HERE / "test_ggml_weights.py"),
                        str(HERE / "test_layer_ops.py"), str(HERE / "test_w8a8.py"),
                        str(HERE / "test_ggml_a8.py"), str(HERE / "test_decoder_layer.py"), "-k",
                        "not cli and not planner and not hf"],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "skipped" not in r.stdout.split("\n")[-2], r.stdout[-500:]


def test_a_bad_march_is_refused(monkeypatch):
    from pagedkv.kernels.cpu import library as kernel

    monkeypatch.setenv("PAGEDKV_KERNEL_MARCH", "native -fplugin=evil")
    with pytest.raises(ValueError, match="PAGEDKV_KERNEL_MARCH"):
        kernel.cflags()
