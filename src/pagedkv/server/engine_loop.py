"""EngineLoop: one thread owns the LLMEngine; HTTP handlers talk to it through queues.

``LLMEngine`` is not thread-safe, so exactly one thread touches it::

    HTTP handlers (asyncio) --add/abort--> command queue --> engine thread
                                                              | drain commands
                                                              | engine.step()  (all requests of
                                                              |   all connections in one batch)
    per-request OutputSink <--call_soon_threadsafe-- outputs

Commands are handled in arrival order, so an ``abort`` queued after an ``add`` always
finds the request. Every request ends with exactly one ``finished`` RequestOutput in its
sink (``stop``, ``length`` or ``abort``), or with an exception if the engine failed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable

from pagedkv.core.sampling_params import SamplingParams
from pagedkv.engine.engine import LLMEngine
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.stats import EngineStats

log = logging.getLogger("pagedkv.server")


class EngineUnavailable(RuntimeError):
    """The engine loop is stopped or failed; no request can be served."""


@dataclass
class NewRequest:
    request_id: str
    prompt: dict                      # {"prompt_token_ids": [...], "prompt": str | None}
    params: SamplingParams
    priority: int = 0                 # the engine's scheduling priority (lower first)


class OutputSink:
    """Where one HTTP request's engine outputs arrive, on its event loop, as ``(tag, item)``
    (``tag``: the choice index; ``item``: a RequestOutput or the exception that ended it).

    Outputs are cumulative, so only the latest per choice is kept: a client that reads
    slowly (or not at all) costs one output per choice, not a copy of its token ids and
    log-probs per engine step. A terminal item (a finished output, an exception) is never
    replaced. Not thread-safe: the engine thread puts through ``call_soon_threadsafe``.
    """

    def __init__(self) -> None:
        self._latest: dict[int, RequestOutput | BaseException] = {}
        self._ready = asyncio.Event()

    def put_nowait(self, item: tuple[int, RequestOutput | BaseException]) -> None:
        tag, out = item
        prev = self._latest.get(tag)
        if isinstance(prev, BaseException) or (prev is not None and prev.finished):
            return
        self._latest[tag] = out
        self._ready.set()

    def pending(self) -> int:
        """How many choices have news waiting."""
        return len(self._latest)

    async def get_batch(self) -> dict[int, RequestOutput | BaseException]:
        """Wait for news, then take all of it: ``{tag: latest item}``."""
        while not self._latest:
            self._ready.clear()
            await self._ready.wait()
        batch, self._latest = self._latest, {}
        return batch


@dataclass
class _Route:
    sink: OutputSink                  # receives (tag, RequestOutput | BaseException)
    tag: int
    loop: asyncio.AbstractEventLoop


@dataclass
class _Add:
    requests: list[NewRequest]
    cache_salt: str | None
    sink: OutputSink
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future


_STOP = object()
IDLE_STATS_REFRESH_S = 1.0  # how stale /metrics may be on an engine with no requests


class EngineLoop:
    """Drives ``engine`` in a daemon thread. ``observer(outputs)`` (engine thread) sees every
    batch of outputs, e.g. to update metrics."""

    def __init__(self, engine: LLMEngine,
                 observer: Callable[[list[RequestOutput]], None] | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self.stats: EngineStats = engine.stats()  # latest snapshot: after every step, every second when idle
        self.error: BaseException | None = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}     # engine thread only
        self._thread: threading.Thread | None = None
        self._stopped = False

    # ---- any thread --------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort every request still in the engine, then end the thread."""
        if self._thread is not None and self._thread.is_alive():
            self._cmds.put(_STOP)
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        """The loop runs, no step failed, and the engine can step (its tensor-parallel ranks live)."""
        return self.unavailable_reason() is None

    def unavailable_reason(self) -> str | None:
        """Why the engine cannot serve (a failed step's error, a lost tensor-parallel rank), or None."""
        if self._thread is None or not self._thread.is_alive():
            return "the engine is not running"
        if self.error is not None:
            first = str(self.error).splitlines()[0] if str(self.error) else type(self.error).__name__
            return f"an engine step failed: {first}"
        try:
            self.engine.check_health()
        except Exception as e:  # noqa: BLE001 - any reason: unhealthy
            return str(e).splitlines()[0] if str(e) else type(e).__name__
        return None

    def abort(self, request_ids: list[str]) -> None:
        """Abort requests (unknown or finished ids are ignored). Never blocks."""
        if request_ids:
            self._cmds.put(("abort", list(request_ids)))

    def abort_all(self) -> None:
        """Abort every request in the engine (each stream ends with finish_reason 'abort')."""
        self._cmds.put(("abort_all",))

    def release_transfer(self, kv_transfer_params: dict) -> None:
        """A decode leg refused before it reached the engine (a bad body, an unknown model):
        the producer's pages it would have pulled are released now (:meth:`LLMEngine.release_kv_transfer`).
        Never blocks."""
        self._cmds.put(("release", kv_transfer_params))

    def begin_drain(self, max_step_tokens: int = 256) -> None:
        """Shutdown began: cap each step at ``max_step_tokens`` (prefill chunks get shorter;
        decodes go on), so the abort at the drain's end waits for one short step, not for
        a long prefill chunk (2,048 tokens can take seconds on a small CPU)."""
        self._cmds.put(("drain", max_step_tokens))

    async def add(self, requests: list[NewRequest], sink: OutputSink,
                  cache_salt: str | None = None) -> None:
        """Add ``requests`` atomically; their outputs go to ``sink`` as ``(index, output)``.

        Raises:
            ValueError: a request can never run (the message names its index when there
                are several); then none of them was added.
            EngineUnavailable: the loop is stopped or failed.
        """
        reason = self.unavailable_reason()
        if reason is not None:
            raise EngineUnavailable(reason)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._cmds.put(_Add(requests, cache_salt, sink, loop, done))
        await done

    # ---- engine thread -----------------------------------------------------------
    def _run(self) -> None:
        stopping = False
        while not stopping:
            idle = self.error is not None or not self.engine.has_unfinished_requests()
            for cmd in self._drain(block=idle):
                if cmd is _STOP:
                    stopping = True
                else:
                    self._handle(cmd)
            if not stopping and self.error is None and self.engine.has_unfinished_requests():
                self._step()
            self.stats = self.engine.stats()
        self._abort_all()
        self.engine.close()  # finish the KV tiers' writes, release the disk directory
        self.stats = self.engine.stats()
        self._stopped = True

    def _drain(self, block: bool) -> list:
        cmds = []
        if block:  # an idle engine still refreshes its stats (e.g. a KV link that went down) every second
            try:
                cmds.append(self._cmds.get(timeout=IDLE_STATS_REFRESH_S))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self._cmds.get_nowait())
            except queue.Empty:
                return cmds

    def _handle(self, cmd) -> None:
        if isinstance(cmd, _Add):
            self._add(cmd)
        elif cmd[0] == "abort_all":
            self._abort_all()
        elif cmd[0] == "drain":
            self.engine.scheduler.cap_step_tokens(cmd[1])
        elif cmd[0] == "abort":
            self._deliver([o for rid in cmd[1] if (o := self.engine.abort_request(rid)) is not None])
        elif cmd[0] == "release":
            self.engine.release_kv_transfer(cmd[1])

    def _add(self, cmd: _Add) -> None:
        if self.error is not None:
            return _resolve(cmd.loop, cmd.done, EngineUnavailable("the engine failed"))
        added: list[str] = []
        try:
            for i, r in enumerate(cmd.requests):
                try:
                    self.engine.add_request(r.prompt, r.params, r.request_id, cache_salt=cmd.cache_salt,
                                            priority=r.priority)
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}" if len(cmd.requests) > 1 else str(e)) from None
                added.append(r.request_id)
                self._routes[r.request_id] = _Route(cmd.sink, i, cmd.loop)
        except Exception as e:  # noqa: BLE001 - reported to the one caller, the engine goes on
            for rid in added:
                self.engine.abort_request(rid)
                self._routes.pop(rid, None)
            for r in cmd.requests[len(added) + 1:]:  # never added, or aborted: their prefill legs' leases go now
                self.engine.release_transfer(r.params)
            self.engine.release_transfer(None)  # (a step that carries the aborted ones' releases too)
            if not isinstance(e, ValueError):
                log.exception("add_request failed")
            return _resolve(cmd.loop, cmd.done, e)
        _resolve(cmd.loop, cmd.done, None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - the engine's state is unknown: fail everything
            log.exception("engine step failed; the server stops serving")
            self.error = e
            self._fail_all(EngineUnavailable("the engine failed"))
            return
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if not outputs:
            return
        if self.observer is not None:
            try:
                self.observer(outputs)
            except Exception:  # noqa: BLE001 - metrics must never stop serving
                log.exception("output observer failed")
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            route = self._routes.pop(out.request_id, None) if out.finished else self._routes.get(out.request_id)
            if route is not None:
                by_loop.setdefault(route.loop, []).append((route.sink, route.tag, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening
                self.abort([o.request_id for _, _, o in items if not o.finished])

    def _abort_all(self) -> None:
        self._deliver([o for rid in list(self._routes) if (o := self.engine.abort_request(rid)) is not None])

    def _fail_all(self, err: BaseException) -> None:
        for rid, route in list(self._routes.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                pass
            try:
                route.loop.call_soon_threadsafe(route.sink.put_nowait, (route.tag, err))
            except RuntimeError:
                pass
        self._routes.clear()


def _put_all(items: list) -> None:
    for sink, tag, out in items:
        sink.put_nowait((tag, out))


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, err: BaseException | None) -> None:
    def set_() -> None:
        if fut.done():
            return
        if err is None:
            fut.set_result(None)
        else:
            fut.set_exception(err)
    try:
        loop.call_soon_threadsafe(set_)
    except RuntimeError:
        pass
