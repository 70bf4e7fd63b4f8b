"""Print the tables, ratios and goals of saved ``pagedkv bench --output`` JSON files
(the text BENCHMARKS.md quotes), without running anything.

    python benchmarks/summarize_results.py benchmarks/results/*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from pagedkv.bench.cli import text_report
from pagedkv.bench.report import validate


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    for p in paths:
        doc = json.loads(Path(p).read_text())
        validate(doc)
        print(f"## {p}\n\ncode: {doc.get('code', {}).get('commit')} "
              f"(modified: {', '.join(doc.get('code', {}).get('modified') or []) or 'none'})\n")
        print(text_report(doc), end="\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
