"""Check a checkpoint's tensors against its config before building the model.

A config.json that disagrees with its weights (a wrong ``vocab_size``, head count,
``head_dim`` or layer count) must fail at load with the field and both numbers, not
crash mid-step or silently run a truncated model.
"""

from __future__ import annotations

import re

import torch

from pagedkv.model.config import ModelConfig


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for every tensor a Llama-family checkpoint must hold."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes |= {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,),
                   f"{p}.self_attn.q_proj.weight": (q, h), f"{p}.self_attn.k_proj.weight": (kv, h),
                   f"{p}.self_attn.v_proj.weight": (kv, h), f"{p}.self_attn.o_proj.weight": (h, q),
                   f"{p}.mlp.gate_proj.weight": (inter, h), f"{p}.mlp.up_proj.weight": (inter, h),
                   f"{p}.mlp.down_proj.weight": (h, inter)}
        if cfg.sandwich_norms:
            shapes |= {f"{p}.pre_feedforward_layernorm.weight": (h,), f"{p}.post_feedforward_layernorm.weight": (h,)}
        if cfg.qkv_bias:
            shapes |= {f"{p}.self_attn.q_proj.bias": (q,), f"{p}.self_attn.k_proj.bias": (kv,),
                       f"{p}.self_attn.v_proj.bias": (kv,)}
    return shapes


def check_weights(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """Raise ValueError naming the first mismatch between ``cfg`` and ``state``."""
    layers = {int(m.group(1)) for k in state if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    if layers and max(layers) + 1 != cfg.num_hidden_layers:
        raise ValueError(f"config num_hidden_layers is {cfg.num_hidden_layers} "
                         f"but the weights hold {max(layers) + 1} layers")
    for name, shape in expected_shapes(cfg).items():
        if name not in state:
            raise ValueError(f"the weights lack tensor {name!r} that the config implies")
        if tuple(state[name].shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(state[name].shape)} but the config "
                             f"implies {shape} (check hidden_size, vocab_size, head counts, head_dim)")
    lm_head = state.get("lm_head.weight")
    if lm_head is not None and tuple(lm_head.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise ValueError(f"lm_head has shape {tuple(lm_head.shape)}, config implies "
                         f"{(cfg.vocab_size, cfg.hidden_size)}")
