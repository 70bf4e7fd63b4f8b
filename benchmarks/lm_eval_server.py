"""lm-evaluation-harness against ``pagedkv serve``, per KV cache dtype, next to ``pagedkv eval ppl``.

For each ``--kv-cache-dtype`` this starts ``pagedkv serve`` with that cache and runs two
lm-eval tasks over local files (lm-eval's ``dataset_path: json``; nothing from a hub):

- ``pagedkv_wikitext_rolling``: ``loglikelihood_rolling`` perplexity of one document, the
  first ``--chars`` characters of WikiText-2's test split;
- ``pagedkv_next_sentence``: multiple choice built from the same split: after a
  paragraph's first sentence, pick its true second sentence among four (three are
  second sentences of other paragraphs, seeded shuffle), scored with ``acc``/``acc_norm``.

lm-eval reaches the server through ``local-completions`` (``echo`` + ``logprobs``) and finds
its tokenizer through ``/tokenizer_info`` and ``/tokenize``. Then ``pagedkv eval ppl
--rolling --window MAX_LENGTH-1`` scores the same document in-process with the same windows
(lm-eval's API models send at most ``max_length - 1`` prompt tokens, keeping one for generation),
and the token-level perplexities of both are printed side by side.

lm-eval is a benchmark-time tool, not a dependency: install it in its own environment
(``python -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install 'lm_eval[api]'``) and pass
``--lm-eval /tmp/lmeval/bin/lm_eval``. The data files it writes are derived from WikiText-2
(Merity et al., 2016; CC BY-SA 3.0) and stay in ``--out``.

    python benchmarks/lm_eval_server.py --lm-eval /tmp/lmeval/bin/lm_eval --out /tmp/lmeval-run
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
PAGEDKV = [sys.executable, "-m", "pagedkv.cli"]

ROLLING_TASK = """task: pagedkv_wikitext_rolling
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
MC_TASK = """task: pagedkv_next_sentence
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def rolling_document(text: str, chars: int) -> str:
    """The first ``chars`` characters, cut back to a line end, without trailing spaces."""
    cut = text[:chars]
    return cut[:cut.rfind("\n")].strip() if "\n" in cut else cut.strip()


def next_sentence_items(text: str, num: int, seed: int = 0) -> list[dict]:
    """Multiple-choice items: a paragraph's first sentence, its true second sentence and
    three second sentences of other paragraphs, shuffled (``label`` = the true one's index)."""
    pairs = []
    for line in text.splitlines():
        line = line.strip()
        if len(line) < 200 or line.startswith("="):
            continue
        sents = re.split(r"(?<= \.) ", line)
        if len(sents) >= 2 and 30 <= len(sents[1]) <= 300:
            pairs.append((sents[0], sents[1]))
    rng = random.Random(seed)
    items = []
    for i, (context, truth) in enumerate(pairs[:num]):
        others = [p[1] for j, p in enumerate(pairs) if j != i]
        choices = [truth] + rng.sample(others, 3)
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(truth)})
    return items


def write_tasks(out: Path, chars: int, mc_items: int) -> tuple[Path, Path]:
    """Data files and task YAMLs under ``out``; returns (task folder, rolling document)."""
    text = WIKITEXT.read_text(encoding="utf-8")
    tasks, doc_file = out / "tasks", out / "document.txt"
    tasks.mkdir(parents=True, exist_ok=True)
    doc = rolling_document(text, chars)
    doc_file.write_text(doc, encoding="utf-8")
    (out / "rolling.jsonl").write_text(json.dumps({"text": doc}) + "\n", encoding="utf-8")
    (out / "next_sentence.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in next_sentence_items(text, mc_items)), encoding="utf-8")
    (tasks / "rolling.yaml").write_text(ROLLING_TASK.format(data=out / "rolling.jsonl"))
    (tasks / "next_sentence.yaml").write_text(MC_TASK.format(data=out / "next_sentence.jsonl"))
    return tasks, doc_file


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(model: str, dtype: str, max_model_len: int, port: int) -> subprocess.Popen:
    proc = subprocess.Popen(PAGEDKV + ["serve", "--model", model, "--kv-cache-dtype", dtype, "--port", str(port),
                                       "--max-model-len", str(max_model_len), "--served-model-name", "pagedkv",
                                       "--log-level", "warning", "--no-access-log"])
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"pagedkv serve exited with {proc.returncode}")
        time.sleep(1)
    proc.kill()
    raise RuntimeError("pagedkv serve did not come up")


def run_lm_eval(a, tasks: Path, port: int, out: Path) -> tuple[dict, float]:
    """lm-eval's results and the rolling document's summed log-likelihood (from its samples)."""
    args = (f"model=pagedkv,base_url=http://127.0.0.1:{port}/v1/completions,max_length={a.max_length},"
            f"tokenized_requests=True,num_concurrent=1,max_retries=1")
    subprocess.run([a.lm_eval, "run", "--model", "local-completions", "--model_args", args,
                    "--tasks", "pagedkv_wikitext_rolling,pagedkv_next_sentence", "--include_path", str(tasks),
                    "--batch_size", str(a.batch_size), "--output_path", str(out), "--log_samples"], check=True)
    results = json.loads(max(out.rglob("results_*.json"), key=lambda p: p.stat().st_mtime).read_text())
    samples = max(out.rglob("samples_pagedkv_wikitext_rolling_*.jsonl"), key=lambda p: p.stat().st_mtime)
    loglik = sum(float(json.loads(line)["filtered_resps"][0]) for line in samples.read_text().splitlines())
    return results["results"], float(loglik)


def eval_ppl(a, dtype: str, doc_file: Path) -> dict:
    r = subprocess.run(PAGEDKV + ["eval", "ppl", "--model", a.model, "--file", str(doc_file), "--rolling",
                                  "--window", str(a.max_length - 1), "--num-tokens", str(10**7),
                                  "--kv-cache-dtype", dtype, "--json"], check=True, capture_output=True, text=True)
    return json.loads(r.stdout.splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lm-eval", default="lm_eval", help="the lm_eval executable (default: on PATH)")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--kv-cache-dtype", default="float32,int8,fp8_e4m3", help="comma-separated")
    p.add_argument("--chars", type=int, default=40_000, help="characters of WikiText-2 to score (rolling)")
    p.add_argument("--mc-items", type=int, default=100, help="multiple-choice items")
    p.add_argument("--max-length", type=int, default=512,
                   help="lm-eval max_length = the server's --max-model-len = eval ppl --window + 1")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per lm-eval request")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    tasks, doc_file = write_tasks(a.out, a.chars, a.mc_items)
    rows = []
    for dtype in a.kv_cache_dtype.split(","):
        port = free_port()
        t0 = time.monotonic()
        server = serve(a.model, dtype, a.max_length, port)
        try:
            results, loglik = run_lm_eval(a, tasks, port, a.out / f"lm_eval_{dtype}")
        finally:
            server.terminate()
            server.wait(60)
        lm_s = time.monotonic() - t0
        ours = eval_ppl(a, dtype, doc_file)
        lm_ppl = math.exp(-loglik / ours["num_scored_tokens"])
        mc = results["pagedkv_next_sentence"]
        rows.append({"kv_cache_dtype": dtype, "lm_eval_token_ppl": lm_ppl, "eval_ppl": ours["ppl"],
                     "rel_diff": lm_ppl / ours["ppl"] - 1, "tokens": ours["num_scored_tokens"],
                     "windows": ours["num_windows"],
                     "word_perplexity": results["pagedkv_wikitext_rolling"]["word_perplexity,none"],
                     "acc": mc["acc,none"], "acc_stderr": mc["acc_stderr,none"], "acc_norm": mc["acc_norm,none"],
                     "lm_eval_seconds": round(lm_s, 1)})
        print(json.dumps(rows[-1]), flush=True)
    (a.out / "summary.json").write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
