"""``pagedkv eval needle`` (issue 14): passkey prompts of exact lengths with the needle at
its depth, scoring, and the CLI on the tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from pagedkv.eval.needle import NEEDLE, build_prompt, needle_eval, passkeys


@pytest.fixture(scope="module")
def tok(default_model_files):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_files.folder))


@pytest.fixture(scope="module")
def text_ids(tok):
    from pagedkv.data import data_path

    return tok(data_path("monte_cristo_ch01-08.txt").read_text(encoding="utf-8")[:40000],
               add_special_tokens=False).input_ids


def needle_at(tok, ids: list[int], key: str) -> int:
    needle = tok(NEEDLE.format(key=key), add_special_tokens=False).input_ids
    return next(i for i in range(len(ids)) if ids[i:i + len(needle)] == needle)


@pytest.mark.parametrize("length", [300, 1000, 2048])
def test_prompts_have_the_exact_length_and_the_needle_at_its_depth(tok, text_ids, length):
    at = {d: needle_at(tok, build_prompt(tok, text_ids, length, d, "12345"), "12345") for d in (0, 0.5, 1)}
    for d in (0, 0.5, 1):
        assert len(build_prompt(tok, text_ids, length, d, "12345")) == length
    assert at[0] < 40 and abs(at[0.5] - length / 2) < 100 and at[1] > length - 100  # intro, middle, end
    prompt = build_prompt(tok, text_ids, length, 0.5, "12345")
    assert tok.decode(prompt[:at[0.5]]).rstrip().rstrip("\"'”’").endswith((".", "!", "?"))  # a sentence end


def test_bad_needle_settings_are_refused(tok, text_ids):
    with pytest.raises(ValueError, match="depth"):
        build_prompt(tok, text_ids, 500, 1.5, "1")
    with pytest.raises(ValueError, match="no room"):
        build_prompt(tok, text_ids, 20, 0.5, "1")
    with pytest.raises(ValueError, match="fewer than"):
        build_prompt(tok, text_ids[:100], 500, 0.5, "1")


class EchoLLM:
    """Answers with the passkey when it can see it within its last ``sees`` tokens."""

    def __init__(self, tok, sees: int):
        self.tok, self.sees, self.prompts = tok, sees, []

    def get_tokenizer(self):
        return self.tok

    def generate(self, prompts, params):
        ids = prompts[0]["prompt_token_ids"]
        self.prompts.append(ids)
        text = self.tok.decode(ids[-self.sees:])
        key = next((k for k in KEYS if k in text), "nothing")
        return [SimpleNamespace(text=f" {key[:2]},{key[2:]}.")]  # "12,345." counts as 12345


KEYS = passkeys(3, 0)


def test_scoring_counts_what_the_model_answers(tok, text_ids):
    sees_all = EchoLLM(tok, 10**6)
    cells = needle_eval(sees_all, text_ids, [600], [0, 1], trials=3)
    assert [(c.correct, c.trials) for c in cells] == [(3, 3), (3, 3)] and len(sees_all.prompts) == 6
    short = needle_eval(EchoLLM(tok, 100), text_ids, [600], [0, 1], trials=3)
    assert [c.accuracy for c in short] == [0.0, 1.0]
    assert len(set(KEYS)) == 3 and all(len(k) == 5 for k in KEYS)


def test_needle_cli_runs_on_the_tiny_model(tiny_model_dir):
    r = subprocess.run([sys.executable, "-m", "pagedkv.cli", "eval", "needle", "--model", str(tiny_model_dir),
                        "--lengths", "200", "--depths", "0,1", "--num-trials", "2", "--num-blocks", "64",
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    assert [(x["length"], x["depth"], x["trials"]) for x in rows[:2]] == [(200, 0.0, 2), (200, 1.0, 2)]
    assert rows[2]["trials"] == 4 and 0 <= rows[2]["accuracy"] <= 1
    for lengths, says in (("", "--lengths"), ("505", "need 513 positions"), ("300,20", "no room")):
        bad = subprocess.run([sys.executable, "-m", "pagedkv.cli", "eval", "needle", "--model", str(tiny_model_dir),
                              "--lengths", lengths, "--num-blocks", "64"], capture_output=True, text=True, timeout=300)
        assert bad.returncode != 0 and says in bad.stderr and "length " not in bad.stdout, (lengths, bad.stderr)


@pytest.mark.parametrize("argv,says", [
    (["--depths", "0,,1"], "got '' in '0,,1'"), (["--depths", "0.5,0.5"], "repeats a value"),
    (["--depths", "1.5"], "fractions of the haystack"), (["--lengths", "100,abc"], "comma-separated ints"),
    (["--lengths", "0"], "prompt lengths in tokens"), (["--num-trials", "0"], "at least 1"),
    (["--lengths", "1024", "--max-model-len", "512"], "exceed --max-model-len 512"),
    (["--file", "/nonexistent/haystack.txt"], "does not exist"),
])
def test_needle_arguments_are_refused_before_the_model_loads(argv, says, capsys, monkeypatch):
    from pagedkv import cli
    from pagedkv.eval import cli as eval_cli

    monkeypatch.setattr(eval_cli, "_llm_within", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main(["eval", "needle", *argv]) == 2
    assert says in capsys.readouterr().err
