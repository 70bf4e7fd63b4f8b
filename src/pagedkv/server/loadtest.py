"""A bounded load test against a running server, with the official ``openai`` client.

``clients`` coroutines share ``requests`` streaming requests (alternating completions and
chat), each with ``max_tokens`` and ``ignore_eos`` so every request costs the same. The
run stops by itself after ``timeout`` seconds. Figures: requests completed and failed,
output tokens per second (wall clock), TTFT (request sent -> first streamed token) and
end-to-end latency percentiles, in seconds.

    python -m pagedkv.server.loadtest --url http://127.0.0.1:8000 --clients 32 --requests 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one sentence.",
    "List three prime numbers.",
    "Once upon a time, in a small village,",
    "Give me a short tip for learning Python.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
]


@dataclass
class LoadResult:
    clients: int
    requests: int
    completed: int
    failed: int
    duration_s: float
    output_tokens: int
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    errors: list[str] = field(default_factory=list)


def percentile(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile (``p`` in [0, 100]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(-(-p * len(s) // 100)) - 1))
    return s[k]


async def _one(client, model: str, i: int, max_tokens: int, prompts: list[str]) -> tuple[float, float, int]:
    """One streaming request; returns (ttft, e2e, output tokens)."""
    prompt = prompts[i % len(prompts)]
    kw = dict(model=model, max_tokens=max_tokens, temperature=0.0, stream=True,
              stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    t0 = time.perf_counter()
    if i % 2:
        stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
    else:
        stream = await client.completions.create(prompt=prompt, **kw)
    ttft, tokens, finish = None, 0, None
    async for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for c in chunk.choices:
            text = c.delta.content if i % 2 else c.text
            if text and ttft is None:
                ttft = time.perf_counter() - t0
            finish = c.finish_reason or finish
    if finish not in ("stop", "length"):
        raise RuntimeError(f"request {i} ended with finish_reason {finish!r}")
    e2e = time.perf_counter() - t0
    return (ttft if ttft is not None else e2e), e2e, tokens


async def run_load(base_url: str, model: str, clients: int = 32, requests: int = 128, max_tokens: int = 16,
                   timeout: float = 30.0, api_key: str = "none", prompts: list[str] | None = None) -> LoadResult:
    """Run the load; never longer than ``timeout`` seconds (unfinished requests count as failed)."""
    import openai

    prompts = prompts or PROMPTS
    client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key, max_retries=0,
                                timeout=timeout)
    next_i = iter(range(requests))
    ttfts, e2es, errors = [], [], []
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        for i in next_i:
            try:
                ttft, e2e, n = await _one(client, model, i, max_tokens, prompts)
            except Exception as e:  # noqa: BLE001 - a failed request is a figure, not a crash
                errors.append(f"{type(e).__name__}: {e}")
                continue
            ttfts.append(ttft)
            e2es.append(e2e)
            tokens += n

    t0 = time.perf_counter()
    tasks = [asyncio.ensure_future(worker()) for _ in range(clients)]
    done, pending = await asyncio.wait(tasks, timeout=timeout)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    duration = time.perf_counter() - t0
    await client.close()
    completed = len(e2es)
    if pending:
        errors.append(f"timeout after {timeout:.0f} s")
    return LoadResult(clients, requests, completed, requests - completed, duration, tokens,
                      tokens / duration if duration else 0.0, percentile(ttfts, 50), percentile(ttfts, 99),
                      percentile(e2es, 50), percentile(e2es, 99), errors[:10])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedkv.server.loadtest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--api-key", default="none")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds; the run stops by itself")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    r = asyncio.run(run_load(a.url, a.model, a.clients, a.requests, a.max_tokens, a.timeout, a.api_key))
    if a.json:
        print(json.dumps(asdict(r)))
    else:
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        print(f"{r.completed}/{r.requests} requests completed ({r.failed} failed) in {r.duration_s:.1f} s "
              f"with {r.clients} clients; {r.output_tokens} output tokens = {r.output_tokens_per_s:.1f} tokens/s; "
              f"TTFT p50 {fmt(r.ttft_p50_s)} s, p99 {fmt(r.ttft_p99_s)} s; e2e p50 {fmt(r.e2e_p50_s)} s, "
              f"p99 {fmt(r.e2e_p99_s)} s")
        for e in r.errors:
            print(f"  error: {e}", file=sys.stderr)
    return 0 if r.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
