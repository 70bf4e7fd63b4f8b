#!/usr/bin/env bash
# Reproduce the runs behind BENCHMARKS.md (CPU, smollm2-135m-instruct, fp32).
#
#   benchmarks/run_benchmarks.sh [OUT_DIR] [STEP...]     # default OUT_DIR benchmarks/results
#   benchmarks/run_benchmarks.sh benchmarks/results throughput capacity
#
# Steps: throughput hf16 capacity prefix latency online micro (default: all, in that order;
# roughly 2 hours on a shared 2-core machine, most of it the throughput step).
# `python -m pagedkv.bench` is the same command as `pagedkv bench`; PYTHON overrides the
# interpreter (default .venv/bin/python when present).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
shift || true
STEPS=${*:-throughput hf16 capacity prefix latency online micro}
mkdir -p "$OUT"
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python)}
BENCH="$PY -m pagedkv.bench"
log() { echo "[$(date +%H:%M:%S)] $*" >&2; }

for step in $STEPS; do
  log "$step (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
  case $step in
    throughput)   # issue 6 goal 1: 64 arena-hard prompts, <= 512 prompt tokens, 128 output tokens, ignore_eos
      $BENCH throughput --num-prompts 64 --max-prompt-tokens 512 --max-tokens 128 \
        --systems pagedkv,contiguous,hf,hf-cb,llama-cpp --hf-batch-size 64 --repeats 3 \
        --output "$OUT/throughput.json" --plot "$OUT/throughput.png" --no-progress > "$OUT/throughput.txt" ;;
    hf16)         # the same workload, HF static batches of 16 (one run)
      $BENCH throughput --num-prompts 64 --max-prompt-tokens 512 --max-tokens 128 \
        --systems pagedkv,hf --hf-batch-size 16 --repeats 1 \
        --output "$OUT/throughput_hf16.json" --no-progress > "$OUT/throughput_hf16.txt" ;;
    capacity)     # issue 6 goal 2: fixed 128 MiB KV budget, hh-rlhf length distribution
      $BENCH capacity --kv-cache-memory 128MiB --num-prompts 64 --max-prompt-tokens 512 --max-tokens 256 \
        --repeats 3 --output "$OUT/capacity.json" --plot "$OUT/capacity.png" --no-progress > "$OUT/capacity.txt" ;;
    prefix)       # issue 4: shared 1,024-token system prompt, caching on vs off; multi-turn replay
      $BENCH prefix --num-prompts 32 --prefix-tokens 1024 --question-tokens 64 --max-tokens 16 \
        --replay-conversations 16 --replay-turns 4 --replay-max-tokens 32 --repeats 3 \
        --output "$OUT/prefix.json" --no-progress > "$OUT/prefix.txt" ;;
    latency)      # issue 6 goal 4: single-stream decode vs the weight-read bound
      $BENCH latency --num-prompts 3 --max-tokens 64 --systems pagedkv,hf --repeats 3 \
        --output "$OUT/latency.json" --no-progress > "$OUT/latency.txt" ;;
    online)       # Poisson arrivals
      $BENCH online --num-prompts 32 --max-tokens 64 --request-rate 0.5 --systems pagedkv,contiguous \
        --output "$OUT/online.json" --plot "$OUT/online.png" --no-progress > "$OUT/online.txt" ;;
    micro)        # issue 6 goal 5 and the micro-benchmarks
      $PY benchmarks/bench_block_pool.py > "$OUT/micro_block_pool.txt"
      $PY benchmarks/bench_scheduler.py > "$OUT/micro_scheduler.txt"
      $PY benchmarks/bench_step_overhead.py --batch 64 --steps 16 > "$OUT/micro_step_overhead.txt" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
log "done"
