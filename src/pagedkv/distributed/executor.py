"""TPExecutor: the engine's runner when the model is split over several processes.

Rank 0 lives in the engine's process beside the scheduler; ranks 1..N-1 are processes it
starts (``torch.multiprocessing``, spawn) or, under torchrun, the other ranks of the same
command. Each step the executor sends the plain-data ``SchedulerOutput`` to every worker,
then runs rank 0's own share; the all-reduces inside the forward keep the ranks in step.
Rank 0 alone samples.

Failure is fatal and loud: a worker that dies closes its sockets, so the step fails at
once; one that hangs fails the step after ``distributed_timeout`` seconds. The executor then
stops every worker and refuses further steps with the reason (the engine ends the step's
requests with that error; the server's ``/health`` answers 503). The group's collectives
cannot be trusted after a rank is lost, so there is no recovery short of a new engine.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedkv.config.engine import EngineConfig
from pagedkv.core.runner_io import ModelRunnerOutput, SchedulerOutput
from pagedkv.distributed.group import TPGroup, tp_env_rank
from pagedkv.distributed.worker import BuildRunner, load_timeout, share_threads, torchrun_worker, worker_main
from pagedkv.model.loader import resolve_model
from pagedkv.model.partition import partition


def _first_line(error: BaseException) -> str:
    """An error's first line without gloo's source path prefix and its trailing advice
    ("[.../pair.cc:537] Read error ...: Connection reset by peer. This is typically ...")."""
    text = str(error).splitlines()[0] if str(error) else ""
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", text)
    return text.split(" This is typically caused by")[0]


class TPGroupError(RuntimeError):
    """The tensor-parallel group lost a rank or timed out; the engine cannot step again."""


class TPExecutor:
    """Rank 0 of a tensor-parallel group; a runner (``execute``) once :meth:`attach` gives
    it rank 0's :class:`~pagedkv.worker.model_runner.ModelRunner`. Make it with :meth:`start`."""

    connector = None  # no KV connector under tensor parallelism (yet)

    def __init__(self, config: EngineConfig, group: TPGroup | None, procs: list, pipes: list, tmpdir: str | None,
                 threads: int) -> None:
        self.config, self.group, self.procs, self.pipes, self.tmpdir = config, group, procs, pipes, tmpdir
        self._threads = threads
        self.runner = None
        self.dead: str | None = None
        atexit.register(self.close)  # a process that ends without closing the engine still stops its workers

    @classmethod
    def start(cls, config: EngineConfig, build_runner: BuildRunner) -> "TPExecutor":
        """Start (or, under torchrun, join) the group; rank 0 returns. Every other rank runs
        ``build_runner(config, group)`` (:mod:`pagedkv.distributed.worker`), then serves
        steps; a torchrun rank >= 1 does so here and then exits the process.

        Raises:
            ValueError: the model cannot be split over ``tensor_parallel_size`` ranks.
            FileNotFoundError: the model is not found.
            TPGroupError: the ranks did not meet within ``distributed_timeout``.
        """
        world = config.tensor_parallel_size
        # a split that cannot work fails here, no process started
        partition(resolve_model(config.model).config, 0, world)
        if dist.is_initialized():
            raise ValueError("this process already holds a tensor-parallel engine (or another torch.distributed "
                             "group): close() it first; one tensor-parallel engine per process")
        env_rank = tp_env_rank()
        if env_rank is not None:
            if int(os.environ["WORLD_SIZE"]) != world:
                raise ValueError(f"torchrun started {os.environ['WORLD_SIZE']} ranks but tensor_parallel_size is "
                                 f"{world}: they must be equal")
            if env_rank != 0:
                torchrun_worker(config, build_runner)  # never returns
            threads = share_threads(world)
            return cls(config, TPGroup.from_env(config.distributed_timeout), [], [], None, threads)
        ctx = mp.get_context("spawn")
        tmpdir = tempfile.mkdtemp(prefix="pagedkv-tp-")
        init = (Path(tmpdir) / "rendezvous").as_uri()
        procs, pipes = [], []
        for rank in range(1, world):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=worker_main, args=(config, rank, world, init, send, build_runner), daemon=True,
                            name=f"pagedkv-tp-rank{rank}")
            p.start()
            procs.append(p)
            pipes.append(recv)
        threads = share_threads(world)
        ex = cls(config, None, procs, pipes, tmpdir, threads)
        try:
            ex._wait_started(config.distributed_timeout)
            ex.group = TPGroup(0, world, init, config.distributed_timeout)
        except Exception as e:  # noqa: BLE001
            raise ex._fail(e) from None
        return ex

    def _wait_started(self, timeout_s: float) -> None:
        """Until every worker says it is joining (a worker that dies while starting, e.g. a
        script without ``if __name__ == "__main__":`` under spawn, is reported at once)."""
        deadline = time.monotonic() + timeout_s
        for i, (p, pipe) in enumerate(zip(self.procs, self.pipes)):
            while not pipe.poll(0.05):
                if not p.is_alive():
                    hint = (" (a script that starts a tensor-parallel engine needs `if __name__ == \"__main__\":` "
                            "around it: the workers import it)")
                    raise RuntimeError(f"rank {i + 1} exited while starting (code {p.exitcode}){hint}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {i + 1} did not start within {timeout_s:g} s")
            msg = pipe.recv()
            if msg != "joining":
                raise RuntimeError(msg)

    def attach(self, runner) -> "TPExecutor":
        """Rank 0's runner; waits until every rank is built.

        Raises:
            TPGroupError: a worker failed while loading (its error is in the message).
        """
        self.runner = runner
        try:
            self.group.ready(load_timeout(self.config))
        except Exception as e:  # noqa: BLE001
            raise self._fail(e) from None
        if self.tmpdir is not None:  # every rank is past the store: the rendezvous file is done with
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None
        return self

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """One step on every rank; rank 0's result.

        Raises:
            TPGroupError: the group failed now or before (then every worker is stopped).
        """
        if self.dead is not None:
            raise TPGroupError(self.dead)
        if any(not p.is_alive() for p in self.procs):
            raise self._fail(None)
        try:
            self.group.send_step(out)
            return self.runner.execute(out)
        except Exception as e:  # noqa: BLE001 - any rank-0 failure leaves the workers mid-collective
            raise self._fail(e) from None
        except BaseException as e:  # Ctrl-C mid-step: the group cannot go on either; say so now, not at the next step
            self._fail(e)
            raise

    def check_health(self) -> None:
        """Raise :class:`TPGroupError` if the group failed or a worker process has exited
        (changes nothing: any thread may ask, e.g. a server's health check)."""
        if self.dead is not None:
            raise TPGroupError(self.dead)
        gone = [f"rank {i + 1} (exit code {p.exitcode})" for i, p in enumerate(self.procs) if not p.is_alive()]
        if gone:
            raise TPGroupError(f"tensor-parallel worker process gone: {', '.join(gone)}")

    def close(self) -> None:
        """Stop the workers and leave the group (idempotent); the engine cannot step after."""
        if self.dead is None and self.runner is not None:  # (before attach the workers are not listening)
            try:
                self.group.send_step(None)
            except Exception:  # noqa: BLE001 - stopping anyway
                pass
        self.dead = self.dead or "the engine was closed"
        self._stop()
        atexit.unregister(self.close)

    # ---- failure ---------------------------------------------------------------------
    def _fail(self, error: BaseException | None) -> TPGroupError:
        """Record why the group failed (the workers' own reports first), stop it, and
        return the error to raise."""
        for p in self.procs:
            p.join(0.5 if not p.is_alive() else 0.0)
        reasons = [r for r in (self._report(i) for i in range(len(self.procs))) if r]
        if error is not None:
            reasons.append(f"rank 0: {type(error).__name__}: {_first_line(error)}")
        self.dead = "the tensor-parallel group failed: " + "; ".join(reasons or ["unknown"])
        self._stop()
        return TPGroupError(self.dead)

    def _report(self, i: int) -> str | None:
        pipe, p = self.pipes[i], self.procs[i]
        try:
            while pipe.poll():
                msg = pipe.recv()
                if msg != "joining":
                    return msg
        except (EOFError, OSError):
            pass
        if not p.is_alive():
            return f"rank {i + 1}: the process exited (code {p.exitcode})"
        return None

    def _stop(self) -> None:
        for p in self.procs:
            p.join(5.0 if self.dead == "the engine was closed" else 0.0)
            if p.is_alive():
                p.kill()  # also ends a stopped (SIGSTOP) process
                p.join(5.0)
        if self.group is not None:
            self.group.close()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None
        torch.set_num_threads(self._threads)
