"""The KV connector seam: where offload tiers and prefill/decode transfer plug in.

A connector moves KV pages between this engine's pool and somewhere else (a CPU or disk
tier, another engine). It has two halves, named as vLLM's KV connector v1 API:

- the **scheduler side** (:class:`KVConnectorScheduler`) runs in the scheduler: it says
  how many more prompt tokens it can supply beyond the local prefix hit
  (``get_num_new_matched_tokens``), learns which pages were allocated for them
  (``update_state_after_alloc``), says at a request's end whether it still needs the
  pages (``request_finished``: a delayed free), may keep a preempted request's KV
  (``swap_plan`` prices it, ``swap_out`` keeps it; the request's resume then finds it
  through ``get_num_new_matched_tokens``), and packs what the worker must do this step into
  plain data (``build_connector_meta``, carried by the SchedulerOutput);
- the **worker side** (:class:`KVConnectorWorker`) runs beside the model: it starts loads
  before the forward (``start_load_kv``), blocks until a layer's pages are in
  (``wait_for_layer_load``), saves a layer's pages after they are written
  (``save_kv_layer``), waits for saves to end (``wait_for_save``) and reports finished
  asynchronous transfers (``get_finished``) and pages whose load failed
  (``get_block_ids_with_load_errors``).

Step order::

    scheduler: [preemption: swap_plan -> swap_out (or recompute)] -> lookup local
               -> get_num_new_matched_tokens -> allocate -> update_state_after_alloc
               -> build_connector_meta -> SchedulerOutput
    worker:    bind_connector_metadata -> start_load_kv -> per layer: wait_for_layer_load,
               attention, save_kv_layer -> wait_for_save -> get_finished,
               get_connector_output -> clear
    scheduler: update(ModelRunnerOutput): invalid pages -> load_failure_policy;
               update_connector_output; finished_sending -> free delayed pages

Load failure policy (``load_failure_policy``): ``recompute`` (the default) rolls a request
with a page whose load failed back to the last block before that page; the tokens after it
are computed again next step (its token sampled from bad KV is dropped). ``fail`` ends the
request with an error instead (the prefill/decode consumer's ``kv_load_failure_policy``;
the policies: :data:`pagedkv.config.kv_transfer.LOAD_FAILURE_POLICIES`). This module is
plain Python: the base classes do nothing (no transfer), so an engine with the base
connector behaves as one without.

Where the two halves live: :mod:`pagedkv.connectors.offload` (CPU and disk tiers, swap) and
:mod:`pagedkv.connectors.pd` (prefill/decode transfer); a new connector is a new folder
beside them, subclassing these two classes.
"""

from __future__ import annotations

from typing import NamedTuple


class SwapPlan(NamedTuple):
    """What swapping a preempted request out (and back in on resume) would move.

    Attributes:
        copy_blocks: pages copied out now and back on resume.
        copy_bytes: their bytes, one way.
        copy_seconds: predicted seconds of both copies at the connector's measured copy
            rate (0.0 when it has none yet).
        kept_tokens: tokens whose KV the swap keeps (the request's computed tokens).
        reused_tokens: leading tokens the connector holds already (its own prefix blocks):
            a recompute would load them too, so only ``reused_tokens .. kept_tokens``
            differ in cost between swap and recompute.
    """
    copy_blocks: int
    copy_bytes: int
    copy_seconds: float
    kept_tokens: int
    reused_tokens: int


class KVConnectorScheduler:
    """Scheduler side. The defaults: no external tokens, free at once, no metadata.

    Attributes:
        load_failure_policy: what the scheduler does with a request that read a page whose
            load failed: ``recompute`` (roll back and compute it) or ``fail`` (abort it).
    """

    load_failure_policy = "recompute"

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> int:
        """Tokens of ``request`` beyond its first ``num_computed_tokens`` (the local
        prefix hit) that this connector can load. The scheduler allocates pages for
        them and counts them as computed; it always leaves one token to compute. Called
        again in a later step if the pages could not be allocated this time."""
        return 0

    def update_state_after_alloc(self, request, block_ids: tuple[list[int], ...], num_external_tokens: int) -> None:
        """``request``'s block table per KV group right after allocation; the pages for
        its ``num_external_tokens`` loaded tokens follow its local hit."""

    def request_finished(self, request, block_ids: tuple[list[int], ...]) -> bool:
        """``request`` ended. Return True to keep its pages until the worker reports it in
        ``finished_sending`` (e.g. a save or a send still reads them)."""
        return False

    def swap_plan(self, request, num_computed_tokens: int) -> SwapPlan | None:
        """The cost of keeping the KV of ``request``'s first ``num_computed_tokens`` tokens
        through a preemption, or None when this connector cannot (the default; or no room)."""
        return None

    def swap_out(self, request, block_ids: tuple[list[int], ...], plan: SwapPlan) -> bool:
        """Keep what ``plan`` priced: the pages in ``block_ids`` are copied out before the
        next forward (they are freed right after this call), and when the request is
        admitted again ``get_num_new_matched_tokens`` reports them. False if it could not."""
        return False

    def reject(self, kv_transfer_params: dict | None) -> None:
        """A request carrying ``kv_transfer_params`` was refused before it was queued: give up
        what it would have read (e.g. tell the producer to end its lease at the next step)."""

    def reclaim(self, num_blocks: int, idle: bool = False) -> None:
        """The scheduler cannot place a waiting request for want of about ``num_blocks``
        pages (``idle``: and nothing else runs, so waiting gains nothing): give back pages
        this side keeps by choice (e.g. a producer's leases), if any; they are freed with
        the worker's next ``finished_sending``."""

    def has_pending_releases(self) -> bool:
        """Whether this side holds messages for the worker (e.g. lease releases) that a step
        computing nothing should carry now rather than with the next real step."""
        return False

    def get_stats(self) -> dict | None:
        """This connector's counters for :class:`~pagedkv.engine.stats.EngineStats`, or None."""
        return None

    def build_connector_meta(self, scheduler_output) -> object | None:
        """Plain, picklable data the worker side needs this step."""
        return None

    def update_connector_output(self, output) -> None:
        """The worker's :meth:`KVConnectorWorker.get_connector_output` of a finished step."""

    def step_failed(self, scheduler_output) -> None:
        """The runner raised on ``scheduler_output`` (built with this side's metadata): give
        up what that step's transfers held; nothing it did may be trusted."""

    def check_invariants(self) -> None:
        """Assert the connector's own bookkeeping (``debug_invariants``)."""


class KVConnectorWorker:
    """Worker side. The defaults move nothing."""

    def bind_connector_metadata(self, metadata) -> None:
        self.metadata = metadata

    def clear_connector_metadata(self) -> None:
        self.metadata = None

    def start_load_kv(self, storage) -> None:
        """Start loading this step's pages into ``storage`` (may return before done)."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until ``layer``'s pages for this step are loaded."""

    def save_kv_layer(self, layer: int, storage, attn_metadata) -> None:
        """``layer``'s KV for this step is written to ``storage``: start saving it."""

    def needs_layer_hooks(self) -> bool:
        """Whether this step's forward must call ``wait_for_layer_load`` / ``save_kv_layer``
        (no: the runner may replay a captured CUDA graph, which calls neither)."""
        return True

    def wait_for_save(self) -> None:
        """Block until every save started this step is done."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """``(done_sending, done_recving)``: requests whose asynchronous transfers ended."""
        return set(), set()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Pages whose load failed this step (handled by the load-failure policy)."""
        return set()

    def get_connector_output(self) -> object | None:
        """Plain data for the scheduler side about this step (e.g. which saves ended),
        carried by ``ModelRunnerOutput.kv_connector_output``."""
        return None

    def transfer_stats(self) -> dict | None:
        """This side's transfer counters (prefill/decode), or None."""
        return None

    def close(self) -> None:
        """The engine is done: finish what is in flight and release what is held (files,
        locks, threads)."""


class KVConnector(NamedTuple):
    """Both halves of one connector, as an engine takes them (``LLMEngine(kv_connector=...)``)."""
    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker
