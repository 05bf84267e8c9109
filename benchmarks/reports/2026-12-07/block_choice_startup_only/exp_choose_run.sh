#!/bin/bash
out=/tmp/exp_choose_out; rm -rf $out; mkdir -p $out
export PATH=/work/venv/bin:$PATH
wait_up() { for _ in $(seq 120); do curl -sf "http://127.0.0.1:$1/health" > /dev/null && return; sleep 1; done; }
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
cd /tmp
PYTHONPATH=/work/main dflash serve --port 8120 > $out/serve_a.log 2>&1 & pids+=($!); wait_up 8120
PYTHONPATH=/work/main dflash serve --port 8121 --no-draft > $out/serve_plain.log 2>&1 & pids+=($!); wait_up 8121
PYTHONPATH=/tmp/exp_choose dflash serve --port 8122 > $out/serve_b.log 2>&1 & pids+=($!); wait_up 8122
for i in 1 2; do
  for v in a:8120 b:8122; do
    name=${v%%:*}; port=${v##*:}
    PYTHONPATH=/work/main dflash bench --base-url http://127.0.0.1:$port/v1 --baseline-url http://127.0.0.1:8121/v1 \
      --dataset gsm8k --concurrency 4,8 --num-prompts 16 --max-new-tokens 256 --rounds 3 \
      --output-dir $out/${name}_$i --no-progress > $out/${name}_$i.txt 2>&1
  done
done
echo done > $out/done
