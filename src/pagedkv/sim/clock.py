"""The simulator's virtual clock: seconds that pass only when the simulation says so.

The engine core reads it as its clock (arrival and token times), the benchmark driver
reads it for arrivals and sleeps on it while the engine is idle, and the cost-model
runner advances it by each step's modelled seconds. Nothing waits in real time.
"""

from __future__ import annotations


class VirtualClock:
    """A clock that starts at ``start`` seconds and moves only forward.

    Calling it returns the time (as ``time.perf_counter`` does); :meth:`advance` and
    :meth:`sleep` move it on by a duration, :meth:`set` to a later instant.

    Raises:
        ValueError: a negative or non-finite duration, or an instant in the past.
    """

    def __init__(self, start: float = 0.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if not 0.0 <= seconds < float("inf"):
            raise ValueError(f"the clock moves forward by a finite duration, got {seconds!r} s")
        self.now += seconds

    sleep = advance  # the benchmark driver's idle wait

    def set(self, instant: float) -> None:
        if instant < self.now:
            raise ValueError(f"the clock cannot go back from {self.now} s to {instant} s")
        self.now = float(instant)
