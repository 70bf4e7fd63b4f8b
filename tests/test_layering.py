"""Layering of ``src/pagedkv``, checked on the source with :mod:`ast` (no import side effects).

The rooms and what each may import (``ALLOWED``: docs/architecture.md draws the same):
``config`` and ``kv`` at the bottom; ``kv_cache`` (the page tensors) on ``kv``; ``kernels`` <
``attention`` < ``model``; ``connectors``
(the KV connector seam); ``planner``; ``core`` (the scheduler side, torch-free); ``worker``
(the torch side that executes a step); ``distributed`` (tensor parallelism); ``engine``
(the text side and the one place where parts are put together); then the apps (``server``,
``bench``, ``eval``, ``sim``) and the CLI on top.

- No import cycles: every import counts, module- or function-level (a lazy import still ties
  two modules together), except under ``if TYPE_CHECKING:``. An import of a module's own
  parent package is not an edge (Python runs the parent first anyway).
- Every room imports only the rooms ``ALLOWED`` names, so no two rooms depend on each other.
- ``core``, ``kv`` and ``config`` import no torch, checked in a fresh interpreter (other
  tests' imports cannot hide one there), so the scheduler, the planner and the simulator run
  without it.
- The wiring has one home: one ``Scheduler(...)`` construction in the package, no attribute
  set on another object after it was built (the patterns that did so are named below), and
  the rules once written twice written once.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "pagedkv"
LEAVES = {"config", "kv", "kernels", "data", "numerics", "reprs"}
APPS = {"server", "bench", "eval", "sim"}
ALLOWED = {
    "config": set(), "kv": set(), "data": set(), "numerics": set(), "reprs": set(), "kernels": set(),
    "kv_cache": {"kv"},
    "attention": {"kernels"},
    "model": {"attention", "kernels", "kv", "kv_cache", "config", "numerics", "data"},
    "connectors": {"kv", "kv_cache", "config", "kernels"},
    "planner": {"config", "kv", "model", "connectors", "reprs"},
    "core": {"kv", "config", "connectors", "planner", "reprs"},
    "worker": {"core", "model", "attention", "kernels", "kv", "kv_cache", "config", "data", "numerics"},
    "distributed": {"core", "model", "config"},
    "engine": {"worker", "core", "connectors", "distributed", "model", "attention", "kernels", "kv", "kv_cache",
               "config", "data", "planner", "numerics", "reprs"},
    "cli_common": {"config"},
    "server": {"engine", "core", "config", "model", "kernels", "cli_common", "reprs"},
    "bench": {"engine", "core", "model", "planner", "config", "data", "cli_common", "kernels", "kv", "reprs"},
    "eval": {"engine", "core", "worker", "model", "attention", "kv", "kv_cache", "config", "data", "cli_common",
             "bench", "kernels"},
    "sim": {"bench", "engine", "core", "kv", "model", "planner", "config", "data", "connectors", "cli_common",
            "numerics", "reprs"},
}
ROOMS_OF_CLI = {"cli", "generate_cmd", "info_cmd"}
TORCH_FREE = ("core", "kv", "config")


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


def room(module: str) -> str:
    """The room of a module: its folder under ``pagedkv``, or the top-level module's name
    (the CLI's modules are one room)."""
    part = module.split(".")[1] if module.count(".") else "pagedkv"
    return "cli" if part in ROOMS_OF_CLI else part


def room_edges(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    """(room, room it imports) -> the module imports that make the edge."""
    edges: dict[tuple[str, str], list[str]] = {}
    for name, targets in graph.items():
        for t in targets:
            a, b = room(name), room(t)
            if a != b and a != "pagedkv":
                edges.setdefault((a, b), []).append(f"{name} -> {t}")
    return edges


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


def test_every_room_is_in_the_table():
    rooms = {room(m) for m in import_graph()} - {"pagedkv", "cli"}
    assert rooms == set(ALLOWED), rooms ^ set(ALLOWED)


def test_rooms_import_only_the_rooms_below_them():
    bad = {edge: mods for edge, mods in room_edges(import_graph()).items()
           if edge[0] != "cli" and edge[1] not in ALLOWED[edge[0]]}
    assert bad == {}, "\n".join(f"{a} -> {b}: {mods[:3]}" for (a, b), mods in bad.items())


def test_the_table_itself_has_no_two_way_dependency_and_keeps_the_named_rules():
    for a, below in ALLOWED.items():
        for b in below:
            assert a not in ALLOWED.get(b, set()), f"{a} <-> {b}"
    assert not ALLOWED["kernels"] & {"kv", "connectors", "engine", "worker"}  # kernels never import a tier
    assert not ALLOWED["core"] & {"worker", "engine", "server", "model", "attention", "kernels"}
    assert not ALLOWED["engine"] & APPS  # the engine never imports bench (or any app)
    assert all(not (ALLOWED[r] - LEAVES) for r in LEAVES)


def test_a_planted_back_edge_is_caught():
    graph = import_graph()
    graph["pagedkv.core.scheduler"] = graph["pagedkv.core.scheduler"] | {"pagedkv.worker.model_runner"}
    edges = room_edges(graph)
    assert ("core", "worker") in edges and "worker" not in ALLOWED["core"]


@pytest.mark.parametrize("folder", TORCH_FREE)
def test_torch_free_rooms_import_no_torch_in_source(folder):
    for path in (PKG / folder).rglob("*.py"):
        name = ".".join(path.relative_to(SRC).with_suffix("").parts)
        names = imported_names(name, path)
        assert not any(n.split(".")[0] in ("torch", "numpy") for n in names), (path, names)


def test_torch_free_rooms_load_without_torch():
    """Every module of ``core``, ``kv`` and ``config`` (and the shared config parser) in a
    fresh interpreter: torch stays out of ``sys.modules``."""
    mods = sorted(m for m in module_files() if room(m) in TORCH_FREE) + ["pagedkv.model.hf_config"]
    code = (f"import importlib, sys\nfor m in {mods!r}:\n    importlib.import_module(m)\n"
            "    assert 'torch' not in sys.modules, f'{m} imported torch'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(mods) > 20


def test_top_level_names_load_on_first_use():
    code = ("import sys, pagedkv; assert 'torch' not in sys.modules; "
            "from pagedkv import LLM, SamplingParams, EngineConfig, RequestOutput, plan; "
            "assert 'torch' in sys.modules and callable(plan) and LLM.__name__ == 'LLM'; "
            "assert set(pagedkv.__all__) <= set(dir(pagedkv))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr


# ---- the wiring has one home -----------------------------------------------------------
def _sources() -> dict[str, str]:
    return {str(p.relative_to(PKG)): p.read_text() for p in PKG.rglob("*.py")}


def test_one_scheduler_construction_site():
    sites = [f for f, text in _sources().items() if re.search(r"(?<![\w.])Scheduler\(", text)
             and not f.startswith("connectors/")]  # (connectors' own *Scheduler classes are other names)
    assert sites == ["core/build.py"], sites


#: what once wired parts together after they were built, each now a constructor argument
PATCHES = {
    r"\.scheduler\.requests\s*=": "a connector given the scheduler's live requests",
    r"\brunner\.tier\s*=": "the simulated tier handed to a built runner",
    r"\.schedule\s*=": "a scheduler's schedule() wrapped on the instance",
    r"layer\.window\s*,\s*layer\.sinks\s*=": "streaming's window set on built layers",
    r"\bmodel\.streaming_cache_len\s*=": "streaming's positions set on a built model",
    r"\bmodel\.weight_dtype\s*=": "a weight dtype set on a built model",
    r"set_all_reduce\(": "tensor parallelism's all-reduce set on a built model",
    r"\bsched\w*\.max_num_batched_tokens\s*=": "a scheduler's budget set from outside it",
}


@pytest.mark.parametrize("pattern", sorted(PATCHES))
def test_no_attribute_is_patched_onto_a_built_object(pattern):
    hits = [f for f, text in _sources().items() if re.search(pattern, text)]
    assert hits == [], f"{PATCHES[pattern]}: {hits}"


def _slot_formulas(tree: ast.AST) -> int:
    """``t[i // b] * b + i % b`` in code (docstrings do not count)."""
    n = 0
    for node in ast.walk(tree):
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.right, ast.BinOp)
                and isinstance(node.right.op, ast.Mod) and isinstance(node.left, ast.BinOp)
                and isinstance(node.left.op, ast.Mult) and isinstance(node.left.left, ast.Subscript)
                and isinstance(node.left.left.slice, ast.BinOp) and isinstance(node.left.left.slice.op, ast.FloorDiv)):
            n += 1
    return n


def test_the_slot_formula_is_written_once():
    counts = {f: _slot_formulas(ast.parse(text)) for f, text in _sources().items()}
    assert {f: n for f, n in counts.items() if n} == {"kv/slots.py": 2}  # slot() and slot_mapping()
    assert _slot_formulas(ast.parse("x = table[p // bs] * bs + p % bs")) == 1  # the finder finds one


def test_rules_once_written_twice_have_one_home():
    src = _sources()
    defined = [f for f, text in src.items() if re.search(r"^LOAD_FAILURE_POLICIES\s*=", text, re.M)]
    assert defined == ["config/kv_transfer.py"]
    one_group = [f for f, text in src.items() if "reads_whole_tables(" in text]
    assert sorted(one_group) == ["core/kv_layout.py", "kv/groups.py", "planner/plan.py"]
