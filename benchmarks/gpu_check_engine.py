"""The engine on a GPU, for ``gpu_check.py``: seeded random-weight Llama folders built on the
machine (HF ``save_pretrained`` plus a word-level tokenizer: the real weights do not travel),
the GPU engine's greedy tokens against the CPU engine's and HF transformers' on the same
weights, through CUDA graphs, prefix hits, chunked prefill and a small pool; bf16 against
fp32 teacher-forced. Speed is ``gpu_check_speed``.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
               rms_norm_eps=1e-5, tie_word_embeddings=True)
SMALL_GQA = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=32000, max_position_embeddings=4096, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
            tie_word_embeddings=True)


def build_model(folder: Path, shape: dict, dtype: torch.dtype, seed: int, device: str, std: float = 0.05,
                keep: bool = False):
    """A random ``LlamaForCausalLM`` of ``shape`` (HF config keys) in ``dtype``, made on
    ``device``, saved to ``folder`` with a word-level tokenizer (``t0`` .. ``t{vocab-1}``);
    weights ~ N(0, std). Returns the folder, or (folder, model) with ``keep``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    cfg = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in dtype: an 8B model never exists in fp32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, std)
    model.eval()
    model.save_pretrained(str(folder))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(shape["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t1", "eos_token": "t2", "unk_token": "t0"}))
    if keep:
        return folder, model
    del model
    free()
    return folder


def prompts(n: int, lengths, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist()}
            for i in range(n)]


def free() -> None:
    """Give back what dropped engines and models held (the caller deletes its names first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def llm(folder: Path, device: str, **kw):
    from pagedkv import LLM

    if device == "cpu":
        kw.setdefault("kv_cache_memory", "1GiB")
    return LLM(model=str(folder), device=device, **kw)


def hf_greedy(folder: Path, batch: list[dict], max_tokens: int, device: str):
    """HF's fp32 greedy tokens per prompt (one at a time, eager attention, no TF32) and the
    log-prob margin between its top two tokens at each step."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager")
    hf = hf.to(device).eval()
    out = []
    for p in batch:
        ids = torch.tensor([p["prompt_token_ids"]], device=device)
        with torch.no_grad():
            r = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                            min_new_tokens=max_tokens, do_sample=False, output_scores=True,
                            return_dict_in_generate=True, pad_token_id=0)
        top2 = [torch.log_softmax(s[0].float(), -1).topk(2).values for s in r.scores]
        out.append((r.sequences[0, ids.shape[1]:].tolist(), [float(t[0] - t[1]) for t in top2]))
    del hf
    free()
    return out


def agreement(ours: list[list[int]], ref, tie: float = 1e-4) -> dict:
    """Token agreement of ``ours`` with a reference (``ref``: tokens and, where known, the
    reference's top-two margins); a sequence that departs where those were within ``tie``
    log-prob is a near-tie, not a fault."""
    same = ties = total = agree = 0
    for mine, (theirs, margins) in zip(ours, ref):
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        same += first is None
        ties += first is not None and margins is not None and margins[first] < tie
        agree += len(mine) if first is None else first
        total += len(theirs)
    return {"sequences": len(ours), "identical": same, "near_ties": ties, "token_agreement": agree / max(1, total)}


def teacher_forced(folder: Path, device: str, sequences: list[list[int]], starts: list[int]) -> dict:
    """bf16 against fp32 on the fp32 engine's own greedy sequences: at each generated
    position, whether bf16's top token is fp32's, and the mean |log-prob difference| of the
    token there."""
    from pagedkv import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    batch = [{"prompt_token_ids": s} for s in sequences]
    outs = {}
    for dtype in ("float32", "bfloat16"):
        engine = llm(folder, device, dtype=dtype, gpu_memory_utilization=0.3, enforce_eager=True)
        outs[dtype] = engine.generate(batch, params)
        del engine
        free()
    agree = n = 0
    diff = 0.0
    for seq, start, a, b in zip(sequences, starts, outs["float32"], outs["bfloat16"]):
        for j in range(start, len(seq)):
            top = b.prompt_top_logprobs[j]
            agree += max(top, key=top.get) == seq[j]
            diff += abs(a.prompt_logprobs[j] - b.prompt_logprobs[j])
            n += 1
    return {"positions": n, "agreement": agree / max(1, n), "mean_abs_logprob_diff": diff / max(1, n)}


def check_model(work: Path, name: str, shape: dict, device: str, quick: bool, full: bool = True) -> dict:
    """One shape's checks: the GPU engine (fp32, eager and graphed) against the CPU engine
    and HF; a second round through the prefix cache; with ``full``, also a small pool with
    chunked prefill, bf16 against fp32 teacher-forced, and bf16 with fp8 pages against fp32."""
    from pagedkv import SamplingParams

    folder = build_model(work / name, shape, torch.float32, 0, device)
    batch = prompts(4 if quick else 8, [5, 17, 33] if quick else [5, 17, 64, 300, 1000], shape["vocab_size"], 1)
    n_out = 8 if quick else 48
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    res = {}
    ref = hf_greedy(folder, batch, n_out, device)
    try:  # the CPU engine on the machine's own cores (its C++ kernels build on first use)
        cpu = llm(folder, "cpu", kv_cache_memory="2GiB")
        cpu_tokens = [o.token_ids for o in cpu.generate(batch, params)]
        del cpu
        free()
    except Exception as e:  # noqa: BLE001 - recorded; HF stays the reference
        cpu_tokens, res["cpu_engine_error"] = None, f"{type(e).__name__}: {e}"
    eager = llm(folder, device, dtype="float32", enforce_eager=True, gpu_memory_utilization=0.3)
    eager_tokens = [o.token_ids for o in eager.generate(batch, params)]
    del eager
    free()
    res["fp32_eager_vs_hf"] = agreement(eager_tokens, ref)
    if cpu_tokens is not None:
        res["fp32_eager_vs_cpu_engine"] = agreement(eager_tokens, [(t, None) for t in cpu_tokens])
    graphed = llm(folder, device, dtype="float32", gpu_memory_utilization=0.3, max_num_seqs=16)
    graph_tokens = [o.token_ids for o in graphed.generate(batch, params)]
    res["fp32_graphs_vs_eager_identical"] = graph_tokens == eager_tokens
    graphs = graphed.engine.core.runner.graphs
    res["graph_replays"] = None if graphs is None else graphs.replays
    again = graphed.generate(batch, params)  # the prefix cache serves the prompts' full pages
    res["prefix_cache_hit_tokens"] = sum(o.num_cached_tokens for o in again)
    res["prefix_cache_same_tokens"] = [o.token_ids for o in again] == eager_tokens
    res["num_blocks"] = graphed.engine.kv_manager.pool.num_blocks
    res["memory_profile"] = repr(graphed.engine.parts.memory)
    del graphed, graphs, again
    free()
    if not full:
        return res
    small = llm(folder, device, dtype="float32", num_blocks=6 if quick else 80, max_num_batched_tokens=64,
                enable_prefix_caching=False, kv_cache_memory=None, max_num_seqs=16)
    outs = small.generate(batch, params)
    res["small_pool_chunked_same_tokens"] = [o.token_ids for o in outs] == eager_tokens
    res["preemptions"] = sum(o.num_preemptions for o in outs)
    del small, outs
    free()
    sequences = [p["prompt_token_ids"] + t for p, t in zip(batch, eager_tokens)]
    res["bf16_vs_fp32_teacher_forced"] = teacher_forced(folder, device, sequences,
                                                        [len(p["prompt_token_ids"]) for p in batch])
    fp8 = llm(folder, device, dtype="bfloat16", kv_cache_dtype="fp8_e4m3", gpu_memory_utilization=0.3, max_num_seqs=16)
    res["bf16_fp8_pages_vs_fp32"] = agreement([o.token_ids for o in fp8.generate(batch, params)],
                                              [(t, None) for t in eager_tokens])
    del fp8
    free()
    return res


def check_engine(work: Path, device: str, quick: bool) -> dict:
    if quick:
        return {"tiny": check_model(work, "tiny", TINY, device, quick)}
    return {"smollm2-shaped": check_model(work, "smollm2-shaped", SMOLLM2, device, quick),
            "small-gqa-llama": check_model(work, "small-gqa-llama", SMALL_GQA, device, quick, full=False)}
