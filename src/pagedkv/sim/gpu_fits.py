"""Measured cost-model factors for GPUs: ``pagedkv simulate --efficiency GPU/MODEL | FILE``.

Catalog GPUs are priced on the plain roofline by default (:mod:`pagedkv.sim.cost`). A
fit replaces it with efficiency factors and overheads measured on a real GPU: the bundled
ones (``planner/data/gpu_fits.json``) were fitted to CUDA-graph steps of plain-torch
decoders of a catalog model's shape (``benchmarks/gpu_step_profile.py``, fitted by
``benchmarks/gpu_step_fit.py``; figures and method in BENCHMARKS.md, "The cost model on
an H200"). They describe torch's cuBLAS products and flash attention without fused
kernels, about half the roofline: a lower bound on what an optimized engine reaches.
Each is fitted to one model's shapes (a fit missed the other models' steps by 3-45% in
the median): pick the one closest to the model simulated.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from importlib import resources
from pathlib import Path

from pagedkv.sim.cost import Efficiency

ROOFLINE = "roofline"


@lru_cache(maxsize=1)
def bundled() -> dict[str, dict]:
    """The bundled fits by name (``GPU/MODEL``)."""
    data = json.loads(resources.files("pagedkv.planner").joinpath("data/gpu_fits.json").read_text())
    return {f["name"]: f for f in data["fits"]}


def fit_mismatch(name, gpu: str, model: str, tp: int) -> str | None:
    """Why bundled fit ``name`` was not measured for this simulation (another GPU, model or
    tensor-parallel rank shape), or None (a match, or not a bundled name)."""
    entry = bundled().get(name) if isinstance(name, str) else None
    if entry is None:
        return None
    fit_model, _, fit_tp = entry["model"].partition(":tp")
    got, want = (gpu, model.lower(), tp), (entry["gpu"], fit_model, int(fit_tp or 1))
    if got == want:
        return None
    return (f"--efficiency {name} was fitted on {want[0]} to {want[1]} at tp {want[2]}, not {gpu} / {model} at "
            f"tp {tp}: its factors missed other models' steps by 3-45% (BENCHMARKS.md)")


def _efficiency(entry: dict, where: str) -> Efficiency:
    fields = entry.get("efficiency", entry) if isinstance(entry, dict) else None
    if not isinstance(fields, dict):
        raise ValueError(f"{where}: expected a JSON object with the efficiency fields (or under \"efficiency\")")
    known = set(Efficiency.__dataclass_fields__)
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{where}: unknown efficiency field(s) {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(known))}")
    try:
        return Efficiency(**{"source": f"given in {where}", **fields})
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from None


def load_efficiency(name_or_path: str | os.PathLike) -> Efficiency:
    """The factors named: ``roofline`` (none), a bundled fit (``h200/llama-3-8b``, see
    :func:`bundled`) or a JSON file holding the :class:`Efficiency` fields (at top level or
    under ``"efficiency"``, as ``gpu_step_fit.py --json`` writes them).

    Raises:
        ValueError: an unknown name, an unreadable or malformed file, or a factor out of range.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(f"efficiency: an Efficiency, {ROOFLINE!r}, a bundled fit name or a JSON file's path, "
                         f"got {type(name_or_path).__name__}")
    if name_or_path == ROOFLINE:
        return Efficiency()
    if isinstance(name_or_path, str) and name_or_path in bundled():
        return _efficiency(bundled()[name_or_path], f"bundled fit {name_or_path}")
    where = os.fspath(name_or_path)
    path = Path(where)
    if not path.is_file():
        raise ValueError(f"efficiency {where!r}: not {ROOFLINE!r}, a bundled fit "
                         f"({', '.join(bundled())}) or a JSON file")
    try:
        entry = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:  # ValueError: JSON's and int digits
        raise ValueError(f"efficiency {where}: not readable JSON ({str(e)[:200]})") from None
    return _efficiency(entry, where)
