"""The one place where an engine is put together.

::

    EngineConfig ─▶ build_parts ─▶ model, tokenizer, KV spec, KV manager, KV cache   (engine.parts)
                 ─▶ build_connector ─▶ KVConnector (scheduler side, worker side) or None
                 ─▶ build_scheduler(config, KV manager, connector.scheduler, preemption)   (core)
                 ─▶ ModelRunner(model, KV cache, connector.worker, proposer, eviction)    (worker)
                 ─▶ EngineCore(scheduler, runner)

A connector is one of: a CPU/disk KV tier (``kv_offload_memory``:
:mod:`pagedkv.connectors.offload`), prefill/decode transfer (``kv_transfer_config``:
:mod:`pagedkv.connectors.pd`), or the caller's own (``LLMEngine(kv_connector=...)``); one
per engine. Under tensor parallelism the other ranks build their runner with
:func:`build_tp_worker_runner` (the executor starts them: :mod:`pagedkv.distributed`).
"""

from __future__ import annotations

import warnings

import torch

from pagedkv.config.engine import EngineConfig
from pagedkv.connectors.base import KVConnector
from pagedkv.connectors.offload.cpu_tier import cpu_offload_connector
from pagedkv.connectors.offload.streams import streams_for
from pagedkv.connectors.pd.factory import transfer_connector
from pagedkv.core.build import build_scheduler
from pagedkv.core.engine_core import EngineCore
from pagedkv.core.kv_eviction import eviction_policy
from pagedkv.core.preemption import PreemptionCost
from pagedkv.distributed.executor import TPExecutor
from pagedkv.distributed.group import TPGroup
from pagedkv.engine.parts import EngineParts, build_parts, check_fits_in_ram
from pagedkv.kernels.cpu.ops import copy_pages
from pagedkv.kv.groups import FullAttentionSpec
from pagedkv.worker.cuda_graphs import DecodeGraphs
from pagedkv.worker.device import float_path
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.worker.spec_decode.draft_model import DraftModelProposer
from pagedkv.worker.spec_decode.ngram import NgramProposer


def build_connector(config: EngineConfig, parts: EngineParts, given: KVConnector | None) -> KVConnector | None:
    """The engine's KV connector: prefill/decode transfer, the CPU (and disk) tier, or ``given``.

    Raises:
        ValueError: two connectors asked for at once, or one the parts cannot carry (see
            :func:`~pagedkv.connectors.pd.factory.transfer_connector`,
            :func:`~pagedkv.connectors.offload.cpu_tier.cpu_offload_connector`).
    """
    if config.kv_transfer_config is not None:
        return transfer_connector(config.kv_transfer_config, parts.kv_manager, parts.kv_cache, given)
    if not config.kv_offload_memory:
        return given
    if given is not None:
        raise ValueError("kv_offload_memory and a kv_connector cannot be combined (one connector per engine)")
    device = parts.kv_cache.k[0].device
    check_fits_in_ram((parts.kv_cache.nbytes if device.type == "cpu" else 0) + config.kv_offload_memory)
    streams = streams_for(device) if float_path(device, parts.model.dtype) else None
    return cpu_offload_connector(parts.kv_manager, parts.kv_cache, config.kv_offload_memory,
                                 config.kv_offload_policy, config.kv_offload_dir, config.kv_offload_disk_size,
                                 copy_pages, streams)


def model_preemption_cost(mode: str, model) -> PreemptionCost:
    """:class:`PreemptionCost` for a loaded :class:`~pagedkv.model.llama.LlamaModel`, its
    parameters counted from its tensors."""
    cfg = model.cfg
    mm = sum(t.numel() for layer in model.layers for t in (layer.qkv, layer.o, layer.gate_up, layer.down))
    return PreemptionCost(mode, mm, 2 * cfg.num_hidden_layers * cfg.num_attention_heads * 2 * cfg.head_dim)


def make_proposer(config: EngineConfig, parts: EngineParts):
    """The runner's speculative proposer (None: speculation off)."""
    speculative = config.speculative_config
    if speculative is None:
        return None
    if speculative.method == "draft_model":
        return DraftModelProposer(speculative, parts.draft.model, parts.kv_cache.draft_view(),
                                  parts.kv_spec.block_size)
    return NgramProposer(speculative)


def build_engine_core(config: EngineConfig, parts: EngineParts, connector: KVConnector | None,
                      tp: TPExecutor | None = None) -> EngineCore:
    """Scheduler and runner over ``parts``, joined by ``connector``'s two sides; with ``tp``,
    rank 0's runner inside the executor that sends every step to the other ranks."""
    scheduler = build_scheduler(config, parts.kv_manager, parts.max_model_len, parts.eos_token_ids,
                                connector.scheduler if connector else None,
                                model_preemption_cost(config.preemption_mode, parts.model))
    runner = ModelRunner(parts.model, parts.kv_cache, parts.kv_manager.kv_groups,
                         torch.Generator(parts.model.device).manual_seed(config.seed),
                         connector.worker if connector else None,
                         make_proposer(config, parts), eviction_policy(config), graphs=build_graphs(config, parts))
    if tp is not None:  # the other ranks run the same step; rank 0 samples
        runner = tp.attach(runner)
    return EngineCore(scheduler, runner, debug_invariants=config.debug_invariants)


def build_graphs(config: EngineConfig, parts: EngineParts) -> DecodeGraphs | None:
    """CUDA graphs of decode steps (:mod:`pagedkv.worker.cuda_graphs`) on a GPU, unless
    ``enforce_eager``; captured now, at engine start. None where they do not apply (the CPU,
    several KV groups, streaming sinks) or where capture fails (with a warning: steps then
    run eagerly)."""
    model = parts.model
    groups = parts.kv_manager.kv_groups
    if (model.device.type != "cuda" or config.enforce_eager or len(groups) != 1
            or not isinstance(groups[0].spec, FullAttentionSpec) or model.streaming_cache_len is not None):
        return None
    graphs = DecodeGraphs(model, parts.kv_cache, config.block_size, config.max_num_seqs, parts.max_model_len)
    try:
        graphs.capture_all()
    except Exception as e:  # noqa: BLE001 - eager steps are correct, only slower
        warnings.warn(f"pagedkv: CUDA graph capture failed ({type(e).__name__}: {str(e).splitlines()[0]}); "
                      "decode steps run eagerly (--enforce-eager silences this)", RuntimeWarning, stacklevel=2)
        return None
    return graphs


def build_tp_worker_runner(config: EngineConfig, group: TPGroup) -> ModelRunner:
    """A tensor-parallel rank >= 1's runner: its share of the model and pages; it runs the
    forward and answers with an empty output (rank 0 samples)."""
    parts = build_parts(config, group)
    return ModelRunner(parts.model, parts.kv_cache, parts.kv_manager.kv_groups, torch.Generator(), driver=False)


def start_tensor_parallel(config: EngineConfig) -> TPExecutor | None:
    """The tensor-parallel executor (ranks started, rank 0 returned), or None at size 1."""
    if config.tensor_parallel_size == 1:
        return None
    return TPExecutor.start(config, build_tp_worker_runner)
