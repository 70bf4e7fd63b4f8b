"""The draft-model proposer: a second, smaller decoder proposes ``k`` tokens per step.

The draft's KV lives in the target's pages (the draft layers of
:class:`~pagedkv.kv_cache.storage.KVCacheStorage`: same page ids, same block tables), so it is
allocated, prefix-cached, offloaded, swapped, preempted and rolled back with the
target's, in one pool's accounting. Per request the proposer keeps two counts:

- ``computed``: leading positions whose draft KV is that of committed tokens;
- ``speculative``: positions after those holding KV of the drafts it proposed last, which
  become committed as far as the target accepts them.

Each step, once the target has verified and sampled (before the connector's saves end, so
pages written through to a tier carry the draft's KV too):

1. **Catch-up**: one batched draft forward over every scheduled request's tokens from
   ``computed`` to the end of what is known: a prefill chunk's end, or, for a request
   that sampled, its committed tokens including the new ones (usually 1 or 2 positions),
   never past the slots its table holds.
2. **Proposal**: for each request that sampled and that the adaptive gate lets propose,
   the first draft comes from the catch-up's last row, then ``k - 1`` one-token forwards,
   batched across requests, write the drafts' KV into the lookahead slots the scheduler
   allocated (:attr:`pagedkv.config.speculative.SpeculativeConfig.num_lookahead_tokens`).
   Greedy requests propose the draft's argmax; sampled ones draw from the draft's
   distribution under the request's temperature / top-k / top-p, kept for verification
   (:func:`pagedkv.worker.spec_decode.verify.verify`).

A block is published to the prefix cache only when the target has computed all its
tokens; by then step 1 has written the draft's KV for them, so a prefix hit serves both
models. The target's output never depends on the draft: a wrong or stale draft KV only
lowers acceptance.
"""

from __future__ import annotations

import torch

from pagedkv.attention.metadata import AttentionMetadata, SeqAttention
from pagedkv.kv.slots import slot_mapping
from pagedkv.worker.sampler import target_probs
from pagedkv.worker.spec_decode.proposer import Proposer, RequestView


class DraftModelProposer(Proposer):
    """Runs ``model`` (the draft) on ``kv_cache`` (its layers of the shared pages).

    Args:
        config: the speculative settings (``method`` ``draft_model``).
        model: the draft decoder (:class:`pagedkv.model.llama.LlamaModel`).
        kv_cache: the KV cache's draft view (:meth:`KVCacheStorage.draft_view`).
        block_size: tokens per page.
    """

    def __init__(self, config, model, kv_cache, block_size: int) -> None:
        super().__init__(config)
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.computed: dict[str, int] = {}
        self.speculative: dict[str, int] = {}
        self.probs: dict[str, torch.Tensor] = {}

    # ---- request state ------------------------------------------------------------------
    def start(self, req_id: str, num_computed_tokens: int) -> None:
        self.computed[req_id], self.speculative[req_id] = num_computed_tokens, 0
        self.probs.pop(req_id, None)

    def cut(self, req_id: str, num_slots: int) -> None:
        done = min(self.computed.get(req_id, 0), num_slots)
        self.computed[req_id] = done
        self.speculative[req_id] = min(self.speculative.get(req_id, 0), num_slots - done)

    def forget(self, req_id: str) -> None:
        super().forget(req_id)
        for d in (self.computed, self.speculative, self.probs):
            d.pop(req_id, None)

    def draft_probs(self, req_id: str):
        return self.probs.get(req_id)

    # ---- one step -----------------------------------------------------------------------------
    def propose_step(self, requests: RequestView, out, samplers: list[str], sampled: dict, skip: set[str],
                     hooks) -> dict[str, list[int]]:
        items = [item for rid in out.req_ids if (item := self._catch_up_item(requests, out, rid, sampled, skip))]
        if not items:
            return {}
        hooks = ShiftedHooks(hooks, self.kv_cache.offset) if hooks is not None else None
        hidden = self._forward([(tokens[start:end], start, table) for _, tokens, start, end, table, _ in items], hooks)
        last, row = {}, 0
        for rid, tokens, start, end, table, m in items:
            row += end - start
            self.computed[rid], self.speculative[rid] = end, 0
            if m > 0:
                last[rid] = row - 1
        self.probs = {r: p for r, p in self.probs.items() if r not in last}
        if not last:
            return {}
        return self._propose(requests, hidden[list(last.values())], {i[0]: i for i in items if i[0] in last})

    def _catch_up_item(self, requests: RequestView, out, rid: str, sampled: dict, skip: set[str]):
        """``(rid, tokens, start, end, table, drafts to propose)`` of one scheduled request,
        or None when it has nothing to compute."""
        bs = self.block_size
        if rid in skip:  # its pages failed to load: the draft's KV there is unknown too
            self.start(rid, 0)
            return None
        table = requests.block_table(rid)
        slots = len(table) * bs
        s = sampled.get(rid)
        if s is not None and s.error is None and s.token_ids:
            self.computed[rid] = self.computed.get(rid, 0) + min(len(s.token_ids) - 1, self.speculative.get(rid, 0))
            tokens = requests.token_ids(rid) + s.token_ids
            end = min(len(tokens), slots)
            cap = requests.sampling_params(rid).max_tokens
            left = (1 << 30) if cap is None else cap - (len(tokens) - requests.num_prompt_tokens(rid))
            m = min(self.config.num_speculative_tokens, 1 + slots - end, left - 1)
            m = m if end == len(tokens) and m > 0 and self.gate.allows(rid) else 0
        else:
            tokens, m = requests.token_ids(rid), 0
            end = requests.num_computed_tokens(rid) + out.num_scheduled_tokens[rid]
        start = min(self.computed.get(rid, 0), end - 1 if m else end)
        return (rid, tokens, start, end, table, m) if start < end else None

    def _forward(self, seqs: list[tuple[list[int], int, list[int]]], hooks=None) -> torch.Tensor:
        """One draft forward over ``(token ids, first position, block table)`` per sequence."""
        ids, positions, slots, attn, bs, dev = [], [], [], [], self.block_size, self.model.device
        for toks, start, table in seqs:
            end = start + len(toks)
            attn.append(SeqAttention(len(ids), len(toks), end, torch.tensor(table, dtype=torch.int64)))
            slots.extend(slot_mapping(table, range(start, end), bs))
            ids.extend(toks)
            positions.extend(range(start, end))
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64, device=dev), attn)
        return self.model.forward(torch.tensor(ids, dtype=torch.int64, device=dev),
                                  torch.tensor(positions, dtype=torch.int64, device=dev), self.kv_cache, meta, hooks)

    def _propose(self, requests: RequestView, hidden: torch.Tensor, items: dict) -> dict[str, list[int]]:
        """Drafts of the requests in ``items`` from the catch-up rows ``hidden`` (their order)."""
        drafts = {rid: [] for rid in items}
        probs = {rid: [] for rid in items}
        active = list(items)
        while True:
            failed = self._draw(requests, active, self.model.logits(hidden), drafts, probs)
            active = [r for r in active if len(drafts[r]) < items[r][5] and r not in failed]
            if not active:
                break
            seqs = [([drafts[r][-1]], items[r][3] + len(drafts[r]) - 1, items[r][4]) for r in active]
            hidden = self._forward(seqs)
        for rid in items:
            self.speculative[rid] = max(0, len(drafts[rid]) - 1)  # the last draft's KV is not written
            if probs[rid]:
                self.probs[rid] = torch.stack(probs[rid])
        return {r: d for r, d in drafts.items() if d}

    def _draw(self, requests: RequestView, req_ids: list[str], logits: torch.Tensor, drafts: dict,
              probs: dict) -> set[str]:
        """Each request's next draft from its row of ``logits``: the argmax for greedy
        requests, else a draw from the draft's distribution (kept in ``probs``). Returns
        the requests whose row was not finite (they stop proposing this step)."""
        failed = set()
        for i, rid in enumerate(req_ids):
            params = requests.sampling_params(rid)
            if not torch.isfinite(logits[i]).all():
                failed.add(rid)
            elif params.greedy:
                drafts[rid].append(int(torch.argmax(logits[i])))
            else:
                try:  # the draft's distribution may still fail (overflow at a tiny temperature)
                    q = target_probs(logits[i], params)
                    x = int(torch.multinomial(q, 1, generator=requests.generator(rid)))
                except (ValueError, RuntimeError):
                    failed.add(rid)
                    continue
                drafts[rid].append(x)
                probs[rid].append(q)
        return failed


class ShiftedHooks:
    """A KV connector's worker hooks for the draft's layers: draft layer ``i`` is storage
    layer ``offset + i``, so pages saved to a tier carry the draft's KV too."""

    def __init__(self, hooks, offset: int) -> None:
        self.hooks, self.offset = hooks, offset

    def wait_for_layer_load(self, layer: int) -> None:
        self.hooks.wait_for_layer_load(layer + self.offset)

    def save_kv_layer(self, layer: int, storage, attn_metadata) -> None:
        self.hooks.save_kv_layer(layer + self.offset, storage.storage, attn_metadata)
