"""What ``pagedkv`` and its subcommand modules (bench, eval, serve) share: the argparse
parser that reports a mistake in one line, and the engine flags.

The engine flags are generated from :class:`~pagedkv.config.engine.EngineConfig`: one flag per
field (``block_size`` -> ``--block-size``, vLLM's names), its default the field's default
and its help the field's entry in the class docstring (``Attributes:``), with
``field_name`` references written as ``--field-name`` and ``(default: ...)`` added
unless the text speaks of the default itself. :data:`FLAG_OPTIONS` adds what a docstring
cannot say: choices, booleans as switches. So a default lives in ``config.py`` only.

This module sits below ``pagedkv.cli`` and the subcommand modules, which all import it
(and not each other).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import typing

from pagedkv.config.engine import (
    ACTIVATION_DTYPES,
    DEVICES,
    DTYPES,
    KV_ALLOCATORS,
    KV_CACHE_DTYPES,
    KV_CACHE_SCALES,
    KV_EVICTIONS,
    KV_OFFLOAD_POLICIES,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    STREAMING_POSITIONS,
    WEIGHT_DTYPES,
    EngineConfig,
)

#: argparse options per field beyond type, default and help; fields absent here are
#: plain typed flags. ``None`` marks a field that is not a flag.
FLAG_OPTIONS: dict[str, dict | None] = {
    "kv_cache_dtype": {"choices": KV_CACHE_DTYPES},
    "kv_cache_scale": {"choices": KV_CACHE_SCALES},
    "kv_allocator": {"choices": KV_ALLOCATORS},
    "scheduling_policy": {"choices": SCHEDULING_POLICIES},
    "weight_dtype": {"choices": WEIGHT_DTYPES},
    "activation_dtype": {"choices": ACTIVATION_DTYPES},
    "device": {"choices": DEVICES},
    "dtype": {"choices": DTYPES},
    "kv_eviction": {"choices": KV_EVICTIONS},
    "streaming_positions": {"choices": STREAMING_POSITIONS},
    "kv_offload_policy": {"choices": KV_OFFLOAD_POLICIES},
    "preemption_mode": {"choices": PREEMPTION_MODES},
    "debug_invariants": None,  # a testing aid, set from Python (tests, benchmarks)
}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one ``error: ...`` line (exit 2)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> its text in the ``Attributes:`` section of ``cls``'s docstring (one line)."""
    docs, name, section = {}, None, False
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        if not line.startswith(" "):
            section, name = line.strip() == "Attributes:", None
        elif section and (m := re.fullmatch(r" {4}(\w+): (.*)", line)):
            name, docs[m.group(1)] = m.group(1), m.group(2)
        elif section and name and line.strip():
            docs[name] += " " + line.strip()
    return docs


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def help_text(doc: str, field_names: set[str], default) -> str:
    """A docstring entry as CLI help: reST markup dropped, ``field`` -> ``--field``, the default added."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", doc.replace("%", "%%"))
    text = re.sub(r"``(\w+)``", lambda m: flag(m.group(1)) if m.group(1) in field_names else m.group(1), text)
    text = text.replace("``", "").rstrip(".")
    if default is None or default is False or "default" in text:
        return text
    return text + (" (default: on)" if default is True else " (default: %(default)s)")


def _argparse_type(hint) -> type | None:
    """``int`` / ``float`` for such fields (``| None`` too); ``None`` (text) for the rest
    (``int | str``: a size)."""
    args = set(typing.get_args(hint)) - {type(None)} or {hint}
    return int if args == {int} else float if args == {float} else None


def engine_fields() -> list[dataclasses.Field]:
    """The :class:`EngineConfig` fields that are flags, in declaration order."""
    return [f for f in dataclasses.fields(EngineConfig) if FLAG_OPTIONS.get(f.name, {}) is not None]


def add_engine_args(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """Add the ``engine`` flag group to ``p`` (see the module docstring); ``defaults``: this
    command's own default for some fields (its help says it instead of the docstring's)."""
    g = p.add_argument_group("engine")
    defaults = defaults or {}
    docs, hints = attribute_docs(EngineConfig), typing.get_type_hints(EngineConfig)
    names = {f.name for f in engine_fields()}
    for f in engine_fields():
        kw = dict(default=f.default, help=help_text(docs[f.name], names, f.default)) | FLAG_OPTIONS.get(f.name, {})
        if f.name in defaults:  # the docstring's "(default: ...)" is the engine's, not this command's
            text = kw["help"]
            kw.update(default=defaults[f.name], help=text[:text.rfind(" (default")] if " (default" in text else text)
            kw["help"] += " (default: %(default)s)"
        if hints[f.name] is bool:
            kw["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
        elif _argparse_type(hints[f.name]) is not None:
            kw["type"] = _argparse_type(hints[f.name])
        g.add_argument(flag(f.name), **kw)


def engine_kwargs(a: argparse.Namespace) -> dict:
    """:class:`EngineConfig` keyword arguments from parsed engine flags."""
    return {f.name: getattr(a, f.name) for f in engine_fields()}
