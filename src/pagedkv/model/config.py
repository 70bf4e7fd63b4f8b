"""ModelConfig: the Llama-family hyper-parameters the forward pass and the KV spec need.

Read from a Hugging Face ``config.json`` (Llama, Mistral, Qwen2 field names) or built
from GGUF metadata by the converter, which writes the same ``config.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder.

    Attributes mirror HF's ``LlamaConfig``: ``hidden_size``, ``intermediate_size``,
    ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``
    (default hidden/heads), ``vocab_size``, ``rms_norm_eps``, ``rope_theta``,
    ``rope_scaling`` (dict or None), ``max_position_embeddings``, ``tie_word_embeddings``,
    ``attention_bias`` (Qwen2 has q/k/v biases), ``sliding_window`` (tokens or None),
    ``bos_token_id``, ``eos_token_ids``.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int = 0
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())
    architecture: str = "LlamaForCausalLM"

    def __post_init__(self) -> None:
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"{self.num_attention_heads} attention heads are not a multiple "
                             f"of {self.num_key_value_heads} KV heads")

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        """Build from a parsed HF ``config.json``.

        Raises:
            ValueError: for an architecture outside the Llama family or a missing field.
        """
        if not isinstance(d, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(d).__name__}")
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "vocab_size", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = d.get(name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"config.json: {name} must be a positive integer, got {v!r}")
        arch = (d.get("architectures") or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; pagedkv runs {SUPPORTED_ARCHITECTURES}")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_params = d.get("rope_parameters") or {}
        try:
            return cls(
                hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"], num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                vocab_size=d["vocab_size"], head_dim=d.get("head_dim") or 0,
                rms_norm_eps=d.get("rms_norm_eps", 1e-5),
                rope_theta=d.get("rope_theta", rope_params.get("rope_theta", 10000.0)),
                rope_scaling=d.get("rope_scaling") if d.get("rope_scaling") else _scaling(rope_params),
                max_position_embeddings=d.get("max_position_embeddings", 2048),
                tie_word_embeddings=d.get("tie_word_embeddings", False),
                attention_bias=d.get("attention_bias", arch == "Qwen2ForCausalLM"),
                sliding_window=d.get("sliding_window") if d.get("use_sliding_window", True) else None,
                bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids, architecture=arch)
        except KeyError as e:
            raise ValueError(f"config.json lacks required field {e.args[0]!r}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        """Raises ValueError for unreadable JSON or a bad field (see :meth:`from_dict`)."""
        try:
            d = json.loads(Path(path).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not valid JSON ({e})") from None
        return cls.from_dict(d)


def _scaling(rope_params: dict) -> dict | None:
    """transformers >= 5 keeps rope scaling in ``rope_parameters``; 'default' means none."""
    kind = rope_params.get("rope_type", "default")
    return None if kind == "default" else dict(rope_params)


def kv_spec_for(cfg: ModelConfig, dtype: str, block_size: int,
                scale_granularity: str = "per-token-head") -> "KVCacheSpec":
    """The KVCacheSpec the engine allocates for this model (one K and V per layer and KV head)."""
    from pagedkv.kv.spec import KVCacheSpec

    return KVCacheSpec(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                       head_dim=cfg.head_dim, dtype=dtype, block_size=block_size,
                       scale_granularity=scale_granularity)
