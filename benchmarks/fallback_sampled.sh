#!/usr/bin/env bash
# The automatic fallback under a load it should fall back on: the embedded pair's sampled answers (temperature 1)
# at 8 concurrent requests, where drafting breaks even at a longer acceptance than it reaches on a CPU. The
# default server (auto fallback) against the target alone, each loaded for DURATION seconds; then how often the
# verdict changed (each change moves every decoding row to the other decoder, at a target read each).
# Usage: benchmarks/fallback_sampled.sh [OUT_DIR] [DURATION]    (run on a quiet machine)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/fallback_sampled}
duration=${2:-120}
mkdir -p "$out"
wait_up() { for _ in $(seq 120); do curl -sf "http://127.0.0.1:$1/health" > /dev/null && return; sleep 1; done; }
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
# one at a time: the adaptive server times its decode steps at start-up and needs the CPU to itself
dflash serve --port 8110 > "$out/serve_default.log" 2>&1 & pids+=($!); wait_up 8110
dflash serve --port 8111 --no-draft > "$out/serve_plain.log" 2>&1 & pids+=($!); wait_up 8111
dflash bench --base-url http://127.0.0.1:8110/v1 --baseline-url http://127.0.0.1:8111/v1 --dataset gsm8k \
    --concurrency 8 --duration "$duration" --temperature 1.0 --max-new-tokens 256 --output-dir "$out/bench" \
    --no-progress
curl -sf http://127.0.0.1:8110/metrics | grep -E '^dflash:(decoder_moves_total|fallback_)' > "$out/fallback_metrics.txt"
{
    echo "verdicts: $(grep -c 'new requests decode without the drafter' "$out/serve_default.log") times off," \
         "$(grep -c '; drafting again' "$out/serve_default.log") times back on"
    cat "$out/fallback_metrics.txt"
} | tee "$out/fallback_summary.txt"
