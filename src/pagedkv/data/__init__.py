"""The bundled texts every room reads: benchmark prompts, the KV-scale calibration text and
the long text of the eval commands (files and licences: ``data/README.md`` beside this module).

Plain file reading, no tokenizer: :mod:`pagedkv.bench.workloads` turns these into requests,
:mod:`pagedkv.worker.kv_scales` and :mod:`pagedkv.model.w8a8` calibrate on
:func:`calibration_text`, ``pagedkv eval`` reads :data:`LONG_TEXT`.
"""

from __future__ import annotations

import gzip
import json
import re
from importlib import resources
from pathlib import Path

LONG_TEXT = "monte_cristo_ch01-08.txt"  # the default --file of pagedkv eval ppl / needle
_TURN = re.compile(r"\n\n(Human|Assistant): ")


def data_path(name: str) -> Path:
    """Path of a bundled data file (``arena-hard-v0.1_question.jsonl``, ...)."""
    return Path(str(resources.files("pagedkv.data") / name))


# ---- raw loaders --------------------------------------------------------------------
def load_arena_hard(path: Path | None = None) -> list[str]:
    """The 500 arena-hard v0.1 prompts, in file order."""
    with open(path or data_path("arena-hard-v0.1_question.jsonl"), encoding="utf-8") as f:
        return [json.loads(line)["prompt"] for line in f if line.strip()]


def load_hh_rlhf(path: Path | None = None) -> list[list[tuple[str, str]]]:
    """HH-RLHF helpful-base test conversations as ``[(role, text), ...]`` with roles
    ``user``/``assistant``, from each row's ``chosen`` transcript. Rows whose roles do not
    alternate from ``user`` or that hold an empty turn are dropped (10 of 2,354)."""
    convs = []
    with gzip.open(path or data_path("hh-rlhf_helpful-base_test.jsonl.gz"), "rt", encoding="utf-8") as f:
        for line in f:
            parts = _TURN.split(json.loads(line)["chosen"])[1:]   # [role, text, role, text, ...]
            turns = [("user" if r == "Human" else "assistant", t) for r, t in zip(parts[::2], parts[1::2])]
            roles_ok = all(r == ("user", "assistant")[i % 2] for i, (r, _) in enumerate(turns))
            if turns and roles_ok and turns[-1][0] == "assistant" and all(t.strip() for _, t in turns):
                convs.append(turns)
    return convs


def load_sonnet(path: Path | None = None) -> str:
    return Path(path or data_path("sonnet.txt")).read_text(encoding="utf-8")


def calibration_text() -> str:
    """The fixed calibration text of static KV scales and W8A8 smoothing: the first 1,500
    characters of the sonnets (prose), then six arena-hard prompts (chat questions)."""
    return load_sonnet()[:1500] + "\n\n" + "\n\n".join(load_arena_hard()[:6])


def calibration_ids(tokenizer, max_tokens: int) -> list[int]:
    """Token ids of :func:`calibration_text` under ``tokenizer`` (no special tokens), at most ``max_tokens``."""
    return list(tokenizer(calibration_text(), add_special_tokens=False).input_ids)[:max_tokens]
