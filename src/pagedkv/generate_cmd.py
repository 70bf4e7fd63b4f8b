"""``pagedkv generate``: prompts from arguments or a file, answers on stdout.

With ``--json`` each request is one JSON object per line, then one stats object
(``block_size``, ``num_blocks``, ``peak_blocks_used``, ``kv_bytes_per_token``,
``num_preemptions``, ``output_tokens_per_s``, ...). A tqdm bar on stderr tracks many prompts.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def read_prompts(positional: list[str], path: Path | None) -> list[str]:
    """Prompts from the command line and/or a file. A ``.jsonl``/``.json`` file holds one
    JSON object with a ``prompt`` field (or a JSON string) per line, or (``.json``) one JSON
    array of them; any other file holds one plain-text prompt per line. Blank lines are
    skipped. An object's other keys are ignored, except sampling settings (``max_tokens``,
    ``temperature``, ...), which are refused: every prompt takes the command line's.

    Raises:
        FileNotFoundError: missing file. ValueError: no prompt at all, a file that is not
        UTF-8, or a bad JSON line or item (naming it).
    """
    prompts = list(positional)
    if path is not None:
        if path.is_dir() or not path.exists():
            raise FileNotFoundError(f"prompts file {path} does not exist or is a folder")
        try:
            with open(path, encoding="utf-8", newline="") as f:  # only \n ends a line
                text = f.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"prompts file {path} is not UTF-8 text (byte {e.start})") from None
        if path.suffix == ".json" and text.lstrip().startswith("["):
            prompts += _parse_array(text)
        else:
            for n, line in enumerate((ln.removesuffix("\r") for ln in text.split("\n")), 1):
                if line.strip():
                    prompts.append(_parse_line(line, n) if path.suffix in (".jsonl", ".json") else line)
    if not prompts:
        raise ValueError(f"the prompts file {path} holds no prompt" if path is not None else
                         "no prompt given: pass prompts as arguments or --prompts-file")
    return prompts


def _parse_array(text: str) -> list[str]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"prompts file: invalid JSON array ({e.msg}, line {e.lineno})") from None
    if not isinstance(items, list):
        raise ValueError("prompts file: expected one JSON array of prompts")
    return [_prompt(obj, f"item {i}") for i, obj in enumerate(items)]


def _parse_line(line: str, n: int) -> str:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"prompts file line {n}: invalid JSON ({e.msg}); a .jsonl or .json file holds one JSON "
                         "object or string a line, or a .json file one array (plain-text prompts: another file "
                         "name)") from None
    return _prompt(obj, f"line {n}")


def _prompt(obj, where: str) -> str:
    from dataclasses import fields

    from pagedkv.core.sampling_params import SamplingParams

    if isinstance(obj, str):
        return obj
    if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
        settings = sorted(set(obj) & {f.name for f in fields(SamplingParams)})
        if settings:
            raise ValueError(f"prompts file {where}: {', '.join(settings)} per prompt is not read; every prompt "
                             "takes the command line's (e.g. --max-tokens)")
        return obj["prompt"]
    raise ValueError(f"prompts file {where}: expected a string or an object with a 'prompt' string")


def _to_engine_prompts(llm, prompts: list[str], chat: bool | None) -> list:
    tok = llm.get_tokenizer()
    if chat is None:
        chat = bool(getattr(tok, "chat_template", None))
    if not chat:
        return prompts
    if not getattr(tok, "chat_template", None):
        raise ValueError("--chat: this model has no chat template")
    return [llm.chat_prompt([{"role": "user", "content": p}]) | {"prompt": p} for p in prompts]


def _add_each(llm, inputs: list, params) -> tuple[list[str | None], dict[int, str]]:
    """Queue each prompt on its own: one that can never run is reported, the others go on."""
    ids, errors = [], {}
    for i, p in enumerate(inputs):
        try:
            ids.append(llm.add_requests([p], params)[0])
        except ValueError as e:
            ids.append(None)
            errors[i] = str(e).removeprefix("prompt 0: ")
            print(f"error: prompt {i}: {errors[i]}", file=sys.stderr)
    return ids, errors


def run_generate(a, engine_args: dict, params) -> int:
    """Exit 0 when every prompt ran; 2 when some were rejected (the others still ran)."""
    from tqdm import tqdm

    from pagedkv import LLM

    prompts = read_prompts(a.prompts, a.prompts_file)
    llm = LLM(**engine_args)
    ids, errors = _add_each(llm, _to_engine_prompts(llm, prompts, a.chat), params)
    live = [i for i in ids if i is not None]
    bar = tqdm(total=len(live), desc="requests", unit="req", file=sys.stderr, disable=len(live) < 4)
    t0 = time.perf_counter()
    outs = iter(llm.run(live, on_output=lambda o: bar.update(1)))
    elapsed = time.perf_counter() - t0
    bar.close()
    done = []
    for i, rid in enumerate(ids):
        if rid is None:
            if a.json:
                print(json.dumps({"index": i, "prompt": prompts[i], "error": errors[i]}))
            continue
        o = next(outs)
        done.append(o)
        print(json.dumps(_output_json(o)) if a.json else o.text)
    if a.json:
        print(json.dumps(_stats_json(llm, done, elapsed)))
    return 2 if errors else 0


def _output_json(o) -> dict:
    return {"request_id": o.request_id, "prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
            "finish_reason": o.finish_reason, "num_prompt_tokens": o.num_prompt_tokens,
            "num_cached_tokens": o.num_cached_tokens, "num_preemptions": o.num_preemptions,
            "ttft_s": o.ttft, "tpot_s": o.tpot, "e2e_s": o.e2e}


def _stats_json(llm, outs, elapsed: float) -> dict:
    s = llm.stats().to_dict()
    n_out = sum(len(o.token_ids) for o in outs)
    return {"stats": True, "num_requests": len(outs), "num_output_tokens": n_out, "elapsed_s": elapsed,
            "output_tokens_per_s": n_out / elapsed if elapsed > 0 else None} | s
