"""ModelConfig: the shape of a decoder-only model, as the engine, the planner and the KV cache see it.

One dataclass for every reader: the Llama-family forward pass (``hidden_size``,
``rope_theta``, ...), the planner (parameter counts, MLA, MoE, any architecture) and the
cache arithmetic. :meth:`ModelConfig.kv_spec` is the one place a model becomes a
:class:`~pagedkv.kv.spec.KVCacheSpec` (sliding windows, MLA latents and the
tensor-parallel split of KV heads included): the engine sizes its block pool with it and
``pagedkv plan`` prints it. :mod:`pagedkv.model.hf_config` parses a Hugging Face
``config.json`` into it; field names are HF's (``LlamaConfig``). Sizes are in elements.

The engine runs the Llama family only: :func:`for_engine` refuses other architectures.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedkv.kv.groups import hybrid_page_layers, windows_free_pages
from pagedkv.kv.spec import KVCacheSpec

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM")
ENGINE_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the gated MLP's (pagedkv.model.llama.ACTIVATIONS)
ENGINE_MAX_POSITIONS = 2048  # LlamaConfig's default, for a config.json that names none


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, arXiv:2405.04434 section 2.1); dims in elements."""
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None

    @property
    def latent_dim(self) -> int:
        """Elements cached per layer and token: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Mixture of experts: ``num_experts`` routed experts per MoE layer, ``experts_per_tok`` active."""
    num_experts: int
    experts_per_tok: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    first_dense_layers: int = 0
    layer_freq: int = 1
    router_bias: bool = False

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_dense_layers and layer % self.layer_freq == 0


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a decoder-only model (HF names; sizes in elements).

    Attributes beyond HF's ``LlamaConfig`` names: ``name`` and ``source`` (where the config
    came from), ``architecture`` (first of ``architectures``, or ``""``), ``layer_windows``
    (per layer, the sliding window in tokens or ``None``; ``()`` if no layer slides),
    ``qkv_bias`` (q/k/v projections have biases: Qwen2), ``attention_bias`` (the output
    projection too), ``mlp_bias`` (the MLP's projections too: OPT), ``position_embeddings``
    (rows of a learned position table: OPT's ``max_position_embeddings + 2``; 0 for RoPE
    models), ``gated_mlp``, ``norms_per_layer``, ``norm_bias`` (LayerNorm), ``mla``,
    ``moe``, ``torch_dtype`` and ``quant_method`` (the checkpoint's), ``eos_token_ids``.
    Gemma 2's extras (Gemma Team, 2024, "Gemma 2: Improving Open Language Models at a
    Practical Size", sec. 2; HF ``Gemma2Config``): ``attn_logit_softcapping`` and
    ``final_logit_softcapping`` (scores become ``cap * tanh(s / cap)``; None = off),
    ``query_pre_attn_scalar`` (attention scale ``1 / sqrt`` of it instead of of ``head_dim``),
    ``hidden_act`` (the gated MLP's activation: ``silu`` or ``gelu_pytorch_tanh``), and
    ``embedding_multiplier`` (embeddings times ``sqrt(hidden_size)``; None = 1).
    Gemma 3's (Gemma Team, 2025, "Gemma 3 Technical Report", sec. 2; HF ``Gemma3TextConfig``)
    and Qwen 3's: ``qk_norm`` (q and k RMS-normed per head before RoPE, HF ``q_norm``/``k_norm``),
    ``local_rope_theta``/``local_rope_scaling`` (the sliding-window layers' own RoPE; None:
    the window layers use ``rope_theta``/``rope_scaling`` like the others). ``unsupported``:
    what the config asks for that the engine does not run (bidirectional attention, layer
    types other than full and sliding attention): :func:`for_engine` refuses it.
    """
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    name: str = ""
    source: str = ""
    model_type: str = ""
    architecture: str = ""
    tie_word_embeddings: bool = False
    max_position_embeddings: int | None = None
    layer_windows: tuple[int | None, ...] = ()
    torch_dtype: str | None = None
    quant_method: str | None = None
    qkv_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    position_embeddings: int = 0
    gated_mlp: bool = True
    norms_per_layer: int = 2
    norm_bias: bool = False
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    hidden_act: str = "silu"
    embedding_multiplier: float | None = None
    qk_norm: bool = False
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    unsupported: tuple[str, ...] = ()

    @property
    def attention_scale(self) -> float:
        """The factor on q . k before the softmax: ``query_pre_attn_scalar ** -0.5`` where
        the config sets it (Gemma 2), else ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def sandwich_norms(self) -> bool:
        """Four norms per layer (Gemma 2): the attention and MLP outputs are normed too
        before their residual adds."""
        return self.norms_per_layer == 4

    @property
    def attention(self) -> str:
        """``"MLA"``, ``"MHA"`` (KV heads = query heads), ``"MQA"`` (one KV head) or ``"GQA"``."""
        if self.mla:
            return "MLA"
        if self.num_key_value_heads == self.num_attention_heads:
            return "MHA"
        return "MQA" if self.num_key_value_heads == 1 else "GQA"

    @property
    def sliding_layers(self) -> int:
        """Number of layers with a sliding window."""
        return sum(w is not None for w in self.layer_windows)

    @property
    def sliding_window(self) -> int | None:
        """The smallest sliding window of any layer in tokens, or ``None`` if no layer slides."""
        return min((w for w in self.layer_windows if w is not None), default=None)

    def with_kv_heads(self, kv_heads: int | None) -> "ModelConfig":
        """The MHA/GQA/MQA variant with ``kv_heads`` KV heads (``None``: unchanged).

        Raises:
            ValueError: for an MLA model, or ``kv_heads`` that does not divide the query heads.
        """
        if kv_heads is None:
            return self
        if self.mla:
            raise ValueError(f"{self.name} uses MLA: it caches one latent per layer, not KV heads")
        if not isinstance(kv_heads, int) or kv_heads < 1 or self.num_attention_heads % kv_heads:
            raise ValueError(f"--kv-heads must divide the {self.num_attention_heads} query heads of "
                             f"{self.name}, got {kv_heads}")
        return replace(self, num_key_value_heads=kv_heads)

    def kv_heads_per_device(self, tp: int) -> int:
        """KV heads the most loaded of ``tp`` devices holds (:func:`head_spans`: split as evenly
        as whole heads allow, or replicated when fewer than ``tp``).

        Raises:
            ValueError: fewer KV heads than devices where replication cannot split them.
        """
        if self.mla:
            return 1  # the latent is not split by head; every device holds all of it
        return max(b - a for _, (a, b) in head_spans(self.num_attention_heads, self.num_key_value_heads, tp))

    def kv_spec(self, dtype: str, block_size: int = 16, tp: int = 1,
                scale_granularity: str = "per-token-head") -> KVCacheSpec:
        """The KV cache of one of ``tp`` devices: K and V per layer and KV head (an MLA model:
        one latent per layer), each layer's sliding window kept; a model of window and full
        layers in equal numbers gets the hybrid page layout (``page_layers``:
        :func:`~pagedkv.kv.groups.hybrid_page_layers`). The engine's pool and the planner's
        figures both come from here.

        Raises:
            ValueError: for a ``tp`` that does not split the KV heads, or a bad dtype/size.
        """
        if self.mla:
            d = self.mla.latent_dim
            return KVCacheSpec(self.num_hidden_layers, 1, d, dtype, block_size, mla_latent_dim=d,
                               layer_windows=self.layer_windows, scale_granularity=scale_granularity)
        return KVCacheSpec(self.num_hidden_layers, self.kv_heads_per_device(tp), self.head_dim, dtype,
                           block_size, layer_windows=self.layer_windows, scale_granularity=scale_granularity,
                           page_layers=hybrid_page_layers(self.layer_windows),
                           page_windows=windows_free_pages(self.layer_windows))


Span = tuple[int, int]  # [start, stop)


def even_spans(n: int, parts: int, unit: int = 1) -> list[Span]:
    """``n`` items in ``parts`` contiguous runs of whole ``unit``s, sizes differing by at
    most one unit, the larger first. Raises ValueError if a run would be empty."""
    units = n // unit
    if n % unit or units < parts:
        raise ValueError(f"{n} cannot be split into {parts} parts of whole units of {unit}")
    spans, start = [], 0
    for r in range(parts):
        size = (units // parts + (r < units % parts)) * unit
        spans.append((start, start + size))
        start += size
    return spans


def head_spans(num_heads: int, num_kv_heads: int, world: int) -> list[tuple[Span, Span]]:
    """Per rank, its (query heads, KV heads).

    Raises:
        ValueError: fewer KV heads than ranks where neither replication rule holds.
    """
    group = num_heads // num_kv_heads  # query heads per KV head (GQA)
    if num_kv_heads >= world:
        kv = even_spans(num_kv_heads, world)
        return [((a * group, b * group), (a, b)) for a, b in kv]
    per_kv = world // num_kv_heads  # ranks sharing one KV head
    if world % num_kv_heads or group % per_kv:
        raise ValueError(f"tensor parallel size {world} does not split {num_kv_heads} KV heads: with fewer KV heads "
                         f"than ranks, the rank count must be a multiple of them and divide their {group} query heads")
    q = group // per_kv
    return [((r * q, (r + 1) * q), (r // per_kv, r // per_kv + 1)) for r in range(world)]


def for_engine(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` as the engine runs it: a Llama-family architecture (a config.json without
    ``architectures`` counts as Llama) and ``max_position_embeddings`` set (LlamaConfig's 2,048
    when the file names none).

    Raises:
        ValueError: for an architecture outside :data:`SUPPORTED_ARCHITECTURES` or an MLP
            activation outside :data:`ENGINE_ACTIVATIONS`.
    """
    arch = cfg.architecture or "LlamaForCausalLM"
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; pagedkv runs {SUPPORTED_ARCHITECTURES}")
    if cfg.unsupported:
        raise ValueError(f"the engine does not run {'; '.join(cfg.unsupported)} (the planner can size this model)")
    if cfg.hidden_act not in ENGINE_ACTIVATIONS:
        raise ValueError(f"unsupported MLP activation {cfg.hidden_act!r}; pagedkv runs {ENGINE_ACTIVATIONS}")
    if cfg.attention_bias or cfg.mlp_bias:  # (q/k/v biases, Qwen2's, are run)
        raise ValueError("this model has biases on its attention output projection or MLP (attention_bias / "
                         "mlp_bias): the engine does not apply them yet, so it refuses the model")
    return replace(cfg, architecture=arch, max_position_embeddings=cfg.max_position_embeddings or ENGINE_MAX_POSITIONS)
