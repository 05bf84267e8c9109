#!/usr/bin/env bash
# Rebuild the embedded drafter: the target answers the GSM8K training questions (greedy, the chat
# template as served), then the drafter is trained on those answers and copied into dflash/assets/drafter.
# Rounds 1-5 ran against the phase-2 target; then phase 4 of the target (trained again on its own answers) and
# drafter rounds 10-12 for it; phase 5 (the same step again) and round 15; phase 6c (against its own loops) and
# round 17, then rounds 19 (DFlash2) and 20, each copied into dflash/assets as it was shipped. The rounds after 20
# (round 25 is what dflash/assets holds) are separate commands: the README's "The embedded pair".
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p runs/embedded
# the phase-2 target, shipped until phase 4: its weights from the repository's history, its tokenizer as now
phase2=runs/embedded/target_phase2
if [ ! -f "$phase2/model.safetensors" ]; then
    mkdir -p "$phase2"
    cp dflash/assets/target/{config.json,generation_config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} "$phase2/"
    git show 09c9ca7:dflash/assets/target/model.safetensors > "$phase2/model.safetensors"
fi
# answer TARGET PROMPTS OUT: the target's greedy answers to GSM8K questions, with the chat template as served
answer() {
    dflash datagen --target "$1" --prompts "$2" --prompt-field question \
        --prompt-suffix $'\nPlease reason step by step, and put your final answer within \\boxed{}.' \
        --output "$3" --max-new-tokens 384 --batch-size 32
}
answer "$phase2" scripts/embedded/data/gsm8k_train.jsonl runs/embedded/gsm8k_train_regenerated.jsonl
dflash train --config scripts/embedded/drafter.yaml --target "$phase2" "$@"          # round 1 -> runs/embedded/drafter
dflash train --config scripts/embedded/drafter_round2.yaml --target "$phase2" "$@"   # round 2 -> runs/embedded/drafter_round2
# round 3 adds the target's answers to the training questions with new numbers (held-out ones skipped)
python scripts/embedded/perturb_questions.py --out runs/embedded/gsm8k_train_perturbed_prompts.jsonl
answer "$phase2" runs/embedded/gsm8k_train_perturbed_prompts.jsonl runs/embedded/gsm8k_train_perturbed.jsonl
dflash train --config scripts/embedded/drafter_round3.yaml --target "$phase2" "$@"   # round 3 -> runs/embedded/drafter_round3
# round 4 adds the answers to a second draw of new numbers
python scripts/embedded/perturb_questions.py --seed 1 --out runs/embedded/gsm8k_train_perturbed2_prompts.jsonl
answer "$phase2" runs/embedded/gsm8k_train_perturbed2_prompts.jsonl runs/embedded/gsm8k_train_perturbed2.jsonl
dflash train --config scripts/embedded/drafter_round4.yaml --target "$phase2" "$@"   # round 4 -> runs/embedded/drafter_round4
# round 5 adds the answers to a third draw of new numbers
python scripts/embedded/perturb_questions.py --seed 2 --out runs/embedded/gsm8k_train_perturbed3_prompts.jsonl
answer "$phase2" runs/embedded/gsm8k_train_perturbed3_prompts.jsonl runs/embedded/gsm8k_train_perturbed3.jsonl
dflash train --config scripts/embedded/drafter_round5.yaml --target "$phase2" "$@"   # round 5 -> runs/embedded/drafter_round5
# phase 4 of the target: the phase-2 target trained again on its own answers that stop and do not loop (to the
# training questions, and to a fourth draw of new numbers)
python scripts/embedded/perturb_questions.py --seed 3 --out runs/embedded/gsm8k_train_perturbed4_prompts.jsonl
answer "$phase2" runs/embedded/gsm8k_train_perturbed4_prompts.jsonl runs/embedded/gsm8k_train_perturbed4.jsonl
python scripts/embedded/select_own_answers.py runs/embedded/gsm8k_train_regenerated.jsonl \
    runs/embedded/gsm8k_train_perturbed4.jsonl --out runs/embedded/own_answers.jsonl
python scripts/embedded/train_target.py --init-from "$phase2" --extra-train runs/embedded/own_answers.jsonl \
    --no-references --asst-only --threads 2 --adaptive-threads --max-tokens 1024 --lr 3e-4 --warmup 50 \
    --time-budget 900 --save-every 200 --eval-every 400 --ckpt-dir runs/embedded/target_phase4 \
    --out runs/embedded/target_phase4/export
# round 10: the round-5 drafter trained for the phase-4 target, on that target's answers
phase4=runs/embedded/target_phase4/export
answer "$phase4" scripts/embedded/data/gsm8k_train.jsonl runs/embedded/gsm8k_train_phase4.jsonl
dflash train --config scripts/embedded/drafter_round10.yaml "$@"
# round 11: round 10 on the phase-4 target's answers to the fourth draw of new numbers as well
answer "$phase4" runs/embedded/gsm8k_train_perturbed4_prompts.jsonl runs/embedded/gsm8k_train_perturbed4_phase4.jsonl
dflash train --config scripts/embedded/drafter_round11.yaml "$@"
# round 12: round 11, longer, on a third set of answers (to a fifth draw of new numbers, seed 0)
python scripts/embedded/perturb_questions.py --seed 0 --out runs/embedded/gsm8k_train_perturbed5_prompts.jsonl
answer "$phase4" runs/embedded/gsm8k_train_perturbed5_prompts.jsonl runs/embedded/gsm8k_train_perturbed5_phase4.jsonl
dflash train --config scripts/embedded/drafter_round12.yaml "$@"
# phase 5 of the target: the phase-4 target trained again on its own answers that stop and do not loop (the
# three sets rounds 10-12 were trained on); round 15: round 12 trained for it
python scripts/embedded/select_own_answers.py runs/embedded/gsm8k_train_phase4.jsonl \
    runs/embedded/gsm8k_train_perturbed4_phase4.jsonl runs/embedded/gsm8k_train_perturbed5_phase4.jsonl \
    --out runs/embedded/own_answers_phase4.jsonl
python scripts/embedded/train_target.py --init-from "$phase4" --extra-train runs/embedded/own_answers_phase4.jsonl \
    --no-references --asst-only --threads 2 --adaptive-threads --max-tokens 1024 --lr 3e-4 --warmup 50 \
    --time-budget 900 --save-every 200 --eval-every 400 --ckpt-dir runs/embedded/target_phase5 \
    --out runs/embedded/target_phase5/export
dflash train --config scripts/embedded/drafter_round15.yaml "$@"
# phase 6c of the target: phase 5 trained again on its own answers that do not loop and on its answers to template
# prompts (code-holding ones among them), with an unlikelihood term on the looping tokens of its answers that loop;
# round 17: round 15 trained for it on its own answers
phase5=runs/embedded/target_phase5/export
answer "$phase5" scripts/embedded/data/gsm8k_train.jsonl runs/embedded/gsm8k_train_phase5.jsonl
python scripts/embedded/ood_prompts.py --n 2000 --seed 0 --out runs/embedded/ood_prompts2.jsonl
dflash datagen --target "$phase5" --prompts runs/embedded/ood_prompts2.jsonl --output runs/embedded/ood2_phase5.jsonl \
    --max-new-tokens 256 --batch-size 32
python scripts/embedded/select_own_answers.py runs/embedded/gsm8k_train_phase5.jsonl --out runs/embedded/own_answers_phase5.jsonl
python scripts/embedded/select_own_answers.py runs/embedded/ood2_phase5.jsonl --out runs/embedded/ood2_own_phase5.jsonl
ood=runs/embedded/ood2_own_phase5.jsonl
python scripts/embedded/train_target.py --init-from "$phase5" \
    --extra-train runs/embedded/own_answers_phase5.jsonl "$ood" "$ood" "$ood" \
    --unlikely runs/embedded/gsm8k_train_phase5.jsonl runs/embedded/ood2_phase5.jsonl \
    --no-references --asst-only --threads 2 --adaptive-threads --max-tokens 1024 --lr 2e-4 --warmup 50 \
    --time-budget 900 --save-every 200 --eval-every 400 --ckpt-dir runs/embedded/target_phase6c \
    --out runs/embedded/target_phase6c/export
phase6c=runs/embedded/target_phase6c/export
answer "$phase6c" scripts/embedded/data/gsm8k_train.jsonl runs/embedded/gsm8k_train_phase6c.jsonl
answer "$phase6c" runs/embedded/gsm8k_train_perturbed5_prompts.jsonl runs/embedded/gsm8k_train_perturbed5_phase6c.jsonl
dflash train --config scripts/embedded/drafter_round17.yaml "$@"
cp "$phase6c/model.safetensors" dflash/assets/target/
rm -rf dflash/assets/drafter && mkdir -p dflash/assets/drafter dflash/assets/drafter-dflash
cp runs/embedded/drafter_round17/config.json runs/embedded/drafter_round17/model.safetensors dflash/assets/drafter/
# round 17 also stays shipped as the DFlash drafter the hand-off to vLLM / SGLang uses (they cannot load DFlash2)
cp runs/embedded/drafter_round17/config.json runs/embedded/drafter_round17/model.safetensors dflash/assets/drafter-dflash/
# round 19 (shipped until round 20): round 17 grown into a DFlash2 drafter, on the phase-6c target's answers to one more draw
answer "$phase6c" runs/embedded/gsm8k_train_perturbed2_prompts.jsonl runs/embedded/gsm8k_train_perturbed2_phase6c.jsonl
dflash train --config scripts/embedded/drafter_round19.yaml "$@"
cp runs/embedded/drafter_round19/config.json runs/embedded/drafter_round19/model.safetensors dflash/assets/drafter/
# round 20 (shipped until round 21): round 19 trained 600 more steps on the training questions' and the seed-0 draw's answers
dflash train --config scripts/embedded/drafter_round20.yaml "$@"
cp runs/embedded/drafter_round20/config.json runs/embedded/drafter_round20/model.safetensors dflash/assets/drafter/
