"""A tensor-parallel worker: ranks 1..N-1 build their share of the model and pages, then
run each step rank 0 sends (no sampling: rank 0 alone turns the hidden states into tokens).

What a rank builds is the engine's business: it hands :meth:`TPExecutor.start
<pagedkv.distributed.executor.TPExecutor.start>` a ``build_runner(config, group)`` (a
module-level function, so a spawned process can import it) that returns the rank's runner.

A worker that fails reports one line to the engine (when the engine started it) and exits,
which closes its sockets, so rank 0's next collective fails at once instead of waiting.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

import torch

from pagedkv.config.engine import EngineConfig
from pagedkv.distributed.group import TPGroup

#: ``build_runner(config, group) -> runner``: a rank's share of the model and pages, ready to
#: ``execute`` the plain-data steps rank 0 sends
BuildRunner = Callable[[EngineConfig, TPGroup], object]


def share_threads(world: int) -> int:
    """Give this rank its share of the machine's cores (the ranks run side by side); returns
    the thread count it had."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    return before


def load_timeout(config: EngineConfig) -> float:
    """Seconds every rank may take to load its share before the group gives up: ten step
    timeouts (ten minutes by default)."""
    return 10 * config.distributed_timeout


def serve_steps(config: EngineConfig, group: TPGroup, build_runner: BuildRunner) -> None:
    """Build this rank's runner, say ready, then run steps until rank 0 sends None."""
    runner = build_runner(config, group)
    group.ready(load_timeout(config))
    while (step := group.recv_step()) is not None:
        runner.execute(step)
    group.close()


def worker_main(config: EngineConfig, rank: int, world: int, init_method: str, errors,
                build_runner: BuildRunner) -> None:
    """Entry of a worker process the engine spawned; ``errors`` (a pipe's sending end) gets
    one line if it fails. Never returns normally: exits 0 when told to stop, else 1."""
    share_threads(world)
    try:
        errors.send("joining")
        serve_steps(config, TPGroup(rank, world, init_method, config.distributed_timeout), build_runner)
    except BaseException as e:  # noqa: BLE001 - reported, then this rank leaves
        traceback.print_exc(file=sys.stderr)
        try:
            errors.send(f"rank {rank}: {type(e).__name__}: {e}")
        except Exception:  # noqa: BLE001 - the engine is gone
            pass
        os._exit(1)
    os._exit(0)


def torchrun_worker(config: EngineConfig, build_runner: BuildRunner) -> None:
    """Rank >= 1 under torchrun: serve rank 0's steps, then exit the process (0, or 1 with
    the error printed)."""
    share_threads(config.tensor_parallel_size)
    try:
        serve_steps(config, TPGroup.from_env(config.distributed_timeout), build_runner)
    except BaseException:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        os._exit(1)
    os._exit(0)
