"""The paged_attention dispatcher: PAGEDKV_ATTENTION=auto|kernel|reference, one warning and
the reference when the kernel cannot be built (simulated, and for real with no compiler in
a fresh cache), a build attempted at most once per process, and silent fallback for inputs
the kernel does not cover."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from test_attention_kernel import make_batch

from pagedkv.attention.dispatch import paged_attention
from pagedkv.attention.reference import paged_attention_reference
from pagedkv.kernels.cpu import library as kernel
from pagedkv.kernels.cpu import ops as dispatch
from pagedkv.kernels.cpu.library import KernelBuildError


@pytest.fixture
def unbuildable(monkeypatch):
    """A process where the kernel build fails; counts build attempts."""
    calls = []

    def fail():
        calls.append(1)
        raise RuntimeError("Error building extension 'pagedkv_attention'\nc++: not found")

    monkeypatch.setattr(kernel, "_state", {})
    monkeypatch.setattr(dispatch, "_warned", [])
    monkeypatch.setattr(kernel, "_build", fail)
    return calls


def inputs(head_dim=64):
    q, k, v, meta = make_batch([(1, 40), (9, 30)], head_dim=head_dim)
    return q, k, v, meta, head_dim ** -0.5


def test_reference_mode_never_builds(monkeypatch, unbuildable):
    monkeypatch.setenv("PAGEDKV_ATTENTION", "reference")
    args = inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(paged_attention(*args), paged_attention_reference(*args))
    assert unbuildable == []


def test_kernel_mode_uses_the_kernel(monkeypatch):
    monkeypatch.setenv("PAGEDKV_ATTENTION", "kernel")
    q, k, v, meta, scale = inputs()
    expected = kernel.load_kernel()(q, k, v, *meta.packed, scale)
    assert torch.equal(paged_attention(q, k, v, meta, scale), expected)


def test_auto_is_the_default_and_matches_reference(monkeypatch):
    monkeypatch.delenv("PAGEDKV_ATTENTION", raising=False)
    assert dispatch.attention_mode() == "auto"
    args = inputs()
    torch.testing.assert_close(paged_attention(*args), paged_attention_reference(*args), rtol=1e-5, atol=1e-5)


def test_bad_mode_is_an_error(monkeypatch):
    monkeypatch.setenv("PAGEDKV_ATTENTION", "fast")
    with pytest.raises(ValueError, match="PAGEDKV_ATTENTION"):
        paged_attention(*inputs())


def test_build_failure_warns_once_and_uses_reference(monkeypatch, unbuildable):
    monkeypatch.delenv("PAGEDKV_ATTENTION", raising=False)
    args = inputs()
    with pytest.warns(RuntimeWarning, match="unavailable .*c\\+\\+: not found.*reference"):
        first = paged_attention(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = paged_attention(*args)
    assert torch.equal(first, paged_attention_reference(*args)) and torch.equal(second, first)
    assert len(unbuildable) == 1  # the failure is remembered, not retried per call


def test_forced_kernel_raises_when_unbuildable(monkeypatch, unbuildable):
    monkeypatch.setenv("PAGEDKV_ATTENTION", "kernel")
    with pytest.raises(KernelBuildError, match="not found"):
        paged_attention(*inputs())


def test_uncovered_inputs_use_the_reference(monkeypatch, unbuildable):
    args = inputs(head_dim=24)  # not a head_dim the kernel is instantiated for
    monkeypatch.delenv("PAGEDKV_ATTENTION", raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(paged_attention(*args), paged_attention_reference(*args))
    monkeypatch.setenv("PAGEDKV_ATTENTION", "kernel")
    with pytest.raises(ValueError, match="does not cover"):
        paged_attention(*args)
    assert unbuildable == []


def test_loaded_once_per_process():
    assert kernel.load_kernel() is kernel.load_kernel()


def test_no_compiler_in_a_fresh_cache_falls_back(tmp_path):
    script = textwrap.dedent("""
        import warnings
        import torch
        from pagedkv.attention import paged_attention, paged_attention_reference
        from test_attention_kernel import make_batch
        q, k, v, meta = make_batch([(1, 40), (9, 30)])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outs = [paged_attention(q, k, v, meta, 0.125) for _ in range(3)]
        assert all(torch.equal(o, paged_attention_reference(q, k, v, meta, 0.125)) for o in outs)
        print(len(caught), caught[0].message if caught else "")
    """)
    env = dict(os.environ, CXX=str(tmp_path / "no-such-c++"), XDG_CACHE_HOME=str(tmp_path / "cache"),
               PYTHONPATH=os.path.dirname(__file__), PAGEDKV_ATTENTION="auto")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    count, message = done.stdout.strip().split(" ", 1)
    assert count == "1" and "kernel is unavailable" in message


def test_stale_build_lock_is_removed(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    old = lock.stat().st_mtime - kernel.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    kernel._wait_for_lock(lock)
    assert not lock.exists()
    kernel._wait_for_lock(lock)  # no lock: returns at once


def test_loading_the_kernel_leaves_its_build_directory_where_it_is():
    """torch's cpp_extension.load appends to the flag lists it is given; the directory
    ``pagedkv info`` reports after a load must still be the one holding the library."""
    from pagedkv.kernels.cpu import library as kernel

    try:
        kernel.load_kernel()
    except kernel.KernelBuildError as e:
        pytest.skip(f"no kernel on this machine: {e}")
    assert (kernel.build_directory() / "pagedkv_attention.so").exists()


def test_the_build_runs_this_environments_ninja_first(tmp_path):
    """cpp_extension runs the first ninja on PATH; ours (pyproject's ninja package) goes first,
    listed once, so a shell with and without the virtual environment on PATH share one build."""
    env_bin = tmp_path / "venv" / "bin"
    env_bin.mkdir(parents=True)
    path = os.pathsep.join(["/usr/local/bin", str(env_bin), "/usr/bin"])
    assert kernel.ninja_search_path(path, env_bin) == path  # no ninja there: PATH as it was
    (env_bin / "ninja").write_text("")
    assert kernel.ninja_search_path(path, env_bin) == os.pathsep.join([str(env_bin), "/usr/local/bin", "/usr/bin"])


def test_a_load_without_the_environment_on_path_does_not_rebuild():
    """`make run` calls .venv/bin/pagedkv with the system's PATH; an activated .venv puts its own
    ninja first. A second ninja version discarded the first's build log and rebuilt (~40 s)."""
    try:
        kernel.load_kernel()
    except kernel.KernelBuildError as e:
        pytest.skip(f"no kernel on this machine: {e}")
    library = kernel.build_directory() / "pagedkv_attention.so"
    before = library.stat().st_mtime_ns
    script = "from pagedkv.kernels.cpu import library; library.load_kernel()"
    env = dict(os.environ, PATH=os.pathsep.join(p for p in ("/usr/local/bin", "/usr/bin", "/bin") if os.path.isdir(p)))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert library.stat().st_mtime_ns == before, "the kernels were compiled again"


def test_build_directory_names_the_source_version(tmp_path, monkeypatch):
    """Checkouts of different kernel sources must not share (and rebuild over) one library."""
    from pagedkv.kernels.cpu import library as kernel

    src = tmp_path / "csrc"
    shutil.copytree(kernel.CSRC, src)
    monkeypatch.setattr(kernel, "CSRC", src)
    before = kernel.build_directory()
    (src / "vec.h").write_text((src / "vec.h").read_text() + "\n// changed\n")
    assert kernel.build_directory() != before and kernel.build_directory().parent == before.parent


def test_old_builds_of_other_versions_are_pruned_and_others_kept(tmp_path):
    """Unused builds of other versions go; the current one, recent ones, one mid-build and
    folders that are not builds stay."""
    root = tmp_path / "torch_extensions"
    current = root / "torch2.13.0-py311-cpuaaaa-srcnew"
    old = root / "torch2.13.0-py311-cpuaaaa-srcold"
    recent = root / "torch2.13.0-py311-cpuaaaa-srcrecent"
    building = root / "torch2.13.0-py311-cpuaaaa-srcbuilding"
    other = root / "not-a-build"
    for d in (current, old, recent, building, other):
        d.mkdir(parents=True)
        (d / "pagedkv_attention.so").write_bytes(b"x")
    (building / "lock").touch()
    now = current.stat().st_mtime
    stale = now - kernel.PRUNE_AFTER_S - 60
    for d in (current, old, building, other):
        os.utime(d, (stale, stale))
    removed = kernel.prune_builds(current, now=now)
    assert removed == [old] and not old.exists()
    assert all(d.exists() for d in (current, recent, building, other))
    assert kernel.prune_builds(root / "missing" / "x", now=now) == []  # no cache folder: nothing, no error
