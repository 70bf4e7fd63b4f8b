"""A/B of ``ggml_a8_linear`` build variants on one decode step's products, in one process.

Builds renamed copies of ``attention/csrc/ggml_a8_linear.cpp`` (op
``torch.ops.pagedkv.ggml_a8_linear_<name>``) with the engine's compiler flags plus each
variant's ``-D`` flags, checks that every copy gives the engine kernel's bits on the step's
first products, then times all of the default model's layer products and its LM head at
``--rows`` activation rows (real weights, as the engine holds them with ``--weight-dtype
auto --activation-dtype int8``), the variants interleaved round by round: one machine's
drift lands on all of them alike. Prints the median and fastest pass of each and the ratio
to the first variant. Macros the kernel reads: ``PAGEDKV_A8_ROW_PANELS`` (1, 2 or 4 panels
one activation row reads at once), ``PAGEDKV_A8_PREFETCH_BLOCKS``, and for two or more rows
``PAGEDKV_A8_TILE_ROWS`` (2-8), ``PAGEDKV_A8_TILE_PANELS`` (1-4) and ``PAGEDKV_A8_CHAINS`` (VNNI: 1
or 2 integer accumulators per (row, panel)). ``NAME=FILE:...`` builds FILE instead of the current
source, e.g. an earlier commit's (``git show COMMIT:src/pagedkv/kernels/cpu/csrc/ggml_a8_linear.cpp
> old.cpp``), to A/B a code change; its bits must still match the engine kernel's.

    python benchmarks/ab_ggml_a8_variants.py --rows 1 --rounds 30 \\
        --variant four:-DPAGEDKV_A8_ROW_PANELS=4,-DPAGEDKV_A8_PREFETCH_BLOCKS=8 \\
        --variant one:-DPAGEDKV_A8_ROW_PANELS=1,-DPAGEDKV_A8_PREFETCH_BLOCKS=24
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_ggml_rows import products_of
from torch.utils import cpp_extension
from tp_equivalence import cpu_name

from pagedkv.config.engine import EngineConfig
from pagedkv.engine.engine import LLMEngine
from pagedkv.kernels.cpu.library import CSRC, LDFLAGS, cflags
from pagedkv.model.int8_weights import kernel_op


def renamed_source(name: str, source: Path | None = None) -> str:
    """The kernel's source (or ``source``) with its op, namespace and registration renamed for ``name``."""
    path = source or CSRC / "ggml_a8_linear.cpp"
    s = path.read_text()
    edits = [('m.def("ggml_a8_linear(', f'm.def("ggml_a8_linear_{name}('),
             ("namespace pagedkv {", f"namespace pagedkv_{name} {{"),
             ("}  // namespace pagedkv\n", f"}}  // namespace pagedkv_{name}\n"),
             ("&pagedkv::ggml_a8_linear", f"&pagedkv_{name}::ggml_a8_linear")]
    for old, new in edits:
        if old not in s:
            raise SystemExit(f"{path} does not hold {old!r}: not a ggml_a8_linear.cpp (or update renamed_source)")
        s = s.replace(old, new)
    return s


def build(name: str, defines: list[str], root: Path, source: Path | None = None):
    """Compile variant ``name`` (of ``source``, default the engine's) and return its op."""
    d = root / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "kernel.cpp").write_text(renamed_source(name, source))
    cpp_extension.load(name=f"pagedkv_ab_{name}", sources=[str(d / "kernel.cpp")],
                       extra_cflags=cflags() + [f"-I{CSRC}"] + defines, extra_ldflags=list(LDFLAGS),
                       build_directory=str(d), is_python_module=False, verbose=False)
    return getattr(torch.ops.pagedkv, f"ggml_a8_linear_{name}")


def parse_variant(text: str) -> tuple[str, list[str], Path | None]:
    head, _, flags = text.partition(":")
    name, _, source = head.partition("=")
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name):
        raise SystemExit(f"--variant {text!r}: NAME[=FILE]:FLAG,FLAG with NAME a C identifier")
    if source:
        if not Path(source).is_file():
            raise SystemExit(f"--variant {text!r}: no file {source!r}")
        try:
            renamed_source(name, Path(source))  # a text file holding the kernel's op and namespace
        except UnicodeDecodeError:
            raise SystemExit(f"--variant {text!r}: {source!r} is not a text file") from None
    flags = [f for f in flags.split(",") if f]
    if any(not f.startswith("-D") for f in flags):
        raise SystemExit(f"--variant {text!r}: only -D flags")
    return name, flags, Path(source) if source else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", required=True,
                   help="NAME[=FILE]:-DX=1,-DY=2 (repeatable; first: the base)")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--rounds", type=int, default=30)
    a = p.parse_args()
    if a.rows < 1 or a.rounds < 1:
        p.error("--rows and --rounds must be >= 1")
    variants = [parse_variant(v) for v in a.variant]
    names = [v[0] for v in variants]
    if len(set(names)) != len(names):
        p.error(f"--variant names must differ: {', '.join(names)}")
    reference = kernel_op("ggml_a8_linear")
    if reference is None:
        raise SystemExit("the ggml_a8_linear kernel is not available here (see the warning above)")
    products = products_of(LLMEngine(EngineConfig(activation_dtype="int8")).model, lm_head=True)
    step = products["layers"] + products["LM head"]
    xs = {k: torch.randn(a.rows, k) for k in {w[1] for w in step}}
    with tempfile.TemporaryDirectory(prefix="pagedkv_ab_") as root:
        ops = {name: build(name, flags, Path(root), source) for name, flags, source in variants}
        for name, op in ops.items():
            for w in step[:8]:
                if not torch.equal(op(xs[w[1]], w[0], w[3], w[2]), reference(xs[w[1]], w[0], w[3], w[2])):
                    raise SystemExit(f"variant {name} does not give the engine kernel's bits")
        times = {name: [] for name in ops}
        for r in range(a.rounds + 1):  # round 0 warms up
            for name, op in ops.items():
                t = time.perf_counter()
                for w in step:
                    op(xs[w[1]], w[0], w[3], w[2])
                if r:
                    times[name].append(time.perf_counter() - t)
    base = statistics.median(times[variants[0][0]])
    nbytes = sum(w[0].numel() for w in step)
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, {len(step)} products ({nbytes / 1e6:.1f} MB), "
          f"{a.rows} row(s), medians of {a.rounds}")
    for name, flags, source in variants:
        m = statistics.median(times[name])
        print(f"  {name:12s} {1e3 * m:8.3f} ms (fastest {1e3 * min(times[name]):.3f}; {nbytes / m / 1e9:5.1f} GB/s)"
              f"  {base / m:.3f}x  {' '.join(flags)}{f' ({source})' if source else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
