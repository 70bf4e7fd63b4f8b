"""``python -m pagedkv.server [serve flags]``: the ``serve`` command on its own."""

import argparse
import sys

from pagedkv.server.cli import add_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedkv.server")
    sub = parser.add_subparsers(dest="command")
    add_parser(sub)
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
