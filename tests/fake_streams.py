"""A fake GPU for the copy streams: the interface of :mod:`pagedkv.connectors.offload.streams`
with a happens-before race checker and a modelled clock.

Ops run at once on the calling thread (so data stays checkable), while the fake keeps what
a GPU would guarantee about them:

- **Happens-before**, by vector clocks: each stream and the host carry a clock; a launch
  joins the host's clock (what the host did before launching comes first) and ticks its
  stream's; ``record`` snapshots a stream's clock into an event, ``wait`` joins an event
  into a stream, ``synchronize`` joins it into the host. Two accesses of one
  ``(pool, layer, page)`` at least one of which writes, on different streams, race unless
  the first's tick is in the second's clock. :attr:`FakeStreams.races` lists them.
- **Time**: each op starts when its stream is free, when the events its stream waited on
  have happened, and not before the host launched it; it lasts its ``cost`` plus its
  ``nbytes`` at ``link_bytes_per_s``. ``synchronize``
  moves the host's clock to the event's time. :attr:`FakeStreams.ops` keeps
  ``(stream, label, start, end)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

STREAMS = ("compute", "copy", "save")


@dataclass
class Event:
    clock: dict[str, int]
    time: float


@dataclass
class _Stream:
    name: str
    clock: dict[str, int] = field(default_factory=dict)
    time: float = 0.0     # when its last op ends
    ready: float = 0.0    # the latest event it waited on


def _join(a: dict[str, int], b: dict[str, int]) -> None:
    for k, v in b.items():
        a[k] = max(a.get(k, 0), v)


class FakeStreams:
    """The streams interface with race checking and a clock (see the module docstring)."""

    def __init__(self, link_bytes_per_s: float = 1e9) -> None:
        self.link_bytes_per_s = link_bytes_per_s
        self.compute, self.copy, self.save = (_Stream(n) for n in STREAMS)
        self.host = _Stream("host")
        self.ops: list[tuple[str, str, float, float]] = []
        self.races: list[str] = []
        self._last: dict[tuple, list[tuple[str, int, bool, str]]] = {}  # access -> [(stream, tick, write, label)]

    def launch(self, stream: _Stream, fn, reads=(), writes=(), nbytes: int = 0, cost: float = 0.0, label: str = ""):
        _join(stream.clock, self.host.clock)
        stream.clock[stream.name] = stream.clock.get(stream.name, 0) + 1
        start = max(stream.time, stream.ready, self.host.time)
        stream.time = start + cost + nbytes / self.link_bytes_per_s
        label = label or getattr(fn, "__qualname__", "op")
        self.ops.append((stream.name, label, start, stream.time))
        tick = stream.clock[stream.name]
        for acc, write in [(a, False) for a in reads] + [(a, True) for a in writes]:
            self._check(acc, stream, tick, write, label)
        return fn()

    def _check(self, acc, stream: _Stream, tick: int, write: bool, label: str) -> None:
        seen = self._last.setdefault(acc, [])
        for other, other_tick, other_write, other_label in seen:
            if other != stream.name and (write or other_write) and stream.clock.get(other, 0) < other_tick:
                self.races.append(f"{acc}: {other_label} on {other} unordered with {label} on {stream.name}")
        seen.append((stream.name, tick, write, label))

    def record(self, stream: _Stream) -> Event:
        return Event(dict(stream.clock), stream.time)

    def wait(self, stream: _Stream, event: Event) -> None:
        _join(stream.clock, event.clock)
        stream.ready = max(stream.ready, event.time)

    def synchronize(self, event: Event) -> None:
        _join(self.host.clock, event.clock)
        self.host.time = max(self.host.time, event.time)

    def elapsed(self, start: Event, end: Event) -> float:
        return max(0.0, end.time - start.time)

    def host_op(self, cost: float = 0.0) -> None:
        """The host spends ``cost`` seconds (e.g. launching the next step)."""
        self.host.time += cost

    def ends(self, stream: str, label: str) -> list[tuple[float, float]]:
        """``(start, end)`` of each op on ``stream`` whose label contains ``label``."""
        return [(s, e) for n, lab, s, e in self.ops if n == stream and label in lab]
