"""ModelRunner: turns a SchedulerOutput into one forward pass and samples.

The runner keeps its own copy of each scheduled request (token ids, block table per KV
group, sampling params, seeded generator), built from the scheduler's plain data: a
request arrives in full once (:class:`~pagedkv.engine.step_io.NewRequestData`) and as
deltas after that. It never reads the KV manager or writes a scheduler ``Request``, so
it could run in another process. Each step it gathers the new tokens' ids and positions,
the slot each writes in each group's layers (slot mapping) and what each sequence reads
(block table and context length), runs the model once over the flattened batch, and
samples a token for every request whose chunk reached its last token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pagedkv.attention.paged import AttentionMetadata, SeqAttention
from pagedkv.engine.prompt_logprobs import prompt_logprobs
from pagedkv.engine.sampler import sample
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.step_io import ModelRunnerOutput, SampledTokens, SchedulerOutput
from pagedkv.kv.groups import KVCacheGroup
from pagedkv.kv.storage import KVCacheStorage
from pagedkv.model.llama import LlamaModel


@dataclass
class CachedRequestState:
    """The runner's view of one request; ``block_ids`` has one table per KV group."""
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


class ModelRunner:
    """Runs ``model`` over the pages in ``storage``, laid out by ``kv_groups``.

    Args:
        model: the decoder.
        storage: the per-layer page tensors.
        kv_groups: which layers each group's block tables address.
        generator: sampling generator of requests without a seed.
        connector: the worker side of a KV connector, or None.
    """

    def __init__(self, model: LlamaModel, storage: KVCacheStorage, kv_groups: tuple[KVCacheGroup, ...],
                 generator: torch.Generator, connector=None) -> None:
        self.model, self.storage, self.generator, self.connector = model, storage, generator, connector
        self.block_size = kv_groups[0].spec.block_size
        self.layer_group = [0] * sum(len(g.layer_ids) for g in kv_groups)
        for gi, g in enumerate(kv_groups):
            for layer in g.layer_ids:
                self.layer_group[layer] = gi
        self.num_groups = len(kv_groups)
        self.requests: dict[str, CachedRequestState] = {}
        self.generators: dict[str, torch.Generator] = {}  # seeded requests, kept across preemption

    # ---- request state --------------------------------------------------------------
    def update_states(self, out: SchedulerOutput) -> None:
        """Apply the step's plain data: drop ended and preempted requests, add new ones,
        extend cached ones by their deltas."""
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
            self.generators.pop(rid, None)
        for rid in out.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                tuple(list(g) for g in new.block_ids), new.num_computed_tokens)
            if not new.resumed:
                self.generators.pop(new.req_id, None)
            if new.sampling_params.seed is not None and new.req_id not in self.generators:
                self.generators[new.req_id] = torch.Generator().manual_seed(new.sampling_params.seed)
        c = out.scheduled_cached_reqs
        for rid, toks, blocks, computed in zip(c.req_ids, c.new_token_ids, c.new_block_ids, c.num_computed_tokens):
            state = self.requests[rid]
            state.token_ids.extend(toks)
            for table, added in zip(state.block_ids, blocks):
                table.extend(added)
            state.num_computed_tokens = computed

    # ---- one step --------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata], list[int]]:
        """Input ids ``[T]``, positions ``[T]``, attention metadata per KV group, and the
        row of ``[T]`` whose logits each sampling request needs."""
        ids, positions, sample_rows = [], [], []
        slots = [[] for _ in range(self.num_groups)]
        seqs = [[] for _ in range(self.num_groups)]
        bs = self.block_size
        for rid in out.req_ids:
            st, n = self.requests[rid], out.num_scheduled_tokens[rid]
            start = st.num_computed_tokens
            for g, table in enumerate(st.block_ids):
                seqs[g].append(SeqAttention(len(ids), n, start + n, torch.tensor(table, dtype=torch.int64)))
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            ids.extend(st.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            if start + n == len(st.token_ids):
                sample_rows.append(len(ids) - 1)
        metas = [AttentionMetadata(torch.tensor(s, dtype=torch.int64), q) for s, q in zip(slots, seqs)]
        return (torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                metas, sample_rows)

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """Forward the step; returns the sampled tokens of each request whose chunk reached
        its last token, and prompt log-probs where asked."""
        t0 = time.perf_counter()
        self.update_states(out)
        result = ModelRunnerOutput()
        hooks = self._start_connector(out)
        if not out.num_scheduled_tokens:  # nothing to compute; a connector may still report
            self._finish_connector(out, result)
            return result
        ids, positions, metas, rows = self.prepare(out)
        hidden = self.model.forward(ids, positions, self.storage, [metas[g] for g in self.layer_group], hooks)
        self._finish_connector(out, result)
        result.prompt_logprobs = prompt_logprobs(self.model, hidden, self._chunks(out))
        bad = self._read_failed_loads(out, result.invalid_block_ids)  # recomputed next step
        samplers = [rid for rid in out.req_ids if self._samples(rid, out) and rid not in bad]
        if samplers:
            result.sampled = self._sample(samplers, hidden[rows])
        result.execute_seconds = time.perf_counter() - t0
        return result

    def _read_failed_loads(self, out: SchedulerOutput, invalid: set[int]) -> set[str]:
        """Requests of this step that read a page whose load failed (not sampled, so a
        seeded generator does not advance for a token that is thrown away)."""
        if not invalid:
            return set()
        return {rid for rid in out.req_ids
                if any(b in invalid for table in self.requests[rid].block_ids for b in table)}

    def _samples(self, rid: str, out: SchedulerOutput) -> bool:
        st = self.requests[rid]
        return st.num_computed_tokens + out.num_scheduled_tokens[rid] == len(st.token_ids)

    def _chunks(self, out: SchedulerOutput):
        """``(state, first row, num rows)`` of each request's chunk in the batch."""
        row = 0
        for rid in out.req_ids:
            n = out.num_scheduled_tokens[rid]
            yield self.requests[rid], row, n
            row += n

    def _sample(self, req_ids: list[str], hidden: torch.Tensor) -> dict[str, SampledTokens]:
        states = [self.requests[r] for r in req_ids]
        tokens = sample(self.model.logits(hidden), [s.sampling_params for s in states],
                        [self.generators.get(r, self.generator) for r in req_ids])
        return {r: SampledTokens([t.token_id] if t.error is None else [],
                                 [t.logprobs] if t.logprobs is not None else None, t.error)
                for r, t in zip(req_ids, tokens)}

    # ---- KV connector (worker side) --------------------------------------------------------
    def _start_connector(self, out: SchedulerOutput):
        if self.connector is None:
            return None
        self.connector.bind_connector_metadata(out.kv_connector_metadata)
        self.connector.start_load_kv(self.storage)
        return self.connector

    def _finish_connector(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        if self.connector is None:
            return
        self.connector.wait_for_save()
        result.finished_sending, result.finished_recving = self.connector.get_finished(set(out.finished_req_ids))
        result.invalid_block_ids = set(self.connector.get_block_ids_with_load_errors())
        result.kv_connector_output = self.connector.get_connector_output()
        self.connector.clear_connector_metadata()
