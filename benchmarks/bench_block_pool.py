"""Block allocate/free throughput of the KV bookkeeping (pure Python, no model, no torch).

Three loops, best of ``--repeats`` (noise only slows a run down):

- ``BlockPool.allocate(1)`` + ``release`` of single blocks (the decode path: one page at a time);
- ``BlockPool.allocate(n)`` + ``release`` of ``n``-block runs (a prefill of ``n`` pages);
- ``KVCacheManager``: admit ``--requests`` requests of ``--prompt-tokens`` tokens (prefix
  caching on: hash lookups, allocation, publishing full blocks), grow each by
  ``--decode-tokens`` one token at a time, then free them all.

    python benchmarks/bench_block_pool.py            # a few seconds
    python benchmarks/bench_block_pool.py --json
"""

from __future__ import annotations

import argparse
import json
import time

from pagedkv.kv.block_pool import BlockPool
from pagedkv.kv.manager import KVCacheManager


class FakeRequest:
    """What ``KVCacheManager`` reads from a request (plain ints)."""

    def __init__(self, rid: str, tokens: list[int], max_tokens: int) -> None:
        self.request_id, self.all_token_ids, self.cache_salt = rid, tokens, None
        self.num_computed_tokens, self.num_prompt_tokens, self.max_tokens = 0, len(tokens), max_tokens


def best(fn, repeats: int) -> float:
    fn()
    return min(_timed(fn) for _ in range(repeats))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def single_blocks(pool: BlockPool, n: int) -> None:
    for _ in range(n):
        pool.release(pool.allocate(1))


def block_runs(pool: BlockPool, n: int, run: int) -> None:
    for _ in range(n):
        pool.release(pool.allocate(run))


def manager_lifecycle(num_blocks: int, block_size: int, requests: int, prompt: int, decode: int) -> int:
    """One admit -> decode -> free cycle; returns the number of manager calls made."""
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    reqs = [FakeRequest(f"r{i}", [1000 * i + t for t in range(prompt)], decode) for i in range(requests)]
    calls = 0
    for r in reqs:
        hit = kv.get_computed_blocks(r)
        assert kv.allocate_slots(r, prompt - hit.num_tokens, hit)
        r.num_computed_tokens = prompt
        kv.cache_full_blocks(r, prompt)
        calls += 3
    for step in range(decode):
        for r in reqs:
            r.all_token_ids.append(step)
            assert kv.allocate_slots(r, 1)
            r.num_computed_tokens += 1
            kv.cache_full_blocks(r, r.num_computed_tokens)
            calls += 2
    for r in reqs:
        kv.free(r.request_id)
        calls += 1
    return calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-blocks", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--ops", type=int, default=100_000, help="allocate+release pairs per pool loop")
    ap.add_argument("--run", type=int, default=32, help="blocks per allocation in the run loop")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    pool = BlockPool(a.num_blocks)
    t1 = best(lambda: single_blocks(pool, a.ops), a.repeats)
    t2 = best(lambda: block_runs(pool, a.ops // a.run, a.run), a.repeats)
    calls = manager_lifecycle(a.num_blocks, a.block_size, a.requests, a.prompt_tokens, a.decode_tokens)
    t3 = best(lambda: manager_lifecycle(a.num_blocks, a.block_size, a.requests, a.prompt_tokens, a.decode_tokens),
              a.repeats)
    blocks3 = a.requests * -(-(a.prompt_tokens + a.decode_tokens) // a.block_size)
    res = {
        "pool_single_block_alloc_free_per_s": a.ops / t1,
        "pool_run_blocks_alloc_free_per_s": (a.ops // a.run) * a.run / t2,
        "manager_calls_per_s": calls / t3,
        "manager_blocks_per_s": blocks3 / t3,
        "manager_cycle_s": t3,
        "manager_us_per_decode_token": 1e6 * t3 / (a.requests * a.decode_tokens),
        "settings": vars(a),
    }
    if a.json:
        print(json.dumps(res))
    else:
        print(f"BlockPool allocate(1)+release:     {res['pool_single_block_alloc_free_per_s'] / 1e6:.2f} M blocks/s")
        print(f"BlockPool allocate({a.run})+release:    {res['pool_run_blocks_alloc_free_per_s'] / 1e6:.2f} M blocks/s")
        print(f"KVCacheManager {a.requests} requests x ({a.prompt_tokens} prompt + {a.decode_tokens} decode): "
              f"{t3 * 1e3:.1f} ms per cycle, {res['manager_calls_per_s'] / 1e6:.2f} M calls/s, "
              f"{res['manager_us_per_decode_token']:.2f} us per decode token")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
