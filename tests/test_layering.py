"""Layering of ``src/pagedkv``, checked on the source with :mod:`ast` (no import side effects).

- No import cycles: every import counts, module- or function-level (a lazy import still ties
  two modules together), except under ``if TYPE_CHECKING:``. An import of a module's own
  parent package is not an edge (Python runs the parent first anyway).
- ``kv/`` is the bottom layer: it imports nothing of pagedkv outside ``kv/``; its bookkeeping
  (pool, manager, hashing, spec) imports no torch, so the scheduler side and the planner run
  without it. The runtime check runs in a fresh interpreter, so that other tests' imports
  cannot hide a torch import.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "pagedkv"
KV_BOOKKEEPING = ("block_pool", "hashing", "manager", "spec")


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``pkg.__init__`` -> ``pkg``)."""
    out = {}
    for path in PKG.rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.dump(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def imported_names(name: str, path: Path) -> set[str]:
    """Every dotted name ``path`` imports (``from a import b`` gives ``a`` and ``a.b``)."""
    tree, out = ast.parse(path.read_text()), set()
    skip = _type_checking_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                parts = name.split(".")[: len(name.split(".")) - node.level + path.name.count("__init__")]
                base = ".".join(parts + ([node.module] if node.module else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports (own ancestors left out)."""
    modules = module_files()
    graph = {}
    for name, path in modules.items():
        targets = {_resolve(t, modules) for t in imported_names(name, path) if t.split(".")[0] == "pagedkv"}
        graph[name] = {t for t in targets if t and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, 1972)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on_stack.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert len(graph) > 50
    # pagedkv.cli imports the subcommand modules inside build_parser()
    assert {"pagedkv.planner.cli", "pagedkv.server.cli"} <= graph["pagedkv.cli"]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_kv_imports_nothing_above_kv():
    graph = import_graph()
    for name in (m for m in graph if m.startswith("pagedkv.kv.")):
        above = sorted(t for t in graph[name] if not t.startswith("pagedkv.kv"))
        assert above == [], f"{name} imports {above}"


@pytest.mark.parametrize("module", KV_BOOKKEEPING)
def test_kv_bookkeeping_source_imports_no_torch(module):
    path = PKG / "kv" / f"{module}.py"
    names = imported_names(f"pagedkv.kv.{module}", path)
    assert not any(n.split(".")[0] in ("torch", "numpy") for n in names), names


def test_kv_bookkeeping_loads_without_torch():
    """The issue's own check, in a fresh interpreter; the shared config parser too."""
    code = ("import sys, pagedkv.kv.block_pool, pagedkv.kv.manager, pagedkv.kv.hashing, pagedkv.kv.spec; "
            "assert 'torch' not in sys.modules, 'torch was imported'; "
            "import pagedkv.model.hf_config; assert 'torch' not in sys.modules, 'the config parser imported torch'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr


def test_top_level_names_load_on_first_use():
    code = ("import sys, pagedkv; assert 'torch' not in sys.modules; "
            "from pagedkv import LLM, SamplingParams, EngineConfig, RequestOutput, plan; "
            "assert 'torch' in sys.modules and callable(plan) and LLM.__name__ == 'LLM'; "
            "assert set(pagedkv.__all__) <= set(dir(pagedkv))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
