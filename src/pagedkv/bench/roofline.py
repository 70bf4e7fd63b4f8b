"""Roofline bounds of a benchmark run on this machine (Williams et al., CACM 2009).

Every step of a run is counted from what it did: ``tokens`` computed, ``sampled`` rows
sent through the LM head, ``kv_tokens`` of KV read by attention (each sequence reads its
whole context once) and ``attn_pairs`` query-key pairs. Then::

    bytes   = weight bytes (LM head only if a row samples) + kv_tokens * KV bytes/token
    flops   = 2 * layer matmul params * tokens + 2 * vocab * hidden * sampled
              + 2 * num_layers * num_heads * 2 * head_dim * attn_pairs
    bound_s = max(bytes / read bandwidth, flops / fp32 matmul rate)

and a run's bound is the sum over its steps. Its ``limited_by`` names the term that makes
up most of the bound: ``weight-read`` (small batches), ``kv-read`` (long contexts) or
``compute`` (large batches, prefill). Read bandwidth and matmul rate are measured in the
same run with :func:`pagedkv.planner.cpu.measure`, once at the start and again before every
run; the bound uses the best of all those measurements (the least disturbed). Not counted: activations, KV writes,
Python and kernel overheads; a real step is slower, so fraction = bound / measured <= 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Machine:
    """Measured ceilings: bytes/s read from memory and fp32 matmul FLOP/s."""
    read_bandwidth: float
    fp32_flops: float
    method: str = ""

    @classmethod
    def measure(cls, size: str = "full") -> "Machine":
        """Measure now. ``size``: ``full`` (the planner's 512 MiB reads, 1024^3 matmuls, best
        of 5), ``probe`` (256 MiB, 1024^3, best of 3: well under a second, taken before
        every run) or ``quick`` (64 MiB, 512^3, best of 3; for tests)."""
        from pagedkv.planner.cpu import measure

        sizes = {"full": (None, None, None), "probe": (256 * 2**20, 1024, 3), "quick": (64 * 2**20, 512, 3)}
        m = measure(*sizes[size])
        return cls(m["read_bandwidth_bytes_per_s"], m["fp32_flops"], m["method"])

    def best(self, other: "Machine") -> "Machine":
        """The higher of each ceiling: noise on a shared machine only lowers a measurement,
        so the best seen is the closest to the machine's real ceiling."""
        prefix = "best of measurements in this run"
        method = self.method if self.method.startswith(prefix) else f"{prefix} ({self.method})"
        return Machine(max(self.read_bandwidth, other.read_bandwidth), max(self.fp32_flops, other.fp32_flops), method)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ModelCost:
    """Bytes and FLOPs of the model per token, from its loaded tensors and config."""
    weight_bytes: int          # every weight tensor, each counted once (tied LM head = embedding)
    lm_head_bytes: int
    layer_matmul_params: int   # q, k, v, o, gate, up, down over all layers
    lm_head_params: int        # vocab * hidden
    kv_bytes_per_token: int
    attn_flops_per_pair: int   # 2 * layers * heads * (d_qk + d_v)

    @classmethod
    def from_engine(cls, engine) -> "ModelCost":
        m, cfg = engine.model, engine.model.cfg
        mm = sum(t.numel() for layer in m.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down))
        head = m.lm_head.numel()
        return cls(m.weight_bytes, head * m.lm_head.element_size(), mm, head,
                   engine.parts.spec.bytes_per_token,
                   2 * cfg.num_hidden_layers * cfg.num_attention_heads * 2 * cfg.head_dim)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepWork:
    """What one step computed (tokens, sampled rows, KV tokens read, query-key pairs)."""
    tokens: int
    sampled: int
    kv_tokens: int
    attn_pairs: int


def causal_pairs(start: int, n: int) -> int:
    """Query-key pairs of ``n`` causal queries at positions ``start .. start+n-1``."""
    return n * start + n * (n + 1) // 2


def step_terms(w: StepWork, cost: ModelCost, machine: Machine) -> dict[str, float]:
    """Seconds of each bound term of one step: weight-read, kv-read, compute."""
    weights = cost.weight_bytes - (0 if w.sampled else cost.lm_head_bytes)
    flops = (2 * cost.layer_matmul_params * w.tokens + 2 * cost.lm_head_params * w.sampled
             + cost.attn_flops_per_pair * w.attn_pairs)
    return {"weight-read": weights / machine.read_bandwidth,
            "kv-read": w.kv_tokens * cost.kv_bytes_per_token / machine.read_bandwidth,
            "compute": flops / machine.fp32_flops}


def bound(steps: list[StepWork], cost: ModelCost, machine: Machine) -> dict:
    """Lower bound in seconds of running ``steps``, and the term that limits it most.

    Each step costs ``max(memory, compute)`` with memory = weight-read + kv-read; the
    bound's seconds are credited to the larger of the three terms of each step.
    """
    total, by_term = 0.0, {"weight-read": 0.0, "kv-read": 0.0, "compute": 0.0}
    for w in steps:
        t = step_terms(w, cost, machine)
        mem = t["weight-read"] + t["kv-read"]
        s = max(mem, t["compute"])
        total += s
        by_term["compute" if t["compute"] >= mem else max(("weight-read", "kv-read"), key=t.get)] += s
    return {"bound_s": total, "steps": len(steps), "seconds_by_limit": by_term,
            "limited_by": max(by_term, key=by_term.get) if steps else None}


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


def weight_read_tokens_per_s(cost: ModelCost, machine: Machine) -> float:
    """Single-stream decode bound, tokens/s: one full weight read per token."""
    return machine.read_bandwidth / cost.weight_bytes
