"""The planner: KV-cache memory and bandwidth arithmetic for any model and accelerator.

``plan(model=..., gpu=..., ...) -> PlanResult`` answers: bytes per token of the
cache, how many requests of what length fit next to the weights, and the lower
bounds of a decode and a prefill step. Its KV figures come from the engine's own
:class:`pagedkv.kv.spec.KVCacheSpec`. The CLI is ``pagedkv plan`` (see
:mod:`pagedkv.planner.cli`).

Modules: ``models`` (bundled names or a config.json -> the engine's
:class:`~pagedkv.model.config.ModelConfig`, through its one parser), ``params`` (parameter
counts), ``hardware``/``cpu`` (device catalog, measured CPU), ``roofline`` (step
bounds), ``plan``/``result``/``notes`` (the answer), ``report``/``plots``/``sweep``
(text, PNG, models x GPUs table).
"""

from pagedkv.model.config import ModelConfig
from pagedkv.planner.hardware import Device, get_device
from pagedkv.planner.models import bundled_names, load_model
from pagedkv.planner.plan import plan
from pagedkv.planner.result import PlanResult, SweepRow
from pagedkv.planner.roofline import StepBound

__all__ = ["plan", "PlanResult", "SweepRow", "StepBound", "ModelConfig", "Device",
           "load_model", "get_device", "bundled_names"]
