"""``pagedkv info``: where the model lives and what it costs, for pointing other tools at it.

The bundled model is a GGUF file converted once into a Hugging Face style folder under
``~/.cache/pagedkv``; tools that want a tokenizer or config (lm-evaluation-harness's
``tokenizer=``, ``transformers.AutoTokenizer``) need that folder's path, which this prints
with the files in it, its size, the KV cache bytes per token (the planner's arithmetic,
:meth:`pagedkv.model.config.ModelConfig.kv_spec`) and whether the fused attention kernel
is built for this CPU.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

KV_DTYPES_SHOWN = ("float32", "float16", "int8", "fp8_e4m3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja",
                   "model.safetensors")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("info", help="the resolved model folder, its size, KV bytes per token, kernel status",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="bundled name, .gguf file or model folder (default: %(default)s)")
    p.add_argument("--check-kernel", action="store_true",
                   help="build (or load) the fused attention kernel now and report the result")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.set_defaults(func=run_info)
    return p


def model_info(name: str, check_kernel: bool = False) -> dict:
    """What ``pagedkv info`` prints, as a dict. Raises FileNotFoundError/ValueError as
    :func:`pagedkv.model.loader.resolve_model` does."""
    from pagedkv.model.loader import resolve_model

    files = resolve_model(name)
    folder, cfg = files.folder, files.config
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return {
        "model": name, "folder": str(folder), "size_bytes": size,
        "files": {f: (folder / f).exists() for f in TOKENIZER_FILES}  # the expected ones, then all there
        | {p.name: True for p in sorted(folder.iterdir()) if p.is_file()},
        "has_chat_template": _has_chat_template(folder),
        "weights_sha256": files.weights_version,
        "architecture": {"layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
                         "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings},
        "kv_bytes_per_token": {d: cfg.kv_spec(d).bytes_per_token for d in KV_DTYPES_SHOWN},
        "kernel": kernel_status(check_kernel),
    }


def kernel_status(check: bool) -> dict:
    """The fused CPU attention kernel: its build folder for this CPU/torch/source, whether
    the library is there, and (``check``) whether it builds and loads."""
    from pagedkv.kernels.cpu import library as kernel

    directory = kernel.build_directory()
    status = {"build_directory": str(directory), "built": (directory / "pagedkv_attention.so").exists(),
              "PAGEDKV_ATTENTION": os.environ.get("PAGEDKV_ATTENTION", "auto")}
    if check:
        try:
            kernel.load_kernel()
            status["built"], status["loads"] = True, True
        except kernel.KernelBuildError as e:
            status["loads"], status["error"] = False, str(e)
    return status


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").exists():
        return True
    cfg = folder / "tokenizer_config.json"
    return cfg.exists() and bool(json.loads(cfg.read_text(encoding="utf-8")).get("chat_template"))


def run_info(a: argparse.Namespace) -> int:
    info = model_info(a.model, a.check_kernel)
    if a.json:
        print(json.dumps(info, indent=2))
        return 0
    k, folder = info["kernel"], info["folder"]
    present = ", ".join(f for f, ok in info["files"].items() if ok)
    arch = info["architecture"]
    print(f"model        {info['model']}\nfolder       {folder}\n"
          f"size         {info['size_bytes'] / 1e6:.1f} MB (1e6 bytes)\nfiles        {present}"
          f"{'' if info['has_chat_template'] else '  (no chat template)'}\n"
          f"architecture {arch['layers']} layers, {arch['kv_heads']} KV heads x head_dim {arch['head_dim']}, "
          f"context {arch['max_position_embeddings']}")
    print("KV bytes/token " + ", ".join(f"{d} {b:,}" for d, b in info["kv_bytes_per_token"].items()))
    state = "built" if k["built"] else "not built yet (compiles on first use, about 15 s)"
    if "loads" in k:
        state = "built and loads" if k["loads"] else f"unavailable: {k['error']}"
    print(f"kernel       {state}; PAGEDKV_ATTENTION={k['PAGEDKV_ATTENTION']}\n             {k['build_directory']}")
    print(f"\nuse it elsewhere:\n  lm_eval ... --model_args ...,tokenizer={folder}\n"
          f"  transformers.AutoTokenizer.from_pretrained({folder!r})")
    return 0
