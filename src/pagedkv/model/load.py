"""load_model: a checkpoint's decoder as the engine runs it (weight and activation dtypes,
numerics, streaming positions, a tensor-parallel share), every setting given to the model
at construction (:class:`~pagedkv.model.llama.ModelSettings`).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from pagedkv.config.engine import EngineConfig
from pagedkv.data import calibration_ids
from pagedkv.kernels.cpu.ops import attention_mode
from pagedkv.model.config import ModelConfig
from pagedkv.model.ggml_a8 import convert_model as convert_ggml_a8
from pagedkv.model.gguf_convert import read_blocks
from pagedkv.model.llama import LlamaModel, ModelSettings
from pagedkv.model.loader import ModelFiles, load_state_dict
from pagedkv.model.partition import Partition, local_config, shard_state
from pagedkv.model.validate import check_weights
from pagedkv.model.w8a8 import quantize_model as quantize_w8a8
from pagedkv.model.weight_formats import EMBED
from pagedkv.numerics import env_requests_invariance

#: tokens of the fixed calibration text (static KV scales, W8A8 smoothing): fewer only
#: where the model's own positions are fewer, never tied to a cache's size
CALIBRATION_TOKENS = 512


def engine_calibration_ids(tokenizer, cfg: ModelConfig) -> list[int]:
    """The calibration ids an engine uses for static KV scales (:mod:`pagedkv.worker.kv_scales`)
    and W8A8 smoothing: at most ``CALIBRATION_TOKENS``, fewer only if the model's own position
    limit is shorter (never the cache's, so every engine of a model gets the same scales)."""
    return calibration_ids(tokenizer, min(CALIBRATION_TOKENS, cfg.max_position_embeddings))


def load_model(config: EngineConfig, files: ModelFiles, tokenizer, part: Partition | None = None,
               all_reduce=None, device: str = "cpu", dtype: str = "float32") -> LlamaModel:
    """The decoder in ``files`` with the engine's weight and activation dtypes and numerics
    (``tokenizer`` makes the W8A8 calibration text); with ``part``, one tensor-parallel
    rank's share, its row-parallel outputs summed by ``all_reduce``. On a GPU or in a compute
    ``dtype`` other than float32 the weights are float, in ``dtype``, on ``device`` (a GGUF's
    blocks dequantized: :mod:`pagedkv.worker.device`)."""
    float_weights = device != "cpu" or dtype != "float32"
    blocks = (read_blocks(files.gguf_path, files.folder)
              if config.weight_dtype in ("auto", "int4") and files.gguf_path and not float_weights else {})
    kept = {k: v for k, v in blocks.items() if k != EMBED}  # used as stored: no fp32 copy is loaded
    state = load_state_dict(files.folder, skip=set(kept), dtype=getattr(torch, dtype) if float_weights
                            else torch.float32) | kept
    check_weights(files.config, state)
    model_cfg = files.config
    if part is not None:
        state, model_cfg = shard_state(state, model_cfg, part), local_config(model_cfg, part)
        blocks = {k: state.get(k, v) if k != EMBED else v for k, v in blocks.items()}  # the shares, as kept
    w8a8 = config.activation_dtype == "int8" and config.weight_dtype == "int8"
    settings = model_settings(config, all_reduce, w8a8)
    if float_weights:
        settings = replace(settings, weight_dtype="float32", device=device, dtype=dtype)
    model = LlamaModel(model_cfg, state, settings, quantized=blocks)
    if w8a8:  # calibrated on the fp32 model, then quantized (pagedkv.model.w8a8)
        quantize_w8a8(model, engine_calibration_ids(tokenizer, files.config))
    elif config.activation_dtype == "int8":  # GGML blocks times int8 activations (pagedkv.model.ggml_a8)
        convert_ggml_a8(model)
    return model


def model_settings(config: EngineConfig, all_reduce=None, w8a8: bool = False) -> ModelSettings:
    """The :class:`ModelSettings` of an engine config: its weight dtype (fp32 first for W8A8,
    quantized after its calibration), batch invariance (also ``PAGEDKV_BATCH_INVARIANT=1``),
    a tensor-parallel rank's ``all_reduce``, and streaming eviction's window, sinks and positions."""
    invariant = config.batch_invariant or env_requests_invariance()
    if invariant and attention_mode() == "reference":
        warnings.warn("pagedkv: batch-invariant mode with PAGEDKV_ATTENTION=reference: the reference "
                      "attention's products change shape with the chunk, so log-probs can differ in "
                      "the last bits with batching; the fused kernel is batch-invariant", RuntimeWarning)
    streaming = config.kv_eviction == "streaming"
    return ModelSettings(weight_dtype="float32" if w8a8 else config.weight_dtype, batch_invariant=invariant,
                         all_reduce=all_reduce, streaming_window=config.kv_window_tokens if streaming else 0,
                         streaming_sinks=config.num_sink_tokens if streaming else 0,
                         streaming_cache_positions=streaming and config.streaming_positions == "cache")
