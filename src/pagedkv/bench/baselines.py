"""Baselines run on the same prompts in the same process as pagedkv.

- ``hf``: HF transformers ``generate`` with static padded batches: the workload in order,
  ``batch_size`` requests at a time, left-padded, fp32, greedy, ``min_new_tokens`` =
  ``max_new_tokens`` = the batch's longest ``output_len`` (EOS ignored; a request's tokens
  past its own ``output_len`` are generated but not counted, as a static batch wastes them).
  Token times come from a ``StoppingCriteria`` that is called once per generated token.
- ``hf-cb``: HF's own continuous batching (``ContinuousBatchingManager``, transformers
  >= 5), the same model object, ``max_new_tokens`` per request, EOS disabled.
- ``llama-cpp``: llama.cpp (through llama-cpp-python's C API) on the model's GGUF file,
  batched as ``llama-batched-bench`` does: every request's sequence in one context, one
  ``llama_batch`` per step (:mod:`pagedkv.bench.llama_cpp_batched`). Optional: skipped when
  ``llama_cpp`` is not importable (``pip install ../shared/wheels/llama_cpp_python-*.whl``).
  The GGUF holds the quantized weights (Q4_1 for the default model), so it reads ~6x
  fewer weight bytes than the fp32 systems; compare it with that in mind.

Each returns ``(records, steps, duration_s, extra)``; ``steps`` (roofline work of the
schedule the baseline ran, useful tokens only) is ``None`` where it is unknown.
"""

from __future__ import annotations

import time

import torch

from pagedkv.bench.metrics import RequestRecord
from pagedkv.bench.workloads import BenchRequest
from pagedkv.planner.roofline import StepWork, causal_pairs


class BaselineUnavailable(RuntimeError):
    """The baseline cannot run here (missing package or API); the message says why."""


def load_hf_model(folder):
    """The HF ``AutoModelForCausalLM`` of a model folder, fp32, eval mode, SDPA attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _timestamp_criteria(stamps: list[float]):
    from transformers import StoppingCriteria

    class Stamp(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    return Stamp()


def run_hf_static(model, workload: list[BenchRequest], batch_size: int, pad_token_id: int,
                  on_batch=None) -> tuple[list[RequestRecord], list[StepWork], float, dict]:
    """Static padded batches through ``model.generate`` (offline: everyone arrives at t0)."""
    from transformers import StoppingCriteriaList

    records, steps = [], []
    t0 = time.perf_counter()
    for b in range(0, len(workload), batch_size):
        batch = workload[b:b + batch_size]
        width, new = max(r.num_prompt_tokens for r in batch), max(r.output_len for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(batch):                      # left padding
            ids[i, width - r.num_prompt_tokens:] = torch.tensor(r.prompt_token_ids)
            mask[i, width - r.num_prompt_tokens:] = 1
        stamps: list[float] = []
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                           pad_token_id=pad_token_id,
                           stopping_criteria=StoppingCriteriaList([_timestamp_criteria(stamps)]))
        for r in batch:
            records.append(RequestRecord(t0, r.num_prompt_tokens, stamps[:r.output_len]))
        steps += _static_steps(batch, new)
        if on_batch:
            on_batch(len(records), len(workload))
    return records, steps, time.perf_counter() - t0, {"hf_batch_size": batch_size}


def _static_steps(batch: list[BenchRequest], new: int) -> list[StepWork]:
    """Useful work of one static batch: a prefill of every prompt, then decode steps."""
    lens = [r.num_prompt_tokens for r in batch]
    steps = [StepWork(sum(lens), len(batch), sum(lens), sum(causal_pairs(0, p) for p in lens))]
    for t in range(1, new):
        live = [p + t for p, r in zip(lens, batch) if r.output_len > t]
        steps.append(StepWork(len(live), len(live), sum(live), sum(live)))
    return steps


def run_hf_continuous(model, workload: list[BenchRequest], max_batch_tokens: int,
                      on_done=None) -> tuple[list[RequestRecord], None, float, dict]:
    """HF's continuous batching manager (offline: all requests queued at once, after warm-up)."""
    try:
        from transformers import ContinuousBatchingConfig, GenerationConfig
    except ImportError as e:
        raise BaselineUnavailable(f"transformers has no continuous batching API here ({e})") from None
    if not hasattr(model, "continuous_batching_context_manager"):
        raise BaselineUnavailable("this transformers model class has no continuous batching API")
    page = 256
    num_pages = sum(-(-(r.num_prompt_tokens + r.max_tokens) // page) for r in workload) + 8
    cb = ContinuousBatchingConfig(page_size=page, num_blocks=num_pages, max_batch_tokens=max_batch_tokens,
                                  max_requests_per_batch=len(workload))
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in workload),
                           eos_token_id=-1, pad_token_id=0)
    results, ids = {}, []
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   block=True, timeout=10) as manager:
        t0 = time.perf_counter()
        for i, r in enumerate(workload):
            ids.append(manager.add_request(list(r.prompt_token_ids), request_id=f"req-{i}",
                                           max_new_tokens=r.output_len, record_timestamps=True))
        while len(results) < len(workload):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                if res.error:
                    raise RuntimeError(f"HF continuous batching failed: {res.error}")
                results[res.request_id] = res
                if on_done:
                    on_done(len(results), len(workload))
            elif res is None and not manager.is_running():
                raise RuntimeError("HF continuous batching stopped before finishing")
        duration = time.perf_counter() - t0
    records = [RequestRecord(t0, r.num_prompt_tokens, list(results[i].timestamps or [])[:r.output_len])
               for i, r in zip(ids, workload)]
    return records, None, duration, {"hf_cb_page_size": page, "hf_cb_num_pages": num_pages}


def run_llama_cpp(gguf_path, workload: list[BenchRequest], threads: int,
                  on_done=None) -> tuple[list[RequestRecord], None, float, dict]:
    """llama.cpp, batched (every request at once), greedy, EOS excluded."""
    try:
        import llama_cpp
    except ImportError:
        raise BaselineUnavailable("llama-cpp-python is not installed "
                                  "(pip install ../shared/wheels/llama_cpp_python-*.whl)") from None
    from pagedkv.bench.llama_cpp_batched import run_batched

    records, duration, _ = run_batched(llama_cpp, gguf_path, workload, threads, on_done)
    return records, None, duration, {"llama_cpp_version": getattr(llama_cpp, "__version__", "?"), "batched": True}
