#!/usr/bin/env bash
# What a lent GPU machine is used for, in one call (this project gets 15 minutes of device time a session):
#   1. the CUDA losslessness tests (tests/decoding/test_cuda.py);
#   2. `dflash bench` on the GPU: the embedded pair on gsm8k, float32 at block sizes 16 and auto, then bfloat16 at 16
#      (speedup over plain decoding on the same GPU, tau, mismatches);
#   3. a round of the embedded drafter (CONFIG, default scripts/embedded/drafter_round27.yaml), started from the
#      config's init_from, which must be on the machine: 30 steps are timed first, then it trains for as many steps as the time left allows,
#      and is evaluated and exported (a run stopped at the deadline saves a checkpoint, which is then evaluated and
#      exported as it is); the result is copied to OUT_DIR/drafter.
# Usage, at the repository root of the GPU machine: bash benchmarks/gpu_check.sh OUT_DIR SECONDS
#   runs/gpu/answers.tgz must hold the config's answer sets (a tar archive, any compression, of those files in
#   runs/embedded; scripts/embedded/pack_answers.py keeps only the token ids: ten sets in 2.9 MB).
#   Every stage has a deadline, and a failed stage does not stop the next one.
#   SKIP_TESTS=1, SKIP_BENCH=1 and SKIP_TRAIN=1 leave out stages 1, 2 and 3; PER_STEP=SECONDS skips the timing of
#   30 steps; DRAFT=DIR benches that drafter (default: the one this tree ships) with TARGET=DIR (default: the
#   embedded target).
#   DEVICE=cpu SAMPLES=2 PROBE=2 runs the same plumbing on a CPU (the tests then skip), where `python3` has the
#   package's requirements.
set -uo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR SECONDS}
budget=${2:?usage: gpu_check.sh OUT_DIR SECONDS}
device=${DEVICE:-cuda}
samples=${SAMPLES:-20}
probe=${PROBE:-30}  # steps timed before the run is sized
start=$(date +%s)
deadline=$((start + budget))
left() { echo $((deadline - $(date +%s))); }
log() { echo "[gpu_check +$(($(date +%s) - start))s, $(left)s left] $*"; }
if ! command -v dflash > /dev/null; then  # the package is not installed there: a `dflash` on PATH runs it from here
    mkdir -p /tmp/dflash-bin && printf '#!/bin/sh\nexec python3 -m dflash.cli.main "$@"\n' > /tmp/dflash-bin/dflash
    chmod +x /tmp/dflash-bin/dflash && export PATH=/tmp/dflash-bin:$PATH
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"

log "the machine"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>/dev/null
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'gpu', torch.cuda.is_available() and torch.cuda.get_device_name())"

log "1. losslessness on the GPU"
[ -n "${SKIP_TESTS:-}" ] || timeout 100 python3 -m pytest -q -p no:cacheprovider tests/decoding/test_cuda.py

log "2. dflash bench on the GPU"
if [ -z "${SKIP_BENCH:-}" ]; then
    draft=${DRAFT:-dflash/assets/drafter}
    target=${TARGET:-dflash/assets/target}  # a --draft goes with the --target it was trained for
    timeout 110 dflash bench --device "$device" --target "$target" --draft "$draft" --dtype float32 --dataset gsm8k --max-samples "$samples" \
        --max-new-tokens 256 --block-size 16,auto --output-dir "$out/bench" --no-progress
    timeout 50 dflash bench --device "$device" --target "$target" --draft "$draft" --dtype bfloat16 --dataset gsm8k --max-samples "$samples" \
        --max-new-tokens 256 --block-size 16 --output-dir "$out/bench_bf16" --no-progress
fi
rm -f "$out"/bench*/*.png "$out"/bench*/config.json "$out"/bench_bf16/results.md  # a call brings back 8 files

[ -z "${SKIP_TRAIN:-}" ] || { log "done"; exit 0; }
config=${CONFIG:-scripts/embedded/drafter_round27.yaml}
log "3. training the embedded drafter: $config"
read -r run init < <(python3 -c "import yaml; c = yaml.safe_load(open('$config')); print(c['output'], c['init_from'])")
mkdir -p runs/embedded
# Python's tarfile reads any compression; tar needs the xz binary for pack_answers.py's archive
python3 -c "import tarfile; tarfile.open('runs/gpu/answers.tgz').extractall('runs/embedded')" \
    || { log "cannot unpack runs/gpu/answers.tgz: carry it (scripts/embedded/pack_answers.py makes it)"; exit 1; }
[ -e "$init" ] || { log "init_from $init is not on this machine: carry it, or start from dflash/assets/drafter"; exit 1; }
if [ -z "${PER_STEP:-}" ]; then
    timeout 100 dflash train --config "$config" --device "$device" --max-steps "$probe" --output /tmp/probe \
        --eval-decoding-examples 0 --checkpoint-every 0 --overwrite > /tmp/probe.log 2>&1 || tail -20 /tmp/probe.log
    PER_STEP=$(python3 -c "import json; d=[json.loads(l) for l in open('/tmp/probe/train_log.jsonl')]; \
print([r['train_time_s'] / r['step'] for r in d if r.get('event') == 'done'][0])" 2> /dev/null) || {
        log "the timing probe did not finish (its log: /tmp/probe.log): pass PER_STEP=SECONDS, or a lower PROBE"; exit 1; }
    log "$probe steps took ${PER_STEP}s each"
fi
# loading, two held-out evaluations (64 replays each: the timing probe ran none) and the export, with room to spare
setup=90
export_s=65  # kept back from the training's deadline: a run stopped there is exported by a --resume within it
[ "$(left)" -gt $((setup + export_s)) ] || { log "too little time left to train: pass PER_STEP, or a larger budget"; exit 1; }
steps=$(python3 -c "print(max(20, int(($(left) - $setup - $export_s) / $PER_STEP) // 20 * 20))")
log "training $steps steps"
timeout $(($(left) - export_s)) dflash train --config "$config" --device "$device" --max-steps "$steps" \
    --eval-every $((steps / 2)) --overwrite 2>&1 | grep -v '^{"step"' | tail -30
if [ ! -f $run/model.safetensors ] && ls -d $run/checkpoints/step-* > /dev/null 2>&1; then
    last=$(ls -d $run/checkpoints/step-* | tail -1)
    log "stopped at the deadline: exporting $last"
    # within the budget: past it the machine's limit kills the call before the drafter is copied into OUT_DIR
    timeout $(($(left) - 5)) dflash train --config "$config" --device "$device" --resume \
        --max-steps "$((10#${last##*step-}))" 2>&1 | grep -v '^{"step"' | tail -5
fi
mkdir -p "$out/drafter"
for f in config.json model.safetensors train_log.jsonl training_config.yaml; do
    cp $run/$f "$out/drafter/" || log "no $f: the training did not finish"
done
log "done"
