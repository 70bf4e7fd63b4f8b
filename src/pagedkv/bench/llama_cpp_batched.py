"""llama.cpp as a batched baseline, the way ``llama-batched-bench`` drives it.

llama-cpp-python's ``Llama`` class runs one sequence at a time; batching takes the C API it
wraps: one context with ``n_seq_max`` sequences (one KV stream each, ``n_ctx`` split between
them), and per step one ``llama_batch`` holding every unfinished sequence's next token, or
prompt tokens in chunks of ``n_batch`` during prefill (logits only for each prompt's last
token). Sampling is greedy over the logits with EOS excluded, so every request makes its
``output_len`` tokens, as the engine's benchmark runs do. At most ``MAX_SEQS`` sequences run
together (llama.cpp's limit); a larger workload runs in waves of that size.
"""

from __future__ import annotations

import ctypes
import time

from pagedkv.bench.metrics import RequestRecord
from pagedkv.bench.workloads import BenchRequest

MAX_SEQS = 256  # LLAMA_MAX_SEQ
CHUNK = 512     # tokens per llama_batch (n_batch = n_ubatch)
_quiet = None   # the log callback, kept alive


def _silence(llama_cpp) -> None:
    global _quiet
    if _quiet is None:
        _quiet = llama_cpp.llama_log_callback(lambda level, text, user_data: None)
        llama_cpp.llama_log_set(_quiet, ctypes.c_void_p(0))


def run_batched(llama_cpp, gguf_path, workload: list[BenchRequest], threads: int,
                on_done=None) -> tuple[list[RequestRecord], float, list[list[int]]]:
    """Greedy decoding of every request of ``workload``, batched; ``(records, seconds,
    output token ids per request)``."""
    _silence(llama_cpp)
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(gguf_path).encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf_path}")
    records: list[RequestRecord] = []
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    try:
        for start in range(0, len(workload), MAX_SEQS):
            recs, outs = _wave(llama_cpp, model, workload[start:start + MAX_SEQS], threads, t0)
            records += recs
            outputs += outs
            if on_done:
                on_done(min(start + MAX_SEQS, len(workload)), len(workload))
    finally:
        llama_cpp.llama_model_free(model)
    return records, time.perf_counter() - t0, outputs


def _wave(llama_cpp, model, wave: list[BenchRequest], threads: int,
          t0: float) -> tuple[list[RequestRecord], list[list[int]]]:
    import numpy as np

    n = len(wave)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx = n * max(r.num_prompt_tokens + r.output_len + 1 for r in wave)
    cp.n_batch = cp.n_ubatch = CHUNK
    cp.n_seq_max, cp.n_threads, cp.n_threads_batch = n, threads, threads
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab, eos = llama_cpp.llama_vocab_n_tokens(vocab), llama_cpp.llama_vocab_eos(vocab)
    batch = llama_cpp.llama_batch_init(CHUNK, 0, 1)

    def decode(items: list[tuple[int, int, int, bool]]) -> list[tuple[int, int]]:
        """``(token, position, sequence, wants logits)`` items -> ``(sequence, greedy token)``."""
        picked = []
        for s in range(0, len(items), CHUNK):
            part = items[s:s + CHUNK]
            batch.n_tokens = len(part)
            for i, (tok, pos, seq, want) in enumerate(part):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                batch.seq_id[i][0], batch.logits[i] = seq, want
            if llama_cpp.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            for i, (_, _, seq, want) in enumerate(part):
                if want:
                    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
                    logits[eos] = -np.inf
                    picked.append((seq, int(logits.argmax())))
        return picked

    try:
        stamps: list[list[float]] = [[] for _ in wave]
        outputs: list[list[int]] = [[] for _ in wave]
        lengths = [r.num_prompt_tokens for r in wave]
        nxt: dict[int, int] = {}
        prompt_items = [(t, j, s, j == r.num_prompt_tokens - 1)
                        for s, r in enumerate(wave) for j, t in enumerate(r.prompt_token_ids)]
        for seq, tok in decode(prompt_items):
            nxt[seq] = tok
            stamps[seq].append(time.perf_counter())
            outputs[seq].append(tok)
        while True:
            live = [s for s, r in enumerate(wave) if len(stamps[s]) < r.output_len]
            if not live:
                break
            items = [(nxt[s], lengths[s], s, True) for s in live]
            for s in live:
                lengths[s] += 1
            for seq, tok in decode(items):
                nxt[seq] = tok
                stamps[seq].append(time.perf_counter())
                outputs[seq].append(tok)
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
    records = [RequestRecord(t0, r.num_prompt_tokens, stamps[s][:r.output_len]) for s, r in enumerate(wave)]
    return records, [out[:r.output_len] for out, r in zip(outputs, wave)]
