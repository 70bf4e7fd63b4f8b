"""Roofline lower bounds for one device of a tensor-parallel group.

A step cannot finish faster than it can read its bytes from device memory, nor
faster than it can do its FLOPs (Williams, Waterman, Patterson, "Roofline",
CACM 2009). For a decode step over ``batch`` sequences of ``context`` tokens:

    memory_s  = (weight bytes read + KV bytes read) / bandwidth
    compute_s = batch * (2 * matmul params + attention FLOPs per token) / matmul rate
    bound     = max(memory_s, compute_s)

per device, with weights and FLOPs split ``tp`` ways and the KV bytes of that
device's share of heads. Weight bytes read skip idle MoE experts (uniform routing,
see :func:`pagedkv.planner.params.expected_experts_touched`). Attention FLOPs per
token and layer are ``2 * heads * (d_qk + d_v) * tokens held`` (window-capped);
MLA decode uses the absorbed form (``d_qk = kv_lora_rank + rope``, ``d_v =
kv_lora_rank``). With ``tp`` > 1 the step also all-reduces each layer's two row-parallel
outputs (attention's o_proj and the MLP's down projection: Shoeybi et al., 2019,
"Megatron-LM", sec. 3), ``tokens * hidden`` activations each; a ring all-reduce sends and
receives ``2 (tp - 1) / tp`` of the message per device (Patarasuk and Yuan, 2009,
"Bandwidth optimal all-reduce algorithms for clusters of workstations") over the GPU link
(:attr:`Device.tp_link`), added to the bound (not overlapped; its latency is not counted).
Not counted: activations' memory traffic, kernel launch overheads; a real step is slower.
Units: seconds, bytes, FLOPs.

The same model prices a *counted* schedule, step by step (``pagedkv bench`` on the
steps a run actually took, and the simulator's cost clock): a :class:`StepWork` says
what one step computed (tokens, sampled rows, KV tokens read, query-key pairs), a
:class:`ModelCost` what the model costs per unit of each, and a device (anything with
``bandwidth`` and ``matmul_rate(dtype)``: a catalog :class:`Device` or a machine measured
in the same run) the ceilings::

    bytes   = weight bytes (LM head only if a row samples) + kv_tokens * KV bytes/token
    flops   = 2 * layer matmul params * tokens + 2 * vocab * hidden * sampled
              + attention FLOPs per pair * attn_pairs
    bound_s = max(bytes / bandwidth, flops / matmul rate)

and a schedule's bound is the sum over its steps (:func:`bound`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Protocol

from pagedkv.kv.spec import KVCacheSpec
from pagedkv.model.config import ModelConfig
from pagedkv.planner.dtypes import WEIGHT_DTYPE_BYTES
from pagedkv.planner.hardware import Device
from pagedkv.planner.params import count_params, decode_params_read, matmul_params

MAX_SWEEP_BATCH = 4096


@dataclass(frozen=True)
class StepBound:
    """Lower bound of one step on one device.

    Attributes:
        seconds: ``max(memory_seconds, compute_seconds) + allreduce_seconds``.
        memory_seconds: bytes read / memory bandwidth.
        compute_seconds: FLOPs / matmul rate.
        allreduce_seconds: tensor-parallel all-reduce bytes / the GPU link (0 at tp 1).
        limited_by: ``"memory"`` or ``"compute"``, whichever bound is larger.
        bytes_read: bytes the step reads on one device.
        flops: FLOPs on one device.
        tokens_per_s: tokens the step produces (decode: ``batch``; prefill: prompt tokens) per second.
    """
    seconds: float
    memory_seconds: float
    compute_seconds: float
    limited_by: str
    bytes_read: float
    flops: float
    tokens_per_s: float
    allreduce_seconds: float = 0.0


ALLREDUCES_PER_LAYER = 2  # Megatron's row-parallel outputs: o_proj and down


def allreduce_elements_per_token(m: ModelConfig, tp: int) -> float:
    """Activation elements one device sends per token through a step's all-reduces:
    ``layers * 2 * hidden * 2 (tp - 1) / tp`` (ring all-reduce; 0 at tp 1)."""
    return m.num_hidden_layers * ALLREDUCES_PER_LAYER * m.hidden_size * 2 * (tp - 1) / tp


@dataclass(frozen=True)
class Roofline:
    """What a step costs on one device: model, its per-device KV spec, the device, dtype and TP."""
    model: ModelConfig
    spec: KVCacheSpec
    device: Device
    weight_dtype: str
    tp: int

    def _bound(self, nbytes: float, flops: float, tokens: int) -> StepBound:
        mem = nbytes / self.device.bandwidth
        comp = flops / self.device.matmul_rate(self.weight_dtype)
        comm = (tokens * allreduce_elements_per_token(self.model, self.tp) * self.device.activation_bytes
                / self.device.tp_link)
        s = max(mem, comp) + comm
        return StepBound(s, mem, comp, "memory" if mem >= comp else "compute", nbytes, flops, tokens / s, comm)

    def _attn_dims(self, absorbed: bool) -> tuple[int, int]:
        m = self.model
        if m.mla and absorbed:
            return m.mla.latent_dim, m.mla.kv_lora_rank
        if m.mla:
            return m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim, m.mla.v_head_dim
        return m.head_dim, m.head_dim

    def _attn_flops(self, tokens_attended: list[int], absorbed: bool) -> float:
        dqk, dv = self._attn_dims(absorbed)
        return 2.0 * self.model.num_attention_heads * (dqk + dv) * sum(tokens_attended)

    def weight_bytes_read(self, batch: int) -> float:
        """Weight bytes one decode step over ``batch`` sequences reads on one device."""
        return decode_params_read(self.model, batch) * WEIGHT_DTYPE_BYTES[self.weight_dtype] / self.tp

    def decode(self, batch: int, context: int) -> StepBound:
        """One decode step: ``batch`` sequences, each attending to ``context`` tokens."""
        held = [self.spec.tokens_held(context, i) for i in range(self.model.num_hidden_layers)]
        kv = batch * self.spec.bytes_for_tokens(context)
        flops = batch * (2.0 * matmul_params(self.model) + self._attn_flops(held, True)) / self.tp
        return self._bound(self.weight_bytes_read(batch) + kv, flops, batch)

    def prefill(self, prompt: int, batch: int = 1) -> StepBound:
        """Prefill of ``batch`` prompts of ``prompt`` tokens (causal; weights read once, KV written)."""
        pairs = [causal_pairs(0, prompt, self.spec.layer_windows[i] if self.spec.layer_windows else None)
                 for i in range(self.model.num_hidden_layers)]
        flops = batch * (2.0 * matmul_params(self.model) * prompt + self._attn_flops(pairs, False)) / self.tp
        nbytes = (count_params(self.model).total * WEIGHT_DTYPE_BYTES[self.weight_dtype] / self.tp
                  + batch * self.spec.bytes_for_tokens(prompt))
        return self._bound(nbytes, flops, batch * prompt)

    def ridge_batch(self, context: int) -> int | None:
        """Smallest batch whose decode step is compute-bound, or ``None`` if none up to 2^20 is.

        ``None`` means each sequence's KV reads take longer than its FLOPs: more batch never
        makes the step compute-bound (tokens/s then tends to :meth:`kv_bound_tokens_per_s`).
        """
        if self.decode(1, context).limited_by == "compute":
            return 1
        lo, hi = 1, 2                      # decode(lo) is memory-bound
        while self.decode(hi, context).limited_by == "memory":
            if hi >= 2**20:
                return None
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.decode(mid, context).limited_by == "memory" else (lo, mid)
        return hi

    def kv_bound_tokens_per_s(self, context: int) -> float:
        """Decode tokens/s as batch grows without limit while memory-bound: bandwidth / KV bytes per sequence."""
        return self.device.bandwidth / self.spec.bytes_for_tokens(context)

    def sweep(self, context: int, batches: list[int]) -> list[tuple[int, StepBound]]:
        """Decode bounds at each batch size."""
        return [(b, self.decode(b, context)) for b in batches]


def sweep_batches(batch: int, max_batch: int | None) -> list[int]:
    """Powers of two up to ``max(batch, max_batch)`` (at most 4096), plus ``batch`` and ``max_batch``."""
    top = min(max(batch, max_batch or 1), MAX_SWEEP_BATCH)
    out, b = [batch] + ([top] if max_batch else []), 1
    while b <= top:
        out.append(b)
        b *= 2
    return sorted(set(out))


def causal_pairs(start: int, n: int, window: int | None = None) -> int:
    """Query-key pairs of ``n`` causal queries at positions ``start .. start+n-1``, each
    seeing at most ``window`` keys (``None``: all before it and itself)."""
    return _pairs_before(start + n, window) - _pairs_before(start, window)


def _pairs_before(n: int, window: int | None) -> int:
    """Pairs of the first ``n`` queries: ``sum(min(p + 1, window) for p in range(n))``."""
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


# ---- counted schedules: one step at a time -----------------------------------------------
class Ceilings(Protocol):
    """What bounds a step: memory read bandwidth (bytes/s) and matrix rate (FLOP/s)."""
    bandwidth: float

    def matmul_rate(self, weight_dtype: str) -> float: ...


@dataclass(frozen=True)
class StepWork:
    """What one step computed: ``tokens`` through the layers, ``sampled`` rows through the
    LM head, ``kv_tokens`` of KV read by attention (each sequence reads its whole context
    once) and ``attn_pairs`` query-key pairs."""
    tokens: int
    sampled: int
    kv_tokens: int
    attn_pairs: int


@dataclass(frozen=True)
class ModelCost:
    """Bytes and FLOPs of a model per unit of :class:`StepWork`.

    An MoE model's routed experts are not in ``weight_bytes``: a step of ``tokens`` rows
    reads ``expert_bytes`` for each of the experts they touch in expectation,
    ``num_experts * (1 - (1 - experts_per_tok / num_experts) ** tokens)`` (uniform routing,
    :func:`pagedkv.planner.params.expected_experts_touched`); 0 experts for dense models."""
    weight_bytes: int          # every weight tensor, each counted once (tied LM head = embedding)
    lm_head_bytes: int
    layer_matmul_params: int   # q, k, v, o, gate, up, down over all layers (active ones, MoE)
    lm_head_params: int        # vocab * hidden
    kv_bytes_per_token: int
    attn_flops_per_pair: int   # 2 * layers * heads * (d_qk + d_v)
    expert_bytes: int = 0      # one routed expert of every MoE layer
    num_experts: int = 0
    experts_per_tok: int = 0
    allreduce_elements_per_token: float = 0.0  # tensor parallelism (allreduce_elements_per_token)

    def to_dict(self) -> dict:
        return asdict(self)

    def weights_read(self, tokens: int, sampled: int) -> float:
        """Weight bytes a step of ``tokens`` rows reads (the LM head only if a row samples)."""
        w = self.weight_bytes - (0 if sampled else self.lm_head_bytes)
        if self.num_experts:
            e, k = self.num_experts, self.experts_per_tok
            w += self.expert_bytes * e * (1.0 - (1.0 - k / e) ** max(tokens, 1))
        return w


def step_terms(w: StepWork, cost: ModelCost, device: Ceilings, compute_dtype: str = "float32") -> dict[str, float]:
    """Seconds of each bound term of one step: weight-read, kv-read, compute."""
    weights = cost.weights_read(w.tokens, w.sampled)
    flops = (2 * cost.layer_matmul_params * w.tokens + 2 * cost.lm_head_params * w.sampled
             + cost.attn_flops_per_pair * w.attn_pairs)
    return {"weight-read": weights / device.bandwidth,
            "kv-read": w.kv_tokens * cost.kv_bytes_per_token / device.bandwidth,
            "compute": flops / device.matmul_rate(compute_dtype)}


def bound(steps: list[StepWork], cost: ModelCost, device: Ceilings, compute_dtype: str = "float32") -> dict:
    """Lower bound in seconds of running ``steps``, and the term that limits it most.

    Each step costs ``max(memory, compute)`` with memory = weight-read + kv-read; the
    bound's seconds are credited to the larger of the three terms of each step.
    """
    total, by_term = 0.0, {"weight-read": 0.0, "kv-read": 0.0, "compute": 0.0}
    for w in steps:
        t = step_terms(w, cost, device, compute_dtype)
        mem = t["weight-read"] + t["kv-read"]
        s = max(mem, t["compute"])
        total += s
        by_term["compute" if t["compute"] >= mem else max(("weight-read", "kv-read"), key=t.get)] += s
    return {"bound_s": total, "steps": len(steps), "seconds_by_limit": by_term,
            "limited_by": max(by_term, key=by_term.get) if steps else None}


def config_cost(m: ModelConfig, spec: KVCacheSpec, weight_dtype: str, tp: int = 1) -> ModelCost:
    """The :class:`ModelCost` of one of ``tp`` devices, counted from a config (no tensors):
    the simulator's cost for models it does not load. Weight bytes are what
    :meth:`Roofline.decode` reads (an untied embedding table is not read; an MoE model's
    routed experts as many as a step's tokens touch); ``spec`` is the device's share of
    the cache (:meth:`ModelConfig.kv_spec` at ``tp``)."""
    per = WEIGHT_DTYPE_BYTES[weight_dtype]
    head = m.vocab_size * m.hidden_size
    c = count_params(m)
    experts = c.moe_layers * m.moe.num_experts * c.expert if m.moe else 0
    read = c.total - (0 if m.tie_word_embeddings else head) - experts
    dqk, dv = ((m.mla.latent_dim, m.mla.kv_lora_rank) if m.mla else (m.head_dim, m.head_dim))
    return ModelCost(weight_bytes=round(read * per / tp), lm_head_bytes=round(head * per / tp),
                     layer_matmul_params=(matmul_params(m) - head) // tp, lm_head_params=head // tp,
                     kv_bytes_per_token=spec.bytes_per_token,
                     attn_flops_per_pair=2 * m.num_hidden_layers * m.num_attention_heads * (dqk + dv) // tp,
                     expert_bytes=round(c.moe_layers * c.expert * per / tp),
                     num_experts=m.moe.num_experts if m.moe else 0,
                     experts_per_tok=m.moe.experts_per_tok if m.moe else 0,
                     allreduce_elements_per_token=allreduce_elements_per_token(m, tp))


def chunk_work(chunks: list[tuple[int, int]], sampled: int,
               windows: tuple[tuple[int | None, float], ...] = ()) -> StepWork:
    """The :class:`StepWork` of a step that computed ``(start, num_tokens)`` chunks (each
    reads its context once) and sampled ``sampled`` rows.

    ``windows``: ``(window, fraction of layers)`` pairs (:func:`layer_window_mix`) when
    layers attend to a window; KV tokens and query-key pairs are then averaged over the
    layers, each capped by its window (empty: every layer reads the whole context)."""
    if not windows:  # (once per simulated step: one pass, causal_pairs inlined)
        tokens = kv = twice_pairs = 0
        for s, n in chunks:
            tokens, kv, twice_pairs = tokens + n, kv + s + n, twice_pairs + (s + n) * (s + n + 1) - s * (s + 1)
        return StepWork(tokens, sampled, kv, twice_pairs // 2)
    kv = sum(f * (s + n if w is None else min(s + n, w)) for s, n in chunks for w, f in windows)
    pairs = sum(f * causal_pairs(s, n, w) for s, n in chunks for w, f in windows)
    return StepWork(sum(n for _, n in chunks), sampled, round(kv), round(pairs))


def layer_window_mix(layer_windows: tuple[int | None, ...]) -> tuple[tuple[int | None, float], ...]:
    """Each distinct window (None: full attention) and the fraction of layers with it;
    ``()`` when no layer has a window."""
    if not any(w is not None for w in layer_windows):
        return ()
    n = len(layer_windows)
    return tuple((w, layer_windows.count(w) / n) for w in dict.fromkeys(layer_windows))


def ideal_offline_steps(prompt_lens: list[int], output_lens: list[int]) -> list[StepWork]:
    """The cheapest schedule of an offline batch: every prompt in one prefill step (which
    samples each first token), then one decode step per further token over every request
    still running."""
    steps = [StepWork(sum(prompt_lens), len(prompt_lens), sum(prompt_lens),
                      sum(causal_pairs(0, p) for p in prompt_lens))]
    for t in range(1, max(output_lens, default=0)):
        live = [p + t for p, o in zip(prompt_lens, output_lens) if o > t]
        steps.append(StepWork(len(live), len(live), sum(live), sum(live)))
    return steps


def weight_read_tokens_per_s(cost: ModelCost, device: Ceilings) -> float:
    """Single-stream decode bound, tokens/s: one full weight read per token."""
    return device.bandwidth / cost.weight_bytes
