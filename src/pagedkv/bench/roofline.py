"""This machine's ceilings and the loaded model's cost, for the roofline of a benchmark run.

The cost model itself is the planner's (:mod:`pagedkv.planner.roofline`, Williams et al.,
CACM 2009): every step of a run is counted as a :class:`~pagedkv.planner.roofline.StepWork`
and priced with :func:`~pagedkv.planner.roofline.bound`. This module supplies its two
inputs as a benchmark sees them:

- :class:`Machine`: read bandwidth and fp32 matmul rate measured in the same run with
  :func:`pagedkv.planner.cpu.measure` (and the int8 GEMM rate, :func:`int8_rate`, the
  compute ceiling of ``--activation-dtype int8``), once at the start and again before every
  run; the bound uses the best of all those measurements (the least disturbed);
- :func:`model_cost`: bytes and FLOPs per token counted from the engine's loaded tensors.

A run's ``limited_by`` names the term that makes up most of the bound: ``weight-read``
(small batches), ``kv-read`` (long contexts) or ``compute`` (large batches, prefill). Not
counted: activations, KV writes, Python and kernel overheads; a real step is slower, so
fraction = bound / measured <= 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedkv.planner.roofline import ModelCost


@dataclass(frozen=True)
class Machine:
    """Measured ceilings: bytes/s read from memory, fp32 matmul FLOP/s and int8 GEMM
    operations/s (multiply + add = 2, as FLOPs)."""
    read_bandwidth: float
    fp32_flops: float
    method: str = ""
    int8_ops: float = 0.0

    @classmethod
    def measure(cls, size: str = "full") -> "Machine":
        """Measure now. ``size``: ``full`` (the planner's 512 MiB reads, 1024^3 matmuls, best
        of 5), ``probe`` (256 MiB, 1024^3, best of 3: well under a second, taken before
        every run) or ``quick`` (64 MiB, 512^3, best of 3; for tests)."""
        from pagedkv.planner.cpu import measure

        sizes = {"full": (None, None, None), "probe": (256 * 2**20, 1024, 3), "quick": (64 * 2**20, 512, 3)}
        read, n, repeats = sizes[size]
        m = measure(read, n, repeats)
        n = n or 1024
        return cls(m["read_bandwidth_bytes_per_s"], m["fp32_flops"],
                   m["method"] + f"; {n}^3 int8, the faster of torch._int_mm and FBGEMM",
                   int8_rate(n, repeats or 5))

    def best(self, other: "Machine") -> "Machine":
        """The higher of each ceiling: noise on a shared machine only lowers a measurement,
        so the best seen is the closest to the machine's real ceiling."""
        prefix = "best of measurements in this run"
        method = self.method if self.method.startswith(prefix) else f"{prefix} ({self.method})"
        return Machine(max(self.read_bandwidth, other.read_bandwidth), max(self.fp32_flops, other.fp32_flops), method,
                       max(self.int8_ops, other.int8_ops))

    @property
    def bandwidth(self) -> float:
        """Read bandwidth, bytes/s (the planner's device field name)."""
        return self.read_bandwidth

    def matmul_rate(self, compute_dtype: str = "float32") -> float:
        """Operations/s of the products: the measured int8 GEMM rate for ``int8`` (W8A8,
        activations quantized too), else the fp32 rate (weight-only formats widen to fp32)."""
        return self.int8_ops if compute_dtype == "int8" and self.int8_ops else self.fp32_flops

    def to_dict(self) -> dict:
        return asdict(self)


def int8_rate(n: int, repeats: int) -> float:
    """This CPU's int8 GEMM ceiling, ops/s (2 n^3 per product of two ``[n, n]`` matrices): the
    best of ``repeats`` runs of each int8 GEMM torch ships, oneDNN's (``torch._int_mm``) and
    FBGEMM's (``torch.ops.quantized.linear``, uint8 x int8), the faster of the two. Without
    VNNI oneDNN falls back to a slow path (2 GOP/s at 1024^3 on an AVX2-only AMD EPYC, family
    25, where FBGEMM's ``vpmaddubsw`` kernels ran 244-333 GOP/s at 512-2048), so either alone
    can understate the ceiling."""
    import torch

    a = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    b = torch.randint(-127, 128, (n, n), dtype=torch.int8)
    rates = [2 * n**3 / _best_time(lambda: torch._int_mm(a, b), repeats)]
    fbgemm = _fbgemm_product(n)
    if fbgemm is not None:
        rates.append(2 * n**3 / _best_time(fbgemm, repeats))
    return max(rates)


def _fbgemm_product(n: int):
    """A callable running FBGEMM's quantized ``[n, n] x [n, n]`` product, or None where this
    torch has no FBGEMM engine."""
    import warnings

    import torch

    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return None
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # quantized tensors are deprecated, not gone
            w = torch.quantize_per_tensor(torch.randn(n, n), 0.05, 0, torch.qint8)
            packed = torch.ops.quantized.linear_prepack(w, None)
            x = torch.quantize_per_tensor(torch.rand(n, n), 1 / 255, 0, torch.quint8)
    finally:
        torch.backends.quantized.engine = previous

    def run():
        engine = torch.backends.quantized.engine
        torch.backends.quantized.engine = "fbgemm"
        try:
            torch.ops.quantized.linear(x, packed, 1.0, 0)
        finally:
            torch.backends.quantized.engine = engine
    return run


def _best_time(fn, repeats: int) -> float:
    """Seconds of the fastest of ``repeats`` calls of ``fn``, after one warm-up call."""
    import time

    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def as_float32(cost: ModelCost, engine) -> ModelCost:
    """``cost`` with every weight read as fp32: what a baseline that loads the checkpoint in
    fp32 (HF transformers) reads, whatever ``--weight-dtype`` the engine runs."""
    from dataclasses import replace

    m = engine.model
    layers = sum(t.numel() for layer in m.layers
                 for t in (layer.in_norm, layer.post_norm, layer.qkv, layer.o, layer.gate_up, layer.down))
    head = m.lm_head.numel()
    return replace(cost, weight_bytes=4 * (layers + head + m.norm.numel()), lm_head_bytes=4 * head)


def model_cost(engine) -> ModelCost:
    """The cost of ``engine``'s loaded model (an :class:`~pagedkv.engine.engine.LLMEngine`),
    counted from its tensors: weight bytes as stored, matmul parameters of every layer,
    the LM head, KV bytes per token of its cache spec and attention FLOPs per query-key pair."""
    from pagedkv.model.int8_weights import weight_bytes

    m, cfg = engine.model, engine.model.cfg
    mm = sum(t.numel() for layer in m.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down))
    head = m.lm_head.numel()
    return ModelCost(m.weight_bytes, weight_bytes(m.lm_head), mm, head,
                     engine.kv_spec.bytes_per_token,
                     2 * cfg.num_hidden_layers * cfg.num_attention_heads * 2 * cfg.head_dim)
