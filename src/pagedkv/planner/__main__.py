"""``python -m pagedkv.planner ...``: the ``plan`` subcommand on its own (same flags as ``pagedkv plan``)."""

from __future__ import annotations

import argparse
import sys

from pagedkv.planner.cli import add_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.planner")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["plan"] + argv  # `python -m pagedkv.planner --model x` means `plan --model x`
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
