#!/usr/bin/env bash
# The figures reported in the README for the embedded pair, on this machine (run on a quiet machine).
# Usage: benchmarks/embedded_pair.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/report}
mkdir -p "$out"

# 1. where a decode step's time goes
python benchmarks/engine_overhead.py --threads 2 > "$out/engine_overhead.json"
# decode-step times of a batch: plain and drafted steps at 1 and 8 rows (block sizes 2..16)
python benchmarks/batched_step.py --rows 1,8 --context 400 > "$out/batched_step.jsonl"
# why the server decodes on its main thread: the same decode there and on a second thread
python benchmarks/decode_thread.py > "$out/decode_thread.json"

# 2. local bench: DFlash vs plain decoding, greedy, B = 8 and 16, on the five datasets
dflash bench --dataset all --max-samples 20 --max-new-tokens 256 --block-size auto,8,16 \
    --output-dir "$out/bench" --no-progress
# the block-size sweep on gsm8k (8 and 16 above)
dflash bench --dataset gsm8k --max-samples 20 --max-new-tokens 256 --block-size 2,4 \
    --output-dir "$out/bench_sweep" --no-progress
# acceptance on training questions (a large gap to the test figure would mean overfitting)
dflash bench --dataset gsm8k --data-file scripts/embedded/data/gsm8k_train.jsonl --max-samples 20 \
    --max-new-tokens 256 --output-dir "$out/bench_train" --no-progress

# 3. the server under load: DFlash (adaptive block size, the default), DFlash with the full block every
#    step, and the target alone; the bench client is on the same CPU. Each level runs in rounds, the DFlash
#    and plain servers taking turns to go first, and the speedup is the median of the rounds' (other tenants'
#    load comes and goes on this machine); the defaults, the headline figure, get 5 rounds
wait_up() { for _ in $(seq 120); do curl -sf "http://127.0.0.1:$1/health" > /dev/null && return; sleep 1; done; }
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
# one at a time: the adaptive server times its decode steps at start-up and needs the CPU to itself
dflash serve --port 8100 --fallback-min-acceptance 0 > "$out/serve_dflash.log" 2>&1 & pids+=($!); wait_up 8100
dflash serve --port 8101 --no-draft > "$out/serve_plain.log" 2>&1 & pids+=($!); wait_up 8101
dflash serve --port 8102 --fallback-min-acceptance 0 --no-adaptive-block-size > "$out/serve_fixed.log" 2>&1 &
pids+=($!); wait_up 8102
dflash serve --port 8103 > "$out/serve_default.log" 2>&1 & pids+=($!); wait_up 8103  # all defaults (auto fallback)
dflash bench --base-url http://127.0.0.1:8100/v1 --baseline-url http://127.0.0.1:8101/v1 --dataset gsm8k \
    --concurrency 1,4,8 --num-prompts 16 --max-new-tokens 256 --rounds 3 --output-dir "$out/serve" --no-progress
dflash bench --base-url http://127.0.0.1:8102/v1 --baseline-url http://127.0.0.1:8101/v1 --dataset gsm8k \
    --concurrency 1,4,8 --num-prompts 16 --max-new-tokens 256 --rounds 3 --output-dir "$out/serve_fixed" \
    --no-progress
dflash bench --base-url http://127.0.0.1:8103/v1 --baseline-url http://127.0.0.1:8101/v1 --dataset gsm8k \
    --concurrency 1,4,8 --num-prompts 16 --max-new-tokens 256 --rounds 5 --output-dir "$out/serve_default" \
    --no-progress
