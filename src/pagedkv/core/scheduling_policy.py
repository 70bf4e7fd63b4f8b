"""Scheduling policies: which waiting request is admitted next, and which running request
a preemption takes. Chosen by name from :data:`SCHEDULING_POLICY_MAP` (``--scheduling-policy``,
vLLM's flag and values).

- ``fcfs``: arrival order; a preempted request goes back to the front of the waiting queue;
  the running request admitted last is preempted first.
- ``priority``: by ``(priority, arrival_time)``, lower first (a request's ``priority``
  field, vLLM's convention). Running requests are served in that order each step, so a
  preemption takes the one with the highest value (latest arrival among equals). Waiting
  requests do not preempt running ones to get in: they are admitted as pages free up.
"""

from __future__ import annotations

from collections import deque

from pagedkv.core.request import Request


class FCFSPolicy:
    """First come, first served."""

    def add(self, waiting: deque[Request], req: Request) -> None:
        waiting.append(req)

    def requeue(self, waiting: deque[Request], req: Request) -> None:
        """A preempted request: ahead of everything that waits."""
        waiting.appendleft(req)

    def order_running(self, running: list[Request]) -> None:
        """Running requests in the order a step serves them (the last is preempted first)."""


class PriorityPolicy(FCFSPolicy):
    """Lower ``priority`` first; ties by arrival."""

    @staticmethod
    def key(req: Request) -> tuple[int, float]:
        return req.priority, req.arrival_time or 0.0

    def add(self, waiting: deque[Request], req: Request) -> None:
        """Insert after every request of a smaller or equal key (stable for equal keys)."""
        k = self.key(req)
        i = len(waiting)
        while i > 0 and self.key(waiting[i - 1]) > k:
            i -= 1
        waiting.insert(i, req)

    def requeue(self, waiting: deque[Request], req: Request) -> None:
        self.add(waiting, req)  # it keeps its arrival time, so it precedes later equals

    def order_running(self, running: list[Request]) -> None:
        running.sort(key=self.key)


SCHEDULING_POLICY_MAP: dict[str, type[FCFSPolicy]] = {"fcfs": FCFSPolicy, "priority": PriorityPolicy}
