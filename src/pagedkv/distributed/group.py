"""One tensor-parallel group over torch.distributed (gloo: CPU tensors, TCP between ranks).

Two process groups over the same ranks:

- the *compute* group carries the all-reduces inside the forward, with the engine's
  ``distributed_timeout``: a rank that dies closes its sockets and its peers' collective
  fails at once; a rank that hangs makes them fail when the timeout ends;
- the *control* group carries each step's :class:`~pagedkv.core.runner_io.SchedulerOutput`
  (pickled) from rank 0 (the scheduler's process) to the workers, who wait there between
  steps for as long as the engine is idle (its timeout is a day; a rank-0 exit still ends the
  wait at once). Rank 0's sends wait at most the compute timeout: gloo sends only when the
  receiver asks, so a hung worker would otherwise hold rank 0 for that day.
"""

from __future__ import annotations

import datetime
import os
import pickle

import torch
import torch.distributed as dist

IDLE_TIMEOUT = datetime.timedelta(days=1)  # a worker waits this long for the next step


class TPGroup:
    """This process's membership of a tensor-parallel group.

    Args:
        rank, world: this rank and the group's size.
        init_method: torch.distributed's rendezvous (``file://...`` for ranks the engine
            starts, ``env://`` under torchrun).
        timeout_s: the compute group's collective timeout in seconds.

    Raises:
        RuntimeError: the rendezvous did not complete within ``timeout_s``.
    """

    def __init__(self, rank: int, world: int, init_method: str, timeout_s: float) -> None:
        self.rank, self.world = rank, world
        self.timeout = timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=timeout)
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.closed = False

    @classmethod
    def from_env(cls, timeout_s: float) -> "TPGroup":
        """The group torchrun set up (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``)."""
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", timeout_s)

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks, in place (every rank gets the same bits)."""
        dist.all_reduce(t)

    def send_step(self, step) -> None:
        """Rank 0: give the workers the next step (None: stop). Waits at most the compute
        timeout for them to take it (gloo sends only once the receiver asks).

        Raises:
            RuntimeError: a worker did not take it in time, or is gone.
        """
        data = pickle.dumps(step, protocol=pickle.HIGHEST_PROTOCOL)
        size = torch.tensor([len(data)], dtype=torch.int64)
        for t in (size, torch.frombuffer(bytearray(data), dtype=torch.uint8)):
            dist.broadcast(t, src=0, group=self.control, async_op=True).wait(self.timeout)

    def recv_step(self):
        """A worker: wait for rank 0's next step (None: stop)."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=self.control)
        return pickle.loads(data.numpy().tobytes())

    def ready(self, timeout_s: float) -> None:
        """Wait until every rank has built its parts, at most ``timeout_s`` (loading may take
        longer than a step; a rank that failed has closed its sockets)."""
        dist.barrier(group=self.control, async_op=True).wait(datetime.timedelta(seconds=timeout_s))

    def close(self) -> None:
        """Leave the group (idempotent)."""
        if not self.closed:
            self.closed = True
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a broken group may refuse; the process still leaves it
                pass


def tp_env_rank() -> int | None:
    """This process's rank when torchrun started it with more than one rank, else None."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return None
