"""How much of the machine other processes took during a run (Linux ``/proc/stat``).

These machines are shared: another process's threads on the same cores slow every run
down, by up to 10x when OpenMP threads of two processes fight over two cores. Each run
records, from ``/proc/stat`` (all CPUs' busy ticks) and ``os.times()`` (this process and
its children)::

    others_cpu_share = (busy CPU seconds of the machine - this process's) / (wall * CPUs)
    own_cpu_share    = this process's CPU seconds / (wall * CPUs)

0 means the run had the machine to itself; 0.5 on 2 CPUs means another process kept one
core busy throughout. ``None`` where ``/proc/stat`` is not readable.
"""

from __future__ import annotations

import os
import time


def _busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)   # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class LoadMeter:
    """``with LoadMeter() as m: ...`` then ``m.result()``."""

    def __enter__(self) -> "LoadMeter":
        self.t0, self.busy0, self.own0 = time.perf_counter(), _busy_seconds(), _own_seconds()
        return self

    def __exit__(self, *exc) -> None:
        self.t1, self.busy1, self.own1 = time.perf_counter(), _busy_seconds(), _own_seconds()

    def result(self) -> dict:
        wall, cpus = self.t1 - self.t0, os.cpu_count() or 1
        own = self.own1 - self.own0
        if self.busy0 is None or self.busy1 is None or wall <= 0:
            return {"others_cpu_share": None, "own_cpu_share": own / (wall * cpus) if wall > 0 else None}
        others = max(0.0, (self.busy1 - self.busy0) - own)
        return {"others_cpu_share": others / (wall * cpus), "own_cpu_share": own / (wall * cpus)}
