"""Model shapes for the planner: a bundled name or a Hugging Face ``config.json``.

Bundled configs live in ``planner/data/models/<name>.json`` as
``{"name", "source", "notes", "config": {...}}`` where ``config`` holds keys copied
from the model's Hugging Face config.json (``source`` is its URL). A path to any
config.json (or to a folder holding one) is read the same way. Both go through the
engine's own parser (:mod:`pagedkv.model.hf_config`) into its
:class:`~pagedkv.model.config.ModelConfig`, whose :meth:`~pagedkv.model.config.ModelConfig.kv_spec`
is the cache the engine allocates.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from pagedkv.model.config import ModelConfig
from pagedkv.model.hf_config import load_config, parse

_DATA = "data/models"


def bundled_names() -> list[str]:
    """Names of the bundled model configs, sorted."""
    folder = resources.files("pagedkv.planner").joinpath(_DATA)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def bundled_entry(name: str) -> dict:
    """The raw bundled entry ``{"name", "source", "notes", "config"}`` for ``name``."""
    text = resources.files("pagedkv.planner").joinpath(f"{_DATA}/{name}.json").read_text()
    return json.loads(text)


def load_model(name_or_path: str) -> ModelConfig:
    """A bundled model by name (case-insensitive), or a config.json path / folder holding one.

    Raises:
        ValueError: unknown name, unreadable or malformed config.json, or missing keys.
    """
    key = str(name_or_path).strip()
    if key.lower() in bundled_names():
        entry = bundled_entry(key.lower())
        return parse(entry["config"], entry["name"], entry["source"])
    path = Path(key).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.suffix.lower() == ".gguf":
        raise ValueError(f"{name_or_path!r} is a GGUF file: the planner and the simulator read a model's shape from "
                         "a bundled name (pagedkv plan --list-models) or a Hugging Face config.json (or its folder)")
    if not path.is_file():
        raise ValueError(f"unknown model {name_or_path!r}: not a bundled name (see --list-models) "
                         "and no config.json at that path")
    return load_config(path)
