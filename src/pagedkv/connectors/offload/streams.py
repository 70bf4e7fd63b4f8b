"""Streams and events for KV page copies beside the forward (the GPU's CPU tier and swap).

The forward runs on the **compute** stream. Page loads and swaps run on a **copy** stream,
saves on a **save** stream, so PCIe copies overlap the layers' compute; events order them
where pages are shared:

- a layer's save starts after the event recorded on the compute stream once that layer
  wrote its pages (:meth:`Streams.record` then :meth:`Streams.wait`);
- a layer reads its pages after the event the copy stream recorded once that layer's
  loads landed;
- the copy stream starts after an event the compute stream recorded at the step's start
  (what the previous step wrote is there to be swapped out);
- the host waits (:meth:`Streams.synchronize`) only at the step's end, for the step's own
  copies, so no page or tier slot is reused while a copy of it is in flight.

Three implementations of one small interface: :class:`CudaStreams` (torch CUDA streams and
events), :class:`InlineStreams` (the CPU: every op runs at once on the calling thread, in
issue order, which is stream order) and, for the tests, a fake clock with a happens-before
checker (``tests/fake_streams.py``) that runs the same worker code and flags any two
accesses of one page that no stream order or event orders.

An op is launched with the pages it ``reads`` and ``writes`` (``(pool, layer, page)``
tuples) and the bytes it moves (``nbytes``); only the fake uses them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

Access = tuple[str, int, int]  # (pool: "device" | "tier", layer, page or slot)


class InlineStreams:
    """Every op runs at once, in the order issued: the CPU's single queue. Events are
    ``perf_counter`` readings (for :meth:`elapsed`)."""

    compute = copy = save = "inline"

    def launch(self, stream, fn: Callable[[], object], reads: Iterable[Access] = (),
               writes: Iterable[Access] = (), nbytes: int = 0):
        return fn()

    def record(self, stream) -> float:
        return time.perf_counter()

    def wait(self, stream, event) -> None:
        pass

    def synchronize(self, event) -> None:
        pass

    def elapsed(self, start, end) -> float:
        """Seconds between two recorded events (both complete)."""
        return max(0.0, end - start)


class CudaStreams:
    """torch CUDA streams: the compute stream is the one current when an op is issued (the
    forward's); copies and saves have a stream each on ``device``. Events time with
    ``enable_timing`` so loads and swaps are priced by what the GPU measured."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copy = torch.cuda.Stream(device)
        self.save = torch.cuda.Stream(device)

    @property
    def compute(self):
        return torch.cuda.current_stream(self.device)

    def launch(self, stream, fn: Callable[[], object], reads: Iterable[Access] = (),
               writes: Iterable[Access] = (), nbytes: int = 0):
        with torch.cuda.stream(stream):
            return fn()

    def record(self, stream):
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def synchronize(self, event) -> None:
        event.synchronize()

    def elapsed(self, start, end) -> float:
        return start.elapsed_time(end) / 1e3  # ms -> s


def streams_for(device: torch.device):
    """The streams of a KV cache on ``device``: CUDA streams on a GPU, inline on the CPU."""
    return CudaStreams(device) if device.type == "cuda" else InlineStreams()
