"""ModelRunner: turns a SchedulerOutput into one forward pass and samples.

The runner keeps its own copy of each scheduled request (token ids, block table per KV
group, sampling params, seeded generator), built from the scheduler's plain data: a
request arrives in full once (:class:`~pagedkv.core.runner_io.NewRequestData`) and as
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

from pagedkv.attention.metadata import AttentionMetadata, SeqAttention
from pagedkv.core.kv_eviction import KVEvictionPolicy
from pagedkv.core.runner_io import ModelRunnerOutput, SampledTokens, SchedulerOutput
from pagedkv.core.sampling_params import SamplingParams
from pagedkv.kv.groups import KVCacheGroup
from pagedkv.kv.slots import slot, slot_mapping
from pagedkv.kv_cache.storage import KVCacheStorage
from pagedkv.model.llama import LlamaModel
from pagedkv.worker.eviction_scores import AttentionScorer, Observed, select_tokens
from pagedkv.worker.prompt_logprobs import prompt_logprobs
from pagedkv.worker.sampler import SampledToken, sample
from pagedkv.worker.spec_decode.proposer import RequestView
from pagedkv.worker.spec_decode.verify import verify


@dataclass
class CachedRequestState:
    """The runner's view of one request; ``block_ids`` has one table per KV group."""
    req_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    num_evicted_tokens: int = 0  # token p (past the compacted ones) at cache index p - this


class ModelRunner:
    """Runs ``model`` over the pages in ``storage``, laid out by ``kv_groups``.

    Args:
        model: the decoder.
        storage: the per-layer page tensors.
        kv_groups: which layers each group's block tables address.
        generator: sampling generator of requests without a seed.
        connector: the worker side of a KV connector, or None.
        proposer: the speculative decoding proposer (:mod:`pagedkv.worker.spec_decode.proposer`), or None.
        eviction: score-based KV eviction (:mod:`pagedkv.core.kv_eviction`): the runner
            scores the observed queries (SnapKV: a long prompt's last ones; H2O: all) and,
            at a request's eviction point, answers with the cache indices to keep.
        driver: False for a tensor-parallel worker (rank >= 1): it runs the forward (its
            share of every layer) and answers with an empty output; rank 0 samples.
        graphs: captured decode forwards (:class:`~pagedkv.worker.cuda_graphs.DecodeGraphs`)
            that steps of decodes only replay, or None (every step eager).
    """

    def __init__(self, model: LlamaModel, storage: KVCacheStorage, kv_groups: tuple[KVCacheGroup, ...],
                 generator: torch.Generator, connector=None, proposer=None,
                 eviction: KVEvictionPolicy | None = None, driver: bool = True, graphs=None) -> None:
        self.model, self.storage, self.generator, self.connector = model, storage, generator, connector
        self.graphs = graphs
        self.device = model.device  # where step tensors are made
        self.driver = driver
        self.proposer, self.eviction = proposer, eviction
        self.block_size = kv_groups[0].spec.block_size
        self.layer_group = [0] * sum(len(g.layer_ids) for g in kv_groups)
        for gi, g in enumerate(kv_groups):
            for layer in g.layer_ids:
                self.layer_group[layer] = gi
        self.num_groups = len(kv_groups)
        self.requests: dict[str, CachedRequestState] = {}
        self.generators: dict[str, torch.Generator] = {}  # seeded requests, kept across preemption
        self.h2o_scores: dict[str, torch.Tensor] = {}  # H2O: attention accumulated per cached token
        self.request_view = RequestView(self.requests, self.generators, generator)  # what a proposer reads

    # ---- request state --------------------------------------------------------------
    def update_states(self, out: SchedulerOutput) -> None:
        """Apply the step's plain data: drop ended and preempted requests, add new ones,
        extend cached ones by their deltas."""
        proposer = self.proposer
        for rid in out.finished_req_ids:
            self.requests.pop(rid, None)
            self.generators.pop(rid, None)
            self.h2o_scores.pop(rid, None)
            if proposer is not None:
                proposer.forget(rid)
        for rid in out.preempted_req_ids:
            self.requests.pop(rid, None)
            self.h2o_scores.pop(rid, None)
            if proposer is not None:
                proposer.forget(rid)
        for new in out.scheduled_new_reqs:
            self.h2o_scores.pop(new.req_id, None)  # recomputed from its first token
            if proposer is not None:
                proposer.start(new.req_id, new.num_computed_tokens)
            self.requests[new.req_id] = CachedRequestState(
                new.req_id, list(new.token_ids), new.num_prompt_tokens, new.sampling_params,
                tuple(list(g) for g in new.block_ids), new.num_computed_tokens)
            if not new.resumed:
                self.generators.pop(new.req_id, None)
            if new.sampling_params.seed is not None and new.req_id not in self.generators:
                self.generators[new.req_id] = torch.Generator(self.device).manual_seed(new.sampling_params.seed)
        c = out.scheduled_cached_reqs
        for rid, toks, blocks, computed, kept, keep in zip(c.req_ids, c.new_token_ids, c.new_block_ids,
                                                           c.num_computed_tokens, c.kept_blocks, c.compacted):
            state = self.requests[rid]
            if keep is not None:
                self._compact(state, keep, blocks, computed)
            state.token_ids.extend(toks)
            for g, (table, added) in enumerate(zip(state.block_ids, blocks)):
                if kept is not None:
                    del table[kept[g]:]
                table.extend(added)
            if kept is not None and proposer is not None:
                proposer.cut(rid, kept[0] * self.block_size)
            state.num_computed_tokens = computed

    def _compact(self, state: CachedRequestState, keep: list[int], new_tables, computed: int) -> None:
        """KV eviction's compaction: the KV of cache indices ``keep`` moves, in order, from
        the old pages to the new tables' first slots (the caller then installs the tables)."""
        bs = self.block_size
        for old, new in zip(state.block_ids, new_tables):
            src = torch.tensor(slot_mapping(old, keep, bs), dtype=torch.int64)
            dst = torch.tensor(slot_mapping(new, range(len(keep)), bs), dtype=torch.int64)
            self.storage.copy_slots(src, dst)
        state.num_evicted_tokens = computed - len(keep)
        if state.req_id in self.h2o_scores:
            self.h2o_scores[state.req_id] = self.h2o_scores[state.req_id][torch.tensor(keep)]

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
            start, drafts = st.num_computed_tokens, out.scheduled_spec_decode_tokens.get(rid, [])
            c0 = start - st.num_evicted_tokens  # cache index of the chunk's first token
            for g, table in enumerate(st.block_ids):
                seqs[g].append(SeqAttention(len(ids), n, c0 + n, torch.tensor(table, dtype=torch.int64)))
                slots[g].extend(slot_mapping(table, range(c0, c0 + n), bs))
            ids.extend((st.token_ids + drafts)[start:start + n] if drafts else st.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            if start + n == len(st.token_ids) + len(drafts):  # the last token and each draft: d + 1 rows
                sample_rows.extend(range(len(ids) - 1 - len(drafts), len(ids)))
        dev = self.device
        metas = [AttentionMetadata(torch.tensor(s, dtype=torch.int64, device=dev), q) for s, q in zip(slots, seqs)]
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), metas, sample_rows)

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
        scorer = self._scorer(out)
        quiet = hooks is None or not hooks.needs_layer_hooks()  # no per-layer copies this step
        decodes = self._graph_batch(out) if self.graphs is not None and quiet and scorer is None else None
        if decodes is not None:  # every request one token: the bucket's CUDA graph
            hidden, rows = self.graphs.run(*decodes), list(range(len(decodes[0])))
        else:
            ids, positions, metas, rows = self.prepare(out)
            hidden = self.model.forward(ids, positions, self.storage, [metas[g] for g in self.layer_group], hooks,
                                        observer=scorer)
        if not self.driver:
            return result
        if scorer is not None:
            result.kv_keep = self._choose(scorer, out)
        result.prompt_logprobs = prompt_logprobs(self.model, hidden, self._chunks(out))
        failed = self.connector.get_block_ids_with_load_errors() if self.connector is not None else set()
        bad = self._read_failed_loads(out, failed)  # recomputed next step
        samplers = [rid for rid in out.req_ids if self._samples(rid, out) and rid not in bad]
        if samplers:
            rows = self._rows_of(out, rows, samplers)
            result.sampled = self._sample(samplers, hidden, rows, out.scheduled_spec_decode_tokens)
            result.num_draft_tokens = {r: len(out.scheduled_spec_decode_tokens.get(r, ())) for r in samplers}
        if self.proposer is not None:  # a draft model writes its KV here: before the saves end
            result.spec_token_ids = self.proposer.propose_step(self.request_view, out, samplers, result.sampled,
                                                                bad, hooks)
        self._finish_connector(out, result)
        result.execute_seconds = time.perf_counter() - t0
        return result

    def _graph_batch(self, out: SchedulerOutput) -> tuple[list, list, list, list] | None:
        """``(ids, positions, slots, tables)`` of a step of decodes only that a graph bucket
        holds (one group's tables: graphs are built for one KV group), else None."""
        if out.scheduled_spec_decode_tokens or len(out.req_ids) > self.graphs.buckets[-1]:
            return None
        ids, positions, slots, tables, bs = [], [], [], [], self.block_size
        for rid in out.req_ids:
            st = self.requests[rid]
            pos = st.num_computed_tokens
            if out.num_scheduled_tokens[rid] != 1 or pos != len(st.token_ids) - 1 or st.num_evicted_tokens:
                return None
            table = st.block_ids[0]
            ids.append(st.token_ids[pos])
            positions.append(pos)
            slots.append(slot(table, pos, bs))
            tables.append(table)
        return ids, positions, slots, tables

    def _scorer(self, out: SchedulerOutput) -> AttentionScorer | None:
        """A scorer for this step's observed queries: under SnapKV, the window of a chunk that
        ends a prompt to evict (the scheduler made the chunk hold all of it); under H2O,
        every query."""
        ev, observed = self.eviction, {}
        if ev is None:
            return None
        for rid, state, row, n in self._chunks_of(out):
            length = state.num_computed_tokens + n - state.num_evicted_tokens
            if ev.method == "h2o":
                observed[rid] = Observed(row, n, length, torch.tensor(state.block_ids[0]), False)
            elif state.num_computed_tokens + n == ev.next_eviction(state) and n >= ev.window:
                observed[rid] = Observed(row + n - ev.window, ev.window, length, torch.tensor(state.block_ids[0]),
                                         True)
        return AttentionScorer(observed, self.model.cfg.attention_scale) if observed else None

    def _choose(self, scorer: AttentionScorer, out: SchedulerOutput) -> dict[str, list[int]]:
        """The cache indices each request at its eviction point keeps (H2O: its scores so
        far, this step's added)."""
        ev, keep = self.eviction, {}
        for rid, scores in scorer.scores.items():
            state = self.requests[rid]
            if ev.method == "h2o":
                scores = self._accumulate(rid, scores)
            if state.num_computed_tokens + out.num_scheduled_tokens[rid] == ev.next_eviction(state):
                keep[rid] = select_tokens(scores, ev.budget(state), ev.num_sinks, ev.window)
        return keep

    def _accumulate(self, rid: str, scores: torch.Tensor) -> torch.Tensor:
        """H2O's running sum over the request's cached tokens, extended by this step's."""
        acc = self.h2o_scores.get(rid)
        if acc is not None:
            scores = scores.clone()
            scores[:acc.shape[0]] += acc
        self.h2o_scores[rid] = scores
        return scores

    def _chunks_of(self, out: SchedulerOutput):
        """``(req_id, state, first row, num rows)`` of each request's chunk in the batch."""
        row = 0
        for rid in out.req_ids:
            n = out.num_scheduled_tokens[rid]
            yield rid, self.requests[rid], row, n
            row += n

    def _rows_of(self, out: SchedulerOutput, rows: list[int], samplers: list[str]) -> dict[str, list[int]]:
        """Each sampling request's rows of ``hidden`` (1, or d + 1 with d drafts), in batch order."""
        it, by_req = iter(rows), {}
        for rid in out.req_ids:
            if self._samples(rid, out):
                by_req[rid] = [next(it) for _ in range(1 + len(out.scheduled_spec_decode_tokens.get(rid, ())))]
        return {r: by_req[r] for r in samplers}

    def _read_failed_loads(self, out: SchedulerOutput, invalid: set[int]) -> set[str]:
        """Requests of this step that read a page whose load failed (not sampled, so a
        seeded generator does not advance for a token that is thrown away)."""
        if not invalid:
            return set()
        return {rid for rid in out.req_ids
                if any(b in invalid for table in self.requests[rid].block_ids for b in table)}

    def _samples(self, rid: str, out: SchedulerOutput) -> bool:
        st = self.requests[rid]
        drafts = len(out.scheduled_spec_decode_tokens.get(rid, ()))
        return st.num_computed_tokens + out.num_scheduled_tokens[rid] == len(st.token_ids) + drafts

    def _chunks(self, out: SchedulerOutput):
        """``(state, first row, num rows)`` of each request's chunk in the batch."""
        for _, state, row, n in self._chunks_of(out):
            yield state, row, n

    def _sample(self, req_ids: list[str], hidden: torch.Tensor, rows: dict[str, list[int]],
                drafts: dict[str, list[int]]) -> dict[str, SampledTokens]:
        """One token per plain request (one batched sampler call); a request with drafts
        gets its verified run (:func:`pagedkv.worker.spec_decode.verify.verify`)."""
        logits = self.model.logits(_take_rows(hidden, [i for r in req_ids for i in rows[r]]))
        offsets, k = {}, 0
        for r in req_ids:
            offsets[r], k = k, k + len(rows[r])
        plain = [r for r in req_ids if not drafts.get(r)]
        out = {}
        if plain:
            tokens = sample(_take_rows(logits, [offsets[r] for r in plain]),
                            [self.requests[r].sampling_params for r in plain],
                            [self.generators.get(r, self.generator) for r in plain])
            out.update({r: [t] for r, t in zip(plain, tokens)})
        for r in req_ids:
            if drafts.get(r):
                out[r] = self._verify(r, logits[offsets[r]:offsets[r] + len(rows[r])], drafts[r])
        return {r: _sampled_tokens(out[r]) for r in req_ids}

    def _verify(self, rid: str, logits: torch.Tensor, drafts: list[int]) -> list:
        try:
            run = verify(logits, drafts, self.requests[rid].sampling_params, self.generators.get(rid, self.generator),
                         self.proposer.draft_probs(rid))
        except (ValueError, RuntimeError) as e:
            return [SampledToken(-1, None, str(e))]
        self.proposer.record(rid, len(drafts), len(run) - 1)
        return run

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


def _take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]``, without the copy when ``rows`` are all of ``t``'s rows in order (a batch
    of decodes: the copy cost ~60 us a step at one row)."""
    return t if rows == list(range(t.shape[0])) else t[rows]


def _sampled_tokens(run: list[SampledToken]) -> SampledTokens:
    """One request's tokens of this step as plain data (an error in any of them: none)."""
    bad = next((t.error for t in run if t.error is not None), None)
    if bad is not None:
        return SampledTokens([], None, bad)
    lps = [t.logprobs for t in run]
    return SampledTokens([t.token_id for t in run], lps if lps[0] is not None else None)
