"""Batch-invariant numerics on CPU: MKL conditional numerical reproducibility (CNR).

By default pagedkv lets MKL pick its fastest kernels. For fewer than 16 rows MKL's fp32
GEMM then takes a GEMV-like path whose reduction order differs from the one used for
16+ rows, so a row's result (to the last bit) depends on how many rows share the product:
a request's logits move by ~1e-5 with the batch around it, and a greedy near-tie can flip.

Batch-invariant mode (``MKL_CBWR=AUTO,STRICT``) makes every row independent of M, so
greedy outputs are bit-identical for batch size 1 and N, under chunked prefill,
preemption and prefix hits. Measured on the 2-core CPU this project targets
(SmolLM2-135M, fp32, 2 threads): single-stream decode 15.4 tok/s strict vs 27.2 tok/s
default; products of 16+ rows run at the same speed either way.

Turn it on with ``PAGEDKV_BATCH_INVARIANT=1`` in the environment (read when ``pagedkv``
is imported), ``--batch-invariant`` on the CLI, or ``EngineConfig(batch_invariant=True)``.
MKL fixes the mode at its first call in a process, so the last two work only before any
matrix product has run; otherwise they raise with the environment-variable fix. Once on,
the mode holds for the whole process: a later engine built with ``batch_invariant=False``
still runs strict.

Source: Intel oneMKL Developer Reference, "Conditional Numerical Reproducibility
Control" (``mkl_cbwr_set``; ``MKL_CBWR_AUTO`` = 2, ``MKL_CBWR_STRICT`` = 0x10000,
``MKL_CBWR_ERR_MODE_CHANGE_FAILURE`` = -8).
"""

from __future__ import annotations

import ctypes
import os

ENV = "PAGEDKV_BATCH_INVARIANT"
STRICT_SETTING = "AUTO,STRICT"
_MKL_CBWR_AUTO = 2
_MKL_CBWR_STRICT = 0x10000
_MKL_CBWR_SUCCESS = 0
_MODE_CHANGE_FAILURE = -8


def env_requests_invariance() -> bool:
    """True when ``PAGEDKV_BATCH_INVARIANT`` is set to 1/true/yes/on (case-insensitive)."""
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")


def apply_env() -> None:
    """At import: ``PAGEDKV_BATCH_INVARIANT=1`` sets ``MKL_CBWR=AUTO,STRICT`` unless the
    user set ``MKL_CBWR`` themselves (theirs wins)."""
    if env_requests_invariance():
        os.environ.setdefault("MKL_CBWR", STRICT_SETTING)


def is_batch_invariant() -> bool:
    """Whether this process asked MKL for strict CNR (via the environment or
    :func:`enable_batch_invariance`)."""
    return "STRICT" in os.environ.get("MKL_CBWR", "").upper()


def _mkl_cbwr_set():
    import torch

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    fn = getattr(lib, "mkl_serv_cbwr_set", None) or getattr(lib, "mkl_cbwr_set", None)
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def enable_batch_invariance() -> None:
    """Switch this process to MKL strict CNR (see the module doc).

    Raises:
        RuntimeError: if this torch build has no MKL to switch, or MKL already ran in this
            process (the mode is fixed at its first call): start Python with
            ``PAGEDKV_BATCH_INVARIANT=1`` instead.
    """
    if is_batch_invariant():
        return
    try:
        fn = _mkl_cbwr_set()
    except OSError:
        fn = None
    if fn is None:
        raise RuntimeError("batch-invariant mode needs torch's MKL (mkl_cbwr_set not found in this build)")
    status = fn(_MKL_CBWR_AUTO | _MKL_CBWR_STRICT)
    if status == _MODE_CHANGE_FAILURE:
        raise RuntimeError(f"batch-invariant mode must be chosen before the process's first matrix product: "
                           f"start Python with {ENV}=1 (or MKL_CBWR={STRICT_SETTING})")
    if status != _MKL_CBWR_SUCCESS:
        raise RuntimeError(f"mkl_cbwr_set({STRICT_SETTING}) failed with status {status}")
    os.environ["MKL_CBWR"] = STRICT_SETTING  # children (e.g. kernel builds, subprocesses) inherit it
