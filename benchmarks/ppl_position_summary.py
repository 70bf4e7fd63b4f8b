"""Pool ``pagedkv eval ppl --by-position`` outputs over several texts (BENCHMARKS.md, "Past
the model's positions"): for each saved output, the perplexity of its first bucket and of
every bucket from ``--beyond`` on, and both pooled over all the files given (the exp of the
summed negative log-likelihood over the summed tokens, each bucket's NLL = tokens x ln ppl).

    python benchmarks/ppl_position_summary.py --beyond 8192 benchmarks/results/ppl_by_position_streaming_cache.txt \
        benchmarks/results/ppl_by_position_ch{32-36,54-62,83-93}_streaming.txt
"""

from __future__ import annotations

import argparse
import math
import re

BUCKET = re.compile(r"positions\s+([\d,]+)-([\d,]+)\s+ppl\s+([\d.]+)\s+\((\d+) tokens\)")


def buckets(path: str) -> list[tuple[int, float, int]]:
    """``(start, ppl, tokens)`` of each bucket line in one saved output."""
    try:
        with open(path, encoding="utf-8") as f:
            found = [BUCKET.search(line) for line in f]
    except (OSError, UnicodeDecodeError) as e:
        raise SystemExit(f"{path}: cannot read it as text ({e})") from None
    return [(int(m[1].replace(",", "")), float(m[3]), int(m[4])) for m in found if m]


def nll(rows) -> tuple[float, int]:
    return sum(n * math.log(p) for _, p, n in rows), sum(n for _, _, n in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--beyond", type=int, default=8192, help="first position of the later part (default 8192)")
    a = p.parse_args()
    first_all, later_all = [0.0, 0], [0.0, 0]
    for path in a.files:
        rows = buckets(path)
        if not rows:
            raise SystemExit(f"{path}: no 'positions ... ppl' lines (an eval ppl --by-position output?)")
        first, later = nll(rows[:1]), nll([r for r in rows if r[0] >= a.beyond])
        if not later[1]:
            raise SystemExit(f"{path}: no bucket starts at or after position {a.beyond:,} (set --beyond)")
        for acc, part in ((first_all, first), (later_all, later)):
            acc[0], acc[1] = acc[0] + part[0], acc[1] + part[1]
        f, lt = math.exp(first[0] / first[1]), math.exp(later[0] / later[1])
        print(f"{path}: first {rows[0][2]:,} tokens {f:.2f}, from {a.beyond:,} ({later[1]:,} tokens) {lt:.2f}, "
              f"{(lt / f - 1) * 100:+.1f}%")
    f, lt = math.exp(first_all[0] / first_all[1]), math.exp(later_all[0] / later_all[1])
    print(f"pooled over {len(a.files)}: first {f:.2f}, from {a.beyond:,} {lt:.2f}, {(lt / f - 1) * 100:+.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
