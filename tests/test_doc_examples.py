"""The docs' examples run as written, and print what the docs show (issue 53).

A fenced block in README.md or docs/*.md is checked when an HTML comment (invisible on
GitHub) stands on the last non-blank line before its opening fence:

* ``<!-- runnable -->``: the block runs, from a fresh temporary directory, with the
  interpreter's ``bin/`` (the venv's: ``pagedkv``, ``python``) first on ``PATH``, as the
  docs assume an active venv. A ``python`` block runs as a script (``sys.executable``); a
  ``bash``/``sh`` block as one ``bash -e -o pipefail`` script; in a ``console`` block each
  ``$ `` line (with its ``\\`` continuation lines) is a command run by bash, and the lines
  after it, up to the next ``$ ``, are its shown output. Each must exit 0; a failure shows
  the tail of its stderr.
* ``<!-- output -->``: the block shows the stdout of the runnable block before it in the
  same file.
* ``<!-- runnable: server -->``: a block holding one ``pagedkv serve`` command. It is started
  with ``--port 0`` (any free port) for the next runnable block of the file, in which
  ``127.0.0.1:8000`` becomes the port it got; the test waits for ``/health``, runs that
  block, then stops the server with SIGTERM.

Shown output is compared with what the block printed, trailing spaces and blank lines at
either end ignored:

* a shown JSON object with ``...`` for the keys left out (``{ ..., "num_blocks": 363, ... }``)
  matches when some JSON object the block printed holds every shown key with that value;
* anything else line by line, exactly, except that a line ``...`` stands for any number of
  lines and ``...`` within a line for any text on that line (doctest's ELLIPSIS).

Mark only blocks that are cheap (seconds) and show deterministic output: greedy
(temperature 0) text, plans, seeded simulations, with ``...`` in place of what is measured
(times, rates). A block that needs a placeholder filled in, a file the reader does not have
or ``../shared`` data stays unmarked.

The blocks run as in a user's shell: without the suite's ``PAGEDKV_BATCH_INVARIANT`` and
``TRITON_INTERPRET`` (tests/conftest.py sets them), with CUDA hidden, since the shown
outputs are the CPU path's, and with ``OMP_NUM_THREADS=1`` unless it is set (the README's
advice for shared cores: with a busy neighbour, torch's default threads made the README's
command-line block take 70 s instead of 20 s). A block that loads the default model is marked ``slow`` and,
like the rest of the suite, fails where the model is not installed (``default_model_files``).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_docs import DOCS, ROOT, fenced_blocks, github_slug, split_markdown, strip_inline_code

FILES = [ROOT / "README.md", *DOCS]
BIN = Path(sys.executable).parent
TIMEOUT_S = 300                     # per command; a cold machine compiles the CPU kernels first (~1 min)
MARKER = re.compile(r"^\s*<!--\s*(runnable|runnable:\s*server|output)\s*-->\s*$")
ANY_MARKER = re.compile(r"<!--\s*(runnable|output)\b")
LANGS = {"python", "bash", "sh", "console"}
SERVER_URL = "127.0.0.1:8000"


@dataclass
class Example:
    path: Path
    line: int                        # the opening fence, 1-based
    section: str                     # the slug of the heading above it
    lang: str
    code: str
    shown: str | None = None         # the body of its <!-- output --> block
    server: str | None = None        # the `pagedkv serve` block started for it
    id: str = ""

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def collect(path: Path) -> tuple[list[Example], list[str]]:
    """The marked blocks of one file, and what is wrong with its markers."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    rel = path.relative_to(ROOT) if ROOT in path.parents else Path(path.name)
    blocks = fenced_blocks(text)
    prose = split_markdown(text)[0]
    problems, examples, attached = [], [], set()
    server: tuple[int, str] | None = None
    last: Example | None = None
    for start, info, body in blocks:
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        m = MARKER.match(lines[j]) if j >= 0 else None
        if not m:
            continue
        attached.add(j)
        marker, lang = re.sub(r"\s+", "", m.group(1)), (info.split() or [""])[0]
        where = f"{rel}:{start + 1}"
        if marker == "output":
            if last is None or last.shown is not None or last.lang == "console":
                problems.append(f"{where}: <!-- output --> follows no runnable block (a console block shows its own)")
            else:
                last.shown = body
            last = None
            continue
        if lang not in LANGS:
            problems.append(f"{where}: a runnable block must be one of {sorted(LANGS)}, not {lang!r}")
            continue
        if marker == "runnable:server":
            if server is not None:
                problems.append(f"{rel}:{server[0]}: a server block with no runnable block after it")
            server, last = (start + 1, body), None
            continue
        heading = next((hm.group(1) for h in reversed(prose.splitlines()[:start])
                        if (hm := re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", h))), "")
        ex = Example(path, start + 1, github_slug(heading), lang, body)
        if server is not None:
            ex.server = server[1]
            if SERVER_URL not in body:
                problems.append(f"{where}: follows a server block but does not name {SERVER_URL}")
            server = None
        if lang == "console" and not body.lstrip().startswith("$ "):
            problems.append(f"{where}: a runnable console block starts with a `$ ` command")
        examples.append(ex)
        last = ex
    if server is not None:
        problems.append(f"{rel}:{server[0]}: a server block with no runnable block after it")
    # every marker in the prose (not in code) sits right before a block
    for i, line in enumerate(prose.splitlines()):
        if ANY_MARKER.search(strip_inline_code(line)) and i not in attached:
            problems.append(f"{rel}:{i + 1}: {line.strip()!r} is not a known marker right before a fenced block")
    seen: dict[str, int] = {}
    for ex in examples:
        base = f"{rel}#{ex.section}"
        seen[base] = seen.get(base, 0) + 1
        ex.id = base if seen[base] == 1 else f"{base}-{seen[base]}"
    return examples, problems


EXAMPLES: list[Example] = []
PROBLEMS: list[str] = []
for _path in FILES:
    _examples, _problems = collect(_path)
    EXAMPLES += _examples
    PROBLEMS += _problems


# --- comparing shown output ------------------------------------------------------------------

def _trimmed_lines(text: str) -> list[str]:
    lines = [ln.rstrip() for ln in text.splitlines()]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _elided_json(shown: str) -> dict | None:
    """``{ ..., "a": 1, ... }`` as {"a": 1}; None where the shown text is not such an object."""
    text = shown.strip()
    if not (text.startswith("{") and text.endswith("}") and "..." in text):
        return None
    text = re.sub(r",\s*\.\.\.", "", re.sub(r"\.\.\.\s*,", "", text))
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


def _json_objects(out: str) -> list[dict]:
    """Every JSON object that starts a line of the output (pretty-printed or one a line)."""
    dec, objs, pos = json.JSONDecoder(), [], 0
    for line in out.splitlines(keepends=True):
        if line.lstrip().startswith("{"):
            try:
                obj, _ = dec.raw_decode(out, pos + len(line) - len(line.lstrip()))
                if isinstance(obj, dict):
                    objs.append(obj)
            except json.JSONDecodeError:
                pass
        pos += len(line)
    return objs


def output_matches(shown: str, out: str) -> bool:
    want = _elided_json(shown)
    if want is not None:
        return any(all(k in o and o[k] == v for k, v in want.items()) for o in _json_objects(out))
    pattern = ""
    for line in _trimmed_lines(shown):
        if line.strip() == "...":
            pattern += r"(?:[^\n]*\n)*?"
        else:
            pattern += r"[^\n]*?".join(re.escape(part) for part in line.split("...")) + r"\n"
    got = "".join(ln + "\n" for ln in _trimmed_lines(out))
    return re.fullmatch(pattern, got) is not None


def assert_output(shown: str, out: str, what: str) -> None:
    if output_matches(shown, out):
        return
    want = _elided_json(shown)
    if want is not None:
        objs = _json_objects(out) or [{}]
        near = max(objs, key=lambda o: sum(k in o and o[k] == v for k, v in want.items()))
        wrong = "; ".join(f"{k}: shown {v!r}, printed {near.get(k, '(absent)')!r}"
                          for k, v in want.items() if near.get(k, object()) != v)
        pytest.fail(f"{what}: no JSON object printed holds the keys the docs show; nearest: {wrong}", pytrace=False)
    diff = "\n".join(difflib.unified_diff(_trimmed_lines(shown), _trimmed_lines(out), "shown in the docs",
                                          "printed", lineterm=""))
    pytest.fail(f"{what}: the output differs from the one the docs show (`...` = any text)\n{diff}",
                pytrace=False)


def test_output_matching():
    assert output_matches("a\nb  \n", "\na\nb\n\n")
    assert not output_matches("a\nb", "a\nc")
    assert not output_matches("a", "a\nb")                                    # exact: no extra lines
    assert output_matches("a\n...\nd", "a\nb\nc\nd") and output_matches("a\n...\nd", "a\nd")
    assert output_matches("took ... s, ... tok/s", "took 1.25 s, 80.1 tok/s")
    assert not output_matches("took ... s", "took 1.25 ms\nmore")
    assert output_matches('{ ..., "n": 3, "d": "f32", ... }', 'x\n{"n": 3, "d": "f32", "m": 1}\n{\n  "n": 4\n}')
    assert output_matches('{ ..., "n": 4, ... }', '{"n": 3}\n{\n  "d": "f32",\n  "n": 4\n}\n')
    assert not output_matches('{ ..., "n": 5, ... }', '{"n": 3, "d": "f32"}')
    assert not output_matches('{ ..., "n": 3, "d": "f16", ... }', '{"n": 3, "d": "f32"}')


def console_commands(body: str) -> list[tuple[str, str]]:
    """(command, shown output) of each `$ ` line of a console block."""
    out: list[tuple[str, list[str]]] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("$ "):
            cmd = lines[i][2:]
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd += "\n" + lines[i]
            out.append((cmd, []))
        elif out:
            out[-1][1].append(lines[i])
        i += 1
    return [(cmd, "\n".join(shown)) for cmd, shown in out]


# --- the markers -----------------------------------------------------------------------------

def test_markers_are_well_placed():
    assert not PROBLEMS, "\n".join(PROBLEMS)


def test_marker_problems_are_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# T\n\n<!-- output -->\n```\nx\n```\n\n<!-- runnable -->\nprose\n\n<!-- runnable -->\n```text\n"
                    "x\n```\n\n<!-- runnable: server -->\n```bash\npagedkv serve\n```\n\n<!-- runnable -->\n"
                    "```python\nprint(1)\n```\n<!-- output -->\n```\n1\n```\n", encoding="utf-8")
    examples, problems = collect(page)
    assert [(e.id, e.lang, e.shown, e.server) for e in examples] == [("page.md#t", "python", "1", "pagedkv serve")]
    assert [p.split(": ", 1)[1][:30] for p in problems] == [
        "<!-- output --> follows no run", "a runnable block must be one o", "follows a server block but doe",
        "'<!-- runnable -->' is not a k"]


def test_the_quick_start_is_marked():
    by_id = {ex.id: ex for ex in EXAMPLES}
    quick = ["README.md#python-shaped-after-vllm", "README.md#command-line", "README.md#server-with-the-openai-client"]
    assert set(quick) <= set(by_id), f"unmarked: {sorted(set(quick) - set(by_id))}"
    assert by_id[quick[0]].shown is not None and by_id[quick[2]].server is not None


# --- running them ----------------------------------------------------------------------------

def user_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("PAGEDKV_BATCH_INVARIANT", "TRITON_INTERPRET"):
        env.pop(name, None)
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    env.setdefault("OMP_NUM_THREADS", "1")      # the README's advice for shared cores: 4x faster when they are busy
    return env


def run(args: list[str], cwd: Path, env: dict[str, str], what: str) -> str:
    try:
        r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{what}: still running after {TIMEOUT_S} s\n--- stderr ---\n{(e.stderr or b'')[-4000:]!r}",
                    pytrace=False)
    if r.returncode != 0:
        pytest.fail(f"{what}: exit status {r.returncode}\n--- stderr (tail) ---\n{r.stderr[-4000:]}"
                    f"\n--- stdout (tail) ---\n{r.stdout[-2000:]}", pytrace=False)
    return r.stdout


@contextmanager
def served(block: str, cwd: Path, env: dict[str, str]):
    """Start the block's `pagedkv serve` on a free port; yield its host:port; stop it."""
    commands = [shlex.split(ln, comments=True) for ln in block.splitlines()]
    commands = [c for c in commands if c]
    assert len(commands) == 1 and commands[0][:2] == ["pagedkv", "serve"], f"not one `pagedkv serve`: {block!r}"
    args = commands[0]
    if "--port" in args:
        args[args.index("--port") + 1] = "0"
    else:
        args += ["--port", "0"]
    proc = subprocess.Popen([shutil.which("pagedkv", path=env["PATH"]), *args[1:]], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log: list[str] = []
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            log.append(line)
            m = re.search(r"serving \S+ on http://(127\.0\.0\.1:\d+)", line)
            if m and not found:
                found.append(m.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(TIMEOUT_S) or not found:
            pytest.fail(f"`{' '.join(args)}` did not start:\n{''.join(log)[-4000:]}", pytrace=False)
        deadline = time.monotonic() + 120
        while True:                   # the URL is printed when the socket is bound, before uvicorn listens
            try:
                with urllib.request.urlopen(f"http://{found[0]}/health", timeout=10) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                pytest.fail(f"`{' '.join(args)}` never answered /health:\n{''.join(log)[-4000:]}", pytrace=False)
            time.sleep(0.2)
        yield found[0], log
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def needs_model(ex: Example) -> bool:
    return ex.server is not None or re.search(r"\bLLM\(|pagedkv\s+(generate|serve|info|eval|bench)\b", ex.code) \
        is not None


@pytest.mark.parametrize("ex", [pytest.param(ex, id=ex.id, marks=[pytest.mark.slow] * needs_model(ex))
                                for ex in EXAMPLES])
def test_example_runs_and_shows_its_output(ex: Example, tmp_path: Path, request):
    if needs_model(ex):
        request.getfixturevalue("default_model_files")         # fails as the suite does where it is missing
    env = user_env()
    what = f"the {ex.lang} block at {ex.where()}"
    if ex.lang == "console":
        for cmd, shown in console_commands(ex.code):
            out = run(["bash", "-e", "-o", "pipefail", "-c", cmd], tmp_path, env, f"`$ {cmd}` ({ex.where()})")
            if shown.strip():
                assert_output(shown, out, f"`$ {cmd}` ({ex.where()})")
        return
    if ex.server is not None:
        with served(ex.server, tmp_path, env) as (host_port, log):
            code = ex.code.replace(SERVER_URL, host_port)
            try:
                out = run_block(ex.lang, code, tmp_path, env, what)
            except BaseException:
                print("--- server log (tail) ---\n" + "".join(log)[-4000:])
                raise
    else:
        out = run_block(ex.lang, ex.code, tmp_path, env, what)
    if ex.shown is not None:
        assert_output(ex.shown, out, what)


def run_block(lang: str, code: str, cwd: Path, env: dict[str, str], what: str) -> str:
    if lang == "python":
        (cwd / "example.py").write_text(code + "\n", encoding="utf-8")
        return run([sys.executable, "example.py"], cwd, env, what)
    return run(["bash", "-e", "-o", "pipefail", "-c", code], cwd, env, what)
