"""ModelRunner: turns a SchedulerOutput into one forward pass and samples.

For each scheduled request it gathers the new tokens' ids and positions, the slot each
writes (slot mapping, from the request's block table) and what each sequence reads
(block table and context length), runs the model once over the flattened batch, and
samples a token for every request whose chunk reached its last token.
"""

from __future__ import annotations

import torch

from pagedkv.attention.paged import AttentionMetadata, SeqAttention
from pagedkv.engine.sampler import SampledToken, sample
from pagedkv.engine.scheduler import SchedulerOutput
from pagedkv.kv.manager import KVCacheManager
from pagedkv.kv.storage import KVCacheStorage
from pagedkv.model.llama import LlamaModel


class ModelRunner:
    """Runs ``model`` over the pages in ``storage`` as laid out by ``kv``."""

    def __init__(self, model: LlamaModel, storage: KVCacheStorage, kv: KVCacheManager,
                 generator: torch.Generator) -> None:
        self.model, self.storage, self.kv = model, storage, kv
        self.block_size = kv.block_size
        self.generator = generator

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Input ids ``[T]``, positions ``[T]``, attention metadata, and the row of ``[T]``
        whose logits each sampling request needs."""
        ids, positions, slots, seqs, sample_rows = [], [], [], [], []
        for s in out.scheduled:
            req, start, n = s.request, s.start, s.num_new_tokens
            table = self.kv.block_tables[req.request_id]
            seqs.append(SeqAttention(len(ids), n, start + n, torch.tensor(table, dtype=torch.int64)))
            ids.extend(req.all_token_ids[start:start + n])
            positions.extend(range(start, start + n))
            bs = self.block_size
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if s.samples:
                sample_rows.append(len(ids) - 1)
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.int64), seqs)
        return (torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64),
                meta, sample_rows)

    def execute(self, out: SchedulerOutput) -> dict[str, SampledToken]:
        """Forward the step; returns the sampled token of each request that samples.
        Requests asking for prompt logprobs get them filled in (``Request.prompt_logprobs``)."""
        ids, positions, meta, rows = self.prepare(out)
        hidden = self.model.forward(ids, positions, self.storage, meta)
        self._prompt_logprobs(out, hidden)
        samplers = [s.request for s in out.scheduled if s.samples]
        if not samplers:
            return {}
        logits = self.model.logits(hidden[rows])
        tokens = sample(logits, [r.sampling_params for r in samplers],
                        [r.generator or self.generator for r in samplers])
        return {r.request_id: t for r, t in zip(samplers, tokens)}

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor) -> None:
        """log p(prompt token t+1 | tokens <= t) for the prompt positions of this step's
        chunks, for requests with ``sampling_params.prompt_logprobs`` set (natural log)."""
        row = 0
        for s in out.scheduled:
            req, start, n = s.request, s.start, s.num_new_tokens
            last = min(start + n, req.num_prompt_tokens - 1)  # positions with a next prompt token
            if req.sampling_params.prompt_logprobs is not None and start < last:
                logp = torch.log_softmax(self.model.logits(hidden[row:row + last - start]), dim=-1)
                targets = torch.tensor(req.all_token_ids[start + 1:last + 1])
                values = logp.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()
                for pos, v in zip(range(start + 1, last + 1), values):
                    req.prompt_logprobs[pos] = v
                if req.sampling_params.prompt_logprobs:
                    top = torch.topk(logp, req.sampling_params.prompt_logprobs, dim=-1)
                    for pos, ids, vals in zip(range(start + 1, last + 1), top.indices.tolist(), top.values.tolist()):
                        req.prompt_top_logprobs[pos] = dict(zip(ids, vals))
            row += n
