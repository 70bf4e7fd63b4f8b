"""Model shapes for the planner: read from a Hugging Face ``config.json`` or a bundled name.

Bundled configs live in ``planner/data/models/<name>.json`` as
``{"name", "source", "notes", "config": {...}}`` where ``config`` holds keys copied
from the model's Hugging Face config.json (``source`` is its URL). A path to any
config.json (or to a folder holding one) is read the same way.

:class:`ModelConfig` keeps what shapes the KV cache and the parameter count;
:meth:`ModelConfig.kv_spec` turns it into the engine's :class:`KVCacheSpec`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from pagedkv.kv.spec import KVCacheSpec

_DATA = "data/models"


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
    """The shape of a decoder-only model, as far as memory and FLOPs go. Sizes in elements."""
    name: str
    source: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int | None
    layer_windows: tuple[int | None, ...] = ()
    torch_dtype: str | None = None
    quant_method: str | None = None
    qkv_bias: bool = False
    attention_bias: bool = False
    gated_mlp: bool = True
    norms_per_layer: int = 2
    norm_bias: bool = False
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None

    @property
    def attention(self) -> str:
        """``"MLA"``, ``"MHA"`` (KV heads = query heads), ``"MQA"`` (one KV head) or ``"GQA"``."""
        if self.mla:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else "GQA"

    @property
    def sliding_layers(self) -> int:
        """Number of layers with a sliding window."""
        return sum(w is not None for w in self.layer_windows)

    def with_kv_heads(self, kv_heads: int | None) -> "ModelConfig":
        """The MHA/GQA/MQA variant with ``kv_heads`` KV heads (``None``: unchanged).

        Raises:
            ValueError: for an MLA model, or ``kv_heads`` that does not divide the query heads.
        """
        if kv_heads is None:
            return self
        if self.mla:
            raise ValueError(f"{self.name} uses MLA: it caches one latent per layer, not KV heads")
        if not isinstance(kv_heads, int) or kv_heads < 1 or self.num_heads % kv_heads:
            raise ValueError(f"--kv-heads must divide the {self.num_heads} query heads of {self.name}, got {kv_heads}")
        return replace(self, num_kv_heads=kv_heads)

    def kv_heads_per_device(self, tp: int) -> int:
        """KV heads one of ``tp`` devices holds: split evenly, or replicated when fewer than ``tp``.

        Raises:
            ValueError: if neither count divides the other (the engines' rule).
        """
        if self.mla:
            return 1  # the latent is not split by head; every device holds all of it
        kv = self.num_kv_heads
        if kv % tp == 0:
            return kv // tp
        if tp % kv == 0:
            return 1
        raise ValueError(f"--tp {tp} does not split {kv} KV heads: one must divide the other")

    def kv_spec(self, dtype: str, block_size: int = 16, tp: int = 1,
                scale_granularity: str = "per-token-head") -> KVCacheSpec:
        """The KV cache of one of ``tp`` devices, in the engine's :class:`KVCacheSpec`."""
        if self.mla:
            d = self.mla.latent_dim
            return KVCacheSpec(self.num_layers, 1, d, dtype, block_size, mla_latent_dim=d,
                               layer_windows=self.layer_windows, scale_granularity=scale_granularity)
        return KVCacheSpec(self.num_layers, self.kv_heads_per_device(tp), self.head_dim, dtype, block_size,
                           layer_windows=self.layer_windows, scale_granularity=scale_granularity)


def bundled_names() -> list[str]:
    """Names of the bundled model configs, sorted."""
    folder = resources.files("pagedkv.planner").joinpath(_DATA)
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def bundled_entry(name: str) -> dict:
    """The raw bundled entry ``{"name", "source", "notes", "config"}`` for ``name``."""
    text = resources.files("pagedkv.planner").joinpath(f"{_DATA}/{name}.json").read_text()
    return json.loads(text)


def load_model(name_or_path: str) -> ModelConfig:
    """A bundled model by name (case-insensitive), or a config.json path / folder holding one.

    Raises:
        ValueError: unknown name, unreadable or malformed config.json, or missing keys.
    """
    key = str(name_or_path).strip()
    if key.lower() in bundled_names():
        entry = bundled_entry(key.lower())
        return from_hf_config(entry["config"], entry["name"], entry["source"])
    path = Path(key).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model {name_or_path!r}: not a bundled name (see --list-models) "
                         "and no config.json at that path")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path} as JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a config.json: top level is not an object")
    return from_hf_config(cfg, path.parent.name or str(path), str(path))


def from_hf_config(cfg: dict, name: str, source: str) -> ModelConfig:
    """Build a :class:`ModelConfig` from a Hugging Face config.json dict (see :mod:`.hf_config`)."""
    from pagedkv.planner.hf_config import parse
    return parse(cfg, name, source)
