"""Tensor-parallel partitioning of a Llama-family decoder (Megatron-LM's, Shoeybi et al. 2019, sec. 3).

Each of ``world`` ranks holds:

- a contiguous run of KV heads with the query heads that read them, so its pages hold only
  its heads: q/k/v projections split by rows (column-parallel), the output projection by
  the matching columns (row-parallel, its partial sums added by an all-reduce);
- a contiguous run of the MLP's intermediate columns: gate/up by rows, down by columns
  (row-parallel, all-reduced);
- the embeddings, norms and LM head whole (replicated).

Heads split as evenly as whole KV-head groups allow: with more KV heads than ranks, the
first ``num_kv_heads % world`` ranks hold one more (SmolLM2-135M's 3 KV heads over 2 ranks:
2 and 1; vLLM and SGLang refuse a ``tp`` that does not divide the heads, llama.cpp's row
split takes any proportion). With fewer KV heads than ranks, each KV head is replicated on
``world / num_kv_heads`` ranks that split its query heads (vLLM's rule), which then must
divide both counts. The MLP splits in units of 32 columns (a GGML block) where the width
allows, so quantized blocks are never cut.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedkv.model.config import ModelConfig, Span, even_spans, head_spans
from pagedkv.model.ggml_weights import FORMATS, GROUP, GGMLWeight


@dataclass(frozen=True)
class Partition:
    """What rank ``rank`` of ``world`` holds: query heads, KV heads and MLP columns, each
    a ``[start, stop)`` range of the whole model's."""
    rank: int
    world: int
    q_heads: Span
    kv_heads: Span
    mlp: Span


def partition(cfg: ModelConfig, rank: int, world: int) -> Partition:
    """Rank ``rank``'s share of ``cfg`` over ``world`` ranks.

    Raises:
        ValueError: a bad rank, an MLA or MoE model, or heads/columns that cannot be split.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    if cfg.mla or cfg.moe:
        raise ValueError(f"tensor parallelism here splits dense attention heads: {cfg.name or 'this model'} is "
                         f"{'MLA' if cfg.mla else 'MoE'}")
    q, kv = head_spans(cfg.num_attention_heads, cfg.num_key_value_heads, world)[rank]
    width = cfg.intermediate_size
    mlp = even_spans(width, world, GROUP if width % GROUP == 0 and width // GROUP >= world else 1)[rank]
    return Partition(rank, world, q, kv, mlp)


def local_config(cfg: ModelConfig, part: Partition) -> ModelConfig:
    """``cfg`` as one rank runs it: its heads and MLP width (head size and scale unchanged)."""
    return replace(cfg, num_attention_heads=part.q_heads[1] - part.q_heads[0],
                   num_key_value_heads=part.kv_heads[1] - part.kv_heads[0],
                   intermediate_size=part.mlp[1] - part.mlp[0])


def shard_state(state: dict, cfg: ModelConfig, part: Partition) -> dict:
    """``state`` (HF names -> fp32 tensors or :class:`GGMLWeight` blocks) cut to ``part``'s
    share; tensors not split (embeddings, norms, LM head) are kept as they are.

    Raises:
        ValueError: a quantized weight whose split would cut a block of 32 (use
            ``--weight-dtype float32``), or a bias on the output projection.
    """
    out, D = dict(state), cfg.head_dim
    q = (part.q_heads[0] * D, part.q_heads[1] * D)
    kv = (part.kv_heads[0] * D, part.kv_heads[1] * D)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, span, cols in (("self_attn.q_proj", q, False), ("self_attn.k_proj", kv, False),
                                 ("self_attn.v_proj", kv, False), ("self_attn.o_proj", q, True),
                                 ("mlp.gate_proj", part.mlp, False), ("mlp.up_proj", part.mlp, False),
                                 ("mlp.down_proj", part.mlp, True)):
            key = p + name + ".weight"
            out[key] = _columns(state[key], span, key) if cols else _rows(state[key], span)
            bias = p + name + ".bias"
            if bias in state:
                if cols:
                    raise ValueError(f"{bias}: a row-parallel projection's bias is not supported")
                out[bias] = state[bias][span[0]:span[1]]
    return out


def _rows(w, span: Span):
    if isinstance(w, GGMLWeight):
        return GGMLWeight(w.blocks[span[0]:span[1]].contiguous(), w.qtype, w.shape[1])
    return w[span[0]:span[1]]


def _columns(w, span: Span, name: str):
    a, b = span
    if isinstance(w, GGMLWeight):
        if a % GROUP or b % GROUP:
            raise ValueError(f"{name}: its {w.format} blocks hold {GROUP} columns each and this split cuts one "
                             f"(columns {a}..{b}); use --weight-dtype float32")
        size = FORMATS[w.qtype][1]
        return GGMLWeight(w.blocks[:, a // GROUP * size:b // GROUP * size].contiguous(), w.qtype, b - a)
    return w[:, a:b]

