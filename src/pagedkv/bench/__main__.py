"""``python -m pagedkv.bench throughput ...``: the ``bench`` command on its own."""

import sys

from pagedkv.bench.cli import main

sys.exit(main(["bench", *sys.argv[1:]]))
