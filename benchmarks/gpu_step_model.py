"""A Llama-shaped decoder in plain torch with random weights, for timing steps on a GPU.

Used by ``gpu_step_profile.py``; torch only (no pagedkv import), so it runs on a bare GPU
machine. Shapes come from a planner catalog file's ``config`` (HF ``config.json`` keys).
Weights are ``[out, in]`` as ``torch.nn.Linear`` keeps them (QKV fused, gate and up fused),
RMSNorm without a weight, rotate-half RoPE; no biases (Qwen2's QKV biases are left out).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

FAST_ATTENTION = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
DENSE_LLAMA_LIKE = ("llama", "mistral", "qwen2", "phi3")  # model_type values this decoder stands in for
REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")


def load_shape(path: Path, tp: int = 1) -> dict:
    """The decoder's sizes from a planner catalog model file; at ``tp`` > 1, one rank's
    Megatron shard (heads, KV heads, FFN columns and vocabulary split ``tp`` ways; the
    all-reduces are not run)."""
    c = json.loads(Path(path).read_text()).get("config")
    if not isinstance(c, dict):
        raise ValueError(f"{path}: no \"config\" object (a planner catalog file holds one)")
    kind, moe = c.get("model_type"), [k for k in ("num_local_experts", "n_routed_experts", "num_experts",
                                                  "kv_lora_rank") if c.get(k)]
    if kind not in DENSE_LLAMA_LIKE or moe:
        raise ValueError(f"{path}: model_type {kind!r}{' with ' + ', '.join(moe) if moe else ''}: this stand-in "
                         f"is a dense Llama-style decoder ({', '.join(DENSE_LLAMA_LIKE)}; no MoE, no MLA)")
    bad = [k for k in REQUIRED if not (isinstance(c.get(k), int) and c[k] > 0)]
    if bad:
        raise ValueError(f"{path}: missing or not a positive integer: {', '.join(bad)}")
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    if heads % kv_heads or head_dim % 2 or head_dim < 2:
        raise ValueError(f"{path}: {heads} heads in groups of {kv_heads} KV heads with head_dim {head_dim}")
    if not (isinstance(tp, int) and tp >= 1) or heads % tp or kv_heads % tp or c["intermediate_size"] % tp:
        raise ValueError(f"tp {tp} does not split {path}'s heads, KV heads and FFN evenly")
    return {"layers": c["num_hidden_layers"], "hidden": c["hidden_size"], "heads": heads // tp,
            "kv_heads": kv_heads // tp, "head_dim": head_dim,
            "ffn": c["intermediate_size"] // tp, "vocab": -(-c["vocab_size"] // tp), "tp": tp,
            "rope_theta": float(c.get("rope_theta", 10000.0)), "eps": float(c.get("rms_norm_eps", 1e-5))}


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [rows, heads, head_dim]`` by ``cos, sin [rows, 1, head_dim / 2]``."""
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class Decoder:
    """Random-weight decoder with a KV pool of ``pool_bytes``; steps are closures over
    static tensors (so they can be captured in a CUDA graph)."""

    def __init__(self, shape: dict, dtype: torch.dtype, device: torch.device, pool_bytes: int):
        self.s, self.dtype, self.device = shape, dtype, device
        L, d, H, K, hd, f = (shape[k] for k in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn"))
        self.layers = [(self._w((H + 2 * K) * hd, d), self._w(d, H * hd), self._w(2 * f, d), self._w(d, f))
                       for _ in range(L)]
        self.head = self._w(shape["vocab"], d)
        per_token = L * 2 * K * hd * torch.finfo(dtype).bits // 8
        self.pool_tokens = pool_bytes // per_token
        self.kv = torch.zeros(L, 2, self.pool_tokens, K, hd, device=device, dtype=dtype)
        self.inv_freq = shape["rope_theta"] ** (-torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd)
        self.attention_kernels = FAST_ATTENTION if device.type == "cuda" else [SDPBackend.MATH]
        self.expand_kv = False  # prefill: repeat KV heads instead of enable_gqa (where no fast kernel takes it)

    def _w(self, out_features: int, in_features: int) -> torch.Tensor:
        return torch.randn(out_features, in_features, device=self.device, dtype=self.dtype).mul_(in_features ** -0.5)

    def fits(self, batch: int, tokens: int) -> bool:
        return batch * tokens <= self.pool_tokens

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        return angles.cos().to(self.dtype)[:, None, :], angles.sin().to(self.dtype)[:, None, :]

    def _layers(self, h: torch.Tensor, attend) -> torch.Tensor:
        s = self.s
        H, K, hd, d, eps = s["heads"], s["kv_heads"], s["head_dim"], s["hidden"], s["eps"]
        for layer, (w_qkv, w_o, w_gu, w_down) in enumerate(self.layers):
            q, k, v = F.linear(F.rms_norm(h, (d,), eps=eps), w_qkv).split([H * hd, K * hd, K * hd], -1)
            o = attend(layer, q.reshape(-1, H, hd), k.reshape(-1, K, hd), v.reshape(-1, K, hd))
            h = h + F.linear(o, w_o)
            g, u = F.linear(F.rms_norm(h, (d,), eps=eps), w_gu).chunk(2, -1)
            h = h + F.linear(F.silu(g) * u, w_down)
        return h

    def _sample(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        logits = F.linear(F.rms_norm(rows, (self.s["hidden"],), eps=self.s["eps"]), self.head)
        out.copy_(logits.argmax(-1))

    def decode_step(self, batch: int, context: int):
        """One decode step of ``batch`` sequences with ``context`` cached tokens each."""
        H, K, hd = self.s["heads"], self.s["kv_heads"], self.s["head_dim"]
        n = context + 1
        x = torch.randn(batch, self.s["hidden"], device=self.device, dtype=self.dtype)
        cos, sin = self._rope_tables(torch.full((batch,), context, device=self.device))
        cache = self.kv[:, :, :batch * n].view(self.s["layers"], 2, batch, n, K, hd)
        out = torch.empty(batch, dtype=torch.long, device=self.device)

        def attend(layer, q, k, v):
            kc, vc = cache[layer, 0], cache[layer, 1]
            kc[:, context], vc[:, context] = rope(k, cos, sin), v
            q = rope(q, cos, sin).view(batch, K, H // K, hd)  # a KV head's query heads as its query rows
            with sdpa_kernel(self.attention_kernels):
                o = F.scaled_dot_product_attention(q, kc.transpose(1, 2), vc.transpose(1, 2))
            return o.reshape(batch, H * hd)

        return lambda: self._sample(self._layers(x, attend), out)

    def prefill_step(self, batch: int, tokens: int):
        """One prefill step of ``batch`` prompts of ``tokens`` each (causal, from position 0)."""
        H, K, hd = self.s["heads"], self.s["kv_heads"], self.s["head_dim"]
        x = torch.randn(batch * tokens, self.s["hidden"], device=self.device, dtype=self.dtype)
        cos, sin = self._rope_tables(torch.arange(tokens, device=self.device).repeat(batch))
        cache = self.kv[:, :, :batch * tokens].view(self.s["layers"], 2, batch, tokens, K, hd)
        out = torch.empty(batch, dtype=torch.long, device=self.device)

        def attend(layer, q, k, v):
            kc, vc = cache[layer, 0], cache[layer, 1]
            kc.copy_(rope(k, cos, sin).view(batch, tokens, K, hd))
            vc.copy_(v.view(batch, tokens, K, hd))
            q = rope(q, cos, sin).view(batch, tokens, H, hd).transpose(1, 2)
            kt, vt = kc.transpose(1, 2), vc.transpose(1, 2)
            if self.expand_kv and K != H:
                kt, vt = kt.repeat_interleave(H // K, 1), vt.repeat_interleave(H // K, 1)
            with sdpa_kernel(self.attention_kernels):
                o = F.scaled_dot_product_attention(q, kt, vt, is_causal=True,
                                                   enable_gqa=K != H and not self.expand_kv)
            return o.transpose(1, 2).reshape(batch * tokens, H * hd)

        def step():
            h = self._layers(x, attend)
            self._sample(h.view(batch, tokens, -1)[:, -1], out)
        return step
