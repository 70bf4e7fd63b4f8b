"""Convert a llama-architecture GGUF file into a Hugging Face style folder, once.

The folder (``config.json``, ``model.safetensors`` in fp32, ``tokenizer.json`` and its
config with the chat template, ``pagedkv.json``) lives under the cache directory, keyed
by the file's sha256, so a second start loads safetensors instead of dequantizing.

Tensor layout: GGUF stores each matrix as HF's ``[out_features, in_features]`` once
dequantized, but llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``)
reorders the rows of ``q_proj`` and ``k_proj`` within each head from HF's "rotate half"
RoPE layout to interleaved pairs. :func:`unpermute_rows` undoes that.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
                 "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/pagedkv``, default ``~/.cache/pagedkv``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagedkv"


def file_digest(path: Path) -> str:
    """sha256 hex digest of a file (the weights version used in prefix-cache keys)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a Q or K projection.

    Shapes: ``w`` is ``[n_heads * head_dim, in]`` (or ``[n_heads * head_dim]`` for a bias).
    """
    rest = w.shape[1:]
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def converted_dir(gguf_path: str | Path) -> Path:
    """Folder holding the converted model, converting on first use.

    Raises:
        FileNotFoundError: if the file does not exist.
        ValueError: if it is not a llama-architecture GGUF.
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    digest = file_digest(gguf_path)
    out = cache_root() / f"{gguf_path.stem}-{digest[:16]}"
    if not (out / "pagedkv.json").exists():
        print(f"pagedkv: converting {gguf_path.name} to safetensors in {out} (once)", file=sys.stderr, flush=True)
        _convert(gguf_path, out, digest)
    return out


def _convert(gguf_path: Path, out: Path, digest: str) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError, IndexError, ...
        raise ValueError(f"{gguf_path} is not a readable GGUF file ({e})") from None
    meta = {k: _field_value(f) for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.t")}
    config = gguf_config(meta)
    tensors = {}
    for t in reader.tensors:
        name, w = _hf_name(t.name), dequantize(t.data, t.tensor_type).astype(np.float32)
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            w = unpermute_rows(w, config["num_attention_heads"])
        elif name.endswith(("k_proj.weight", "k_proj.bias")):
            w = unpermute_rows(w, config["num_key_value_heads"])
        tensors[name] = np.ascontiguousarray(w)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    _save_tokenizer(gguf_path, tmp)
    (tmp / "pagedkv.json").write_text(json.dumps({"source": str(gguf_path), "sha256": digest}))
    if out.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return
    tmp.rename(out)


BLOCKS_FILE = "ggml_blocks.safetensors"  # the kept-quantized blocks, cached beside the fp32 weights


def read_blocks(gguf_path: str | Path, cache_dir: str | Path | None = None) -> dict:
    """The file's Q4_1 and Q8_0 matrices as :class:`~pagedkv.model.ggml_weights.GGMLWeight`
    by HF tensor name, their bytes as stored (Q/K rows un-permuted as :func:`_convert` does;
    a permutation of whole rows moves whole blocks). Other tensors are left out.

    With ``cache_dir`` (the converted folder) the blocks are kept there in
    ``ggml_blocks.safetensors`` after the first read (parsing a GGUF's metadata costs
    seconds; reading the cache, milliseconds), written under a temporary name and renamed.

    Raises:
        ValueError: the file is not a readable llama GGUF.
    """
    cached = Path(cache_dir) / BLOCKS_FILE if cache_dir is not None else None
    if cached is not None and cached.exists():
        try:
            return _load_blocks(cached)
        except Exception:  # noqa: BLE001 - a truncated or foreign cache file: parse the GGUF again
            pass
    out = _parse_blocks(gguf_path)
    if cached is not None:
        _save_blocks(out, cached)
    return out


def _parse_blocks(gguf_path) -> dict:
    import torch
    from gguf import GGUFReader

    from pagedkv.model.ggml_weights import FORMATS, GGMLWeight

    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as e:  # noqa: BLE001 - the reader raises ValueError, IndexError, ...
        raise ValueError(f"{gguf_path} is not a readable GGUF file ({e})") from None
    config = gguf_config({k: _field_value(f) for k, f in reader.fields.items() if k.startswith(("general.", "llama."))})
    out = {}
    for t in reader.tensors:
        if int(t.tensor_type) not in FORMATS or len(t.shape) != 2:
            continue
        name, rows = _hf_name(t.name), np.array(t.data)  # a copy: the file's memory map is released
        if name.endswith("q_proj.weight"):
            rows = unpermute_rows(rows, config["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            rows = unpermute_rows(rows, config["num_key_value_heads"])
        out[name] = GGMLWeight(torch.from_numpy(np.ascontiguousarray(rows)), int(t.tensor_type), int(t.shape[0]))
    return out


def _save_blocks(blocks: dict, path: Path) -> None:
    from safetensors.torch import save_file

    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    meta = {name: f"{w.qtype},{w.shape[1]}" for name, w in blocks.items()}
    try:
        save_file({name: w.blocks for name, w in blocks.items()}, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except OSError:  # a read-only cache: parse again next time
        tmp.unlink(missing_ok=True)


def _load_blocks(path: Path) -> dict:
    from safetensors import safe_open

    from pagedkv.model.ggml_weights import GGMLWeight

    out = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        for name in f.keys():
            qtype, width = (int(v) for v in meta[name].split(","))
            out[name] = GGMLWeight(f.get_tensor(name), qtype, width)
    return out


def gguf_config(meta: dict) -> dict:
    """HF ``config.json`` dict from GGUF ``llama.*`` metadata.

    Raises:
        ValueError: if ``general.architecture`` is not ``llama``.
    """
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; pagedkv loads 'llama' GGUF files")
    for key in ("llama.attention.head_count", "llama.embedding_length", "llama.feed_forward_length",
                "llama.block_count"):
        if meta.get(key) is None:
            raise ValueError(f"GGUF metadata lacks {key!r}")
    heads = meta["llama.attention.head_count"]
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "hidden_size": meta["llama.embedding_length"], "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"], "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "vocab_size": meta.get("llama.vocab_size") or len(meta.get("tokenizer.ggml.tokens", [])),
        "rms_norm_eps": meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": meta.get("llama.rope.freq_base", 10000.0),
        "max_position_embeddings": meta.get("llama.context_length", 2048),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if meta.get("llama.rope.dimension_count") not in (None, cfg["hidden_size"] // heads):
        cfg["head_dim"] = meta["llama.rope.dimension_count"]
    if meta.get("llama.rope.scaling.type") == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": meta["llama.rope.scaling.factor"]}
    return cfg


def _save_tokenizer(gguf_path: Path, out: Path) -> None:
    """HF transformers builds a fast tokenizer (and chat template) from GGUF metadata."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out))


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "rope_freqs.weight":
        raise ValueError("this GGUF carries per-dimension RoPE factors (rope_freqs, Llama 3.1+ "
                         "'llama3' scaling), which pagedkv does not read from GGUF yet; "
                         "load the Hugging Face folder instead")
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


def _field_value(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - exotic metadata types we do not need
        return None
