"""Build (JIT, at first use) and load the CPU kernels: fused paged attention and the
weight-only int8 linear layer (``torch.ops.pagedkv.int8_linear``), one library.

The C++ sources in ``csrc/`` are compiled once by ``torch.utils.cpp_extension.load``
(ninja; ``-O3 -march=native -fopenmp``; about a minute on 2 idle cores, once per source version) into
``$XDG_CACHE_HOME/pagedkv/torch_extensions/<tag>`` (``~/.cache`` when unset), and the
library registers ``torch.ops.pagedkv.paged_attention``. The tag names the torch and Python
versions, a hash of the CPU's model and flags (``-march=native`` code need not run on
another CPU) and a hash of the sources, so checkouts of different versions never rebuild
over each other's library. A later load, in this process or another, finds the library up to date and
skips the compile. Concurrent builds wait on torch's lock file in the build directory; a lock
older than ``STALE_LOCK_S`` (its builder was killed mid-build) is removed rather than waited
on forever. After a new build, other versions' builds that no process has loaded for
``PRUNE_AFTER_S`` (30 days) are removed (:func:`prune_builds`).

``PAGEDKV_KERNEL_MARCH`` (default ``native``) sets ``-march``: ``x86-64-v3`` builds the
AVX2 code paths on an AVX-512 machine, so both are tested wherever the tests run (the
kernel picks its vector code by the ISA it is compiled for; a 16-float vector is one
AVX-512 register or two AVX2 ones).
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCES = ("paged_attention_kernel.cpp", "paged_attention_op.cpp", "int8_linear.cpp", "ggml_linear.cpp",
           "ggml_linear_widened.cpp", "layer_ops.cpp", "copy_blocks.cpp", "decoder_layer.cpp", "w8a8_linear.cpp",
           "ggml_a8_linear.cpp")
_MARCH = re.compile(r"[A-Za-z0-9._-]+")
LDFLAGS = ["-fopenmp"]  # never handed to torch itself: cpp_extension.load appends to the list it gets
HEAD_DIMS = frozenset({16, 32, 48, 64, 80, 96, 128, 256})  # instantiated in the kernel
KV_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
QUANTIZED_KV_DTYPES = frozenset({torch.int8, torch.float8_e4m3fn, torch.float8_e5m2})  # with fp32 scales
STALE_LOCK_S = 300.0  # a build takes about 15 s
PRUNE_AFTER_S = 30 * 86400.0  # another version's build unused this long is removed after a new build


class KernelBuildError(RuntimeError):
    """The kernel could not be compiled or loaded here (no compiler, no ninja, a build error)."""


def cpu_fingerprint() -> str:
    """Short hash of this CPU's model name and feature flags (``/proc/cpuinfo`` where present)."""
    text = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            text += "".join(line for line in f if line.startswith(("model name", "flags", "Features")))
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def cflags() -> list[str]:
    """The compiler flags: ``-O3 -march=$PAGEDKV_KERNEL_MARCH (native) -fopenmp``.

    Raises:
        ValueError: a ``PAGEDKV_KERNEL_MARCH`` that is not a plain architecture name.
    """
    march = os.environ.get("PAGEDKV_KERNEL_MARCH", "native").strip() or "native"
    if not _MARCH.fullmatch(march):
        raise ValueError(f"PAGEDKV_KERNEL_MARCH={march!r} is not an architecture name (e.g. native, x86-64-v3)")
    return ["-O3", f"-march={march}", "-fopenmp"]


def source_fingerprint() -> str:
    """Short hash of the kernel's C++ sources, their folder and the build flags. The folder
    counts because torch's ``build.ninja`` records absolute source paths: two checkouts of
    the same sources sharing a build folder rebuilt over each other on every other load."""
    h = hashlib.sha256(" ".join(cflags() + LDFLAGS).encode() + str(CSRC.resolve()).encode())
    for path in sorted(CSRC.iterdir()):
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:12]


def build_directory() -> Path:
    """Where the compiled library lives; created on demand."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tag = (f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-cpu{cpu_fingerprint()}"
           f"-src{source_fingerprint()}")
    return cache / "pagedkv" / "torch_extensions" / tag.replace("+", "_")


def ninja_search_path(path: str | None = None, env_bin: Path | None = None) -> str:
    """``PATH`` for the build: this interpreter's environment's ``bin`` first where it holds
    ``ninja`` (the ``ninja`` package pyproject.toml requires), else ``path`` unchanged.

    torch's ``cpp_extension`` runs whichever ``ninja`` ``PATH`` finds first, and two ninja
    versions keep their build logs in different formats, each discarding the other's: `make
    run` (no virtual environment on ``PATH``: the system's ninja) and an activated ``.venv``
    then rebuilt the kernels for each other, ~40 s a switch, without the compile notice.
    """
    path = os.environ.get("PATH", "") if path is None else path
    env_bin = Path(sys.executable).parent if env_bin is None else env_bin  # not resolved: a venv links its python
    if not (env_bin / "ninja").is_file():
        return path
    rest = [p for p in path.split(os.pathsep) if p and Path(p) != env_bin]
    return os.pathsep.join([str(env_bin), *rest])


def _build() -> Callable[..., torch.Tensor]:
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler: {compiler!r} is not on PATH")
    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    _wait_for_lock(directory / "lock")
    fresh = not (directory / "pagedkv_attention.so").exists()
    if fresh:  # say why the first run is slow
        print(f"pagedkv: compiling the CPU kernels into {directory} (once per source version, "
              "about a minute on 2 idle cores)", file=sys.stderr, flush=True)
    path = os.environ.get("PATH")
    os.environ["PATH"] = ninja_search_path()
    try:
        cpp_extension.load(name="pagedkv_attention", sources=[str(CSRC / s) for s in SOURCES],
                           extra_cflags=cflags(), extra_ldflags=list(LDFLAGS), build_directory=str(directory),
                           is_python_module=False, verbose=False)
    finally:
        if path is None:
            os.environ.pop("PATH", None)
        else:
            os.environ["PATH"] = path
    try:
        os.utime(directory)  # in use: prune_builds keeps it
    except OSError:
        pass
    if fresh:
        prune_builds(directory)
    return torch.ops.pagedkv.paged_attention


def prune_builds(current: Path, now: float | None = None) -> list[Path]:
    """Remove the other builds beside ``current`` (folders named like :func:`build_directory`'s
    tags) that no process loaded for ``PRUNE_AFTER_S`` (a load touches its folder), so that
    upgrades and checkouts do not pile up libraries (~2 MB each) in the cache forever. A
    folder holding a lock (a build under way) is kept. Best effort: a folder that cannot be
    read or removed is left. Returns the folders removed."""
    now = time.time() if now is None else now
    removed = []
    try:
        siblings = list(current.parent.iterdir())
    except OSError:
        return removed
    for d in siblings:
        if d == current or not d.name.startswith("torch") or "-src" not in d.name or (d / "lock").exists():
            continue
        try:
            if d.is_dir() and now - d.stat().st_mtime > PRUNE_AFTER_S:
                shutil.rmtree(d)
                removed.append(d)
        except OSError:
            continue
    return removed


def _wait_for_lock(lock: Path) -> None:
    """Wait while another process builds; remove its lock once older than STALE_LOCK_S."""
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return
        if age > STALE_LOCK_S:
            lock.unlink(missing_ok=True)
            return
        time.sleep(0.5)


def _summary(e: Exception) -> str:
    """One line of a build failure: its first compiler error, else its last line."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() and not ln.startswith("Error building")]
    return f"{type(e).__name__}: {(errors or lines or ['?'])[0 if errors else -1]}"


_state: dict[str, object] = {}


def load_kernel() -> Callable[..., torch.Tensor]:
    """``torch.ops.pagedkv.paged_attention``, compiling it on the first call of the process.

    The op: ``(q, k_cache, v_cache, seq_info, block_tables, scale, split=-1, k_scale=None,
    v_scale=None) -> out``, shapes as in :mod:`pagedkv.attention.reference` (``seq_info``/
    ``block_tables`` from ``AttentionMetadata.packed``); ``split`` 0/1 forbids/forces running a
    sequence's context partitions on separate threads (results are bit-identical either way;
    -1 decides). int8/fp8 caches need their fp32 scales (``LayerKV.k_scale``/``v_scale``); each
    page is dequantized inside the kernel into an L1-sized buffer, so only the stored bytes
    are read from memory.

    Raises:
        KernelBuildError: if it cannot be built or loaded; remembered, so later calls raise
            at once instead of compiling again.
    """
    if "op" not in _state:
        if "error" in _state:
            raise _state["error"]  # type: ignore[misc]
        try:
            _state["op"] = _build()
        except Exception as e:  # noqa: BLE001 - any build failure means "no kernel here"
            _state["error"] = e if isinstance(e, KernelBuildError) else KernelBuildError(_summary(e))
            raise _state["error"] from e  # type: ignore[misc]
    return _state["op"]  # type: ignore[return-value]


def kernel_supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    k_scale: torch.Tensor | None = None) -> bool:
    """Whether the kernel covers these inputs (CPU, fp32 queries, contiguous caches of one
    supported dtype, a head_dim it is instantiated for, whole GQA groups; int8/fp8 caches
    with their scales)."""
    dtypes = QUANTIZED_KV_DTYPES if k_scale is not None else KV_DTYPES
    return (q.device.type == k_cache.device.type == v_cache.device.type == "cpu"
            and q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype and k_cache.dtype in dtypes
            and q.shape[-1] in HEAD_DIMS and q.shape[1] % k_cache.shape[2] == 0
            and k_cache.is_contiguous() and v_cache.is_contiguous())
