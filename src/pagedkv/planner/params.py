"""Parameter counts from a :class:`ModelConfig`: total, active per token, and what a decode step reads.

Counted per decoder layer: attention projections (with biases where the
architecture has them; MLA's low-rank q/kv projections and their norms), the MLP
(gated: gate, up, down; plain: up, down; biases where present) or, in an MoE layer,
every routed expert, the shared experts and the router; the layer norms. Plus the
embedding, a learned position table (OPT), the LM head unless tied, and the final
norm. Tests check these sums against transformers' own modules built on the meta device.

Units: parameters (elements). Multiply by a dtype's bytes for weight bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.model.config import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of one model (elements).

    Attributes:
        total: every parameter (MoE experts included; tied embeddings counted once).
        active: parameters one token passes through (only ``experts_per_tok`` routed experts).
        embedding: the input embedding table (a decode step reads only its used rows).
        expert: parameters of one routed expert (0 for dense models).
        moe_layers: number of MoE layers.
    """
    total: int
    active: int
    embedding: int
    expert: int
    moe_layers: int


def attention_params(m: ModelConfig) -> int:
    """Parameters of one attention block (Gemma 3/Qwen 3's per-head q and k norms included)."""
    h = m.hidden_size
    if m.mla:
        a = m.mla
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        q = (h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * m.num_attention_heads * qk
             if a.q_lora_rank else h * m.num_attention_heads * qk)
        kv = (h * a.latent_dim + a.kv_lora_rank
              + a.kv_lora_rank * m.num_attention_heads * (a.qk_nope_head_dim + a.v_head_dim))
        return q + kv + m.num_attention_heads * a.v_head_dim * h
    q_out, kv_out = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    weights = h * (q_out + 2 * kv_out) + q_out * h
    bias = (q_out + 2 * kv_out) if m.qkv_bias else 0
    return weights + bias + (h if m.attention_bias else 0) + (2 * m.head_dim if m.qk_norm else 0)


def mlp_params(m: ModelConfig, intermediate: int) -> int:
    """Parameters of one dense MLP of width ``intermediate`` (and its biases, if any)."""
    bias = ((2 if m.gated_mlp else 1) * intermediate + m.hidden_size) if m.mlp_bias else 0
    return (3 if m.gated_mlp else 2) * m.hidden_size * intermediate + bias


def norm_params(m: ModelConfig) -> int:
    """Parameters of one layer norm (weight, plus bias for LayerNorm models)."""
    return m.hidden_size * (2 if m.norm_bias else 1)


def count_params(m: ModelConfig) -> ParamCount:
    """Count the parameters of ``m``; see the module docstring for what is included."""
    embedding = m.vocab_size * m.hidden_size
    head = 0 if m.tie_word_embeddings else embedding
    total = embedding + head + norm_params(m) + m.position_embeddings * m.hidden_size
    expert = mlp_params(m, m.moe.expert_intermediate_size) if m.moe else 0
    moe_layers = sum(m.moe.is_moe_layer(i) for i in range(m.num_hidden_layers)) if m.moe else 0
    per_layer = attention_params(m) + m.norms_per_layer * norm_params(m)
    total += m.num_hidden_layers * per_layer + (m.num_hidden_layers - moe_layers) * mlp_params(m, m.intermediate_size)
    idle = 0
    if m.moe:
        e = m.moe
        router = e.num_experts * m.hidden_size + (e.num_experts if e.router_bias else 0)
        total += moe_layers * ((e.num_experts + e.num_shared_experts) * expert + router)
        idle = moe_layers * (e.num_experts - e.experts_per_tok) * expert
    return ParamCount(total=total, active=total - idle, embedding=embedding, expert=expert, moe_layers=moe_layers)


def expected_experts_touched(m: ModelConfig, batch: int) -> float:
    """Expected distinct routed experts one MoE layer reads for ``batch`` tokens.

    Assumes uniform, independent routing: ``E * (1 - (1 - k/E) ** batch)``.
    """
    if not m.moe:
        return 0.0
    e, k = m.moe.num_experts, m.moe.experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** batch)


def decode_params_read(m: ModelConfig, batch: int) -> float:
    """Parameters one decode step over ``batch`` sequences must read from memory.

    Everything but the idle experts and the untied embedding table (a lookup reads
    ``batch`` rows of it, which is negligible). With tied embeddings the table is
    read once, as the LM head.
    """
    c = count_params(m)
    read = c.total - (0 if m.tie_word_embeddings else c.embedding)
    if m.moe:
        read -= c.moe_layers * (m.moe.num_experts - expected_experts_touched(m, batch)) * c.expert
    return read


def matmul_params(m: ModelConfig) -> int:
    """Parameters each token multiplies through (active ones, less the embedding lookup; the LM head counts)."""
    c = count_params(m)
    return c.active - (0 if m.tie_word_embeddings else c.embedding)
