#!/usr/bin/env bash
# Rebuild the embedded drafter: the target answers the GSM8K training questions (greedy, the chat
# template as served), then the drafter is trained on those answers and copied into dflash/assets/drafter.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p runs/embedded
suffix=$'\nPlease reason step by step, and put your final answer within \\boxed{}.'
dflash datagen --target dflash/assets/target --prompts scripts/embedded/data/gsm8k_train.jsonl \
    --prompt-field question --prompt-suffix "$suffix" \
    --output runs/embedded/gsm8k_train_regenerated.jsonl --max-new-tokens 384 --batch-size 32
dflash train --config scripts/embedded/drafter.yaml "$@"          # round 1 -> runs/embedded/drafter
dflash train --config scripts/embedded/drafter_round2.yaml "$@"   # round 2 -> runs/embedded/drafter_round2
# round 3 adds the target's answers to the training questions with new numbers (held-out ones skipped)
python scripts/embedded/perturb_questions.py --out runs/embedded/gsm8k_train_perturbed_prompts.jsonl
dflash datagen --target dflash/assets/target --prompts runs/embedded/gsm8k_train_perturbed_prompts.jsonl \
    --prompt-field question --prompt-suffix "$suffix" \
    --output runs/embedded/gsm8k_train_perturbed.jsonl --max-new-tokens 384 --batch-size 32
dflash train --config scripts/embedded/drafter_round3.yaml "$@"   # round 3 -> runs/embedded/drafter_round3
# round 4 adds the answers to a second draw of new numbers
python scripts/embedded/perturb_questions.py --seed 1 --out runs/embedded/gsm8k_train_perturbed2_prompts.jsonl
dflash datagen --target dflash/assets/target --prompts runs/embedded/gsm8k_train_perturbed2_prompts.jsonl \
    --prompt-field question --prompt-suffix "$suffix" \
    --output runs/embedded/gsm8k_train_perturbed2.jsonl --max-new-tokens 384 --batch-size 32
dflash train --config scripts/embedded/drafter_round4.yaml "$@"   # round 4 -> runs/embedded/drafter_round4
# round 5 adds the answers to a third draw of new numbers
python scripts/embedded/perturb_questions.py --seed 2 --out runs/embedded/gsm8k_train_perturbed3_prompts.jsonl
dflash datagen --target dflash/assets/target --prompts runs/embedded/gsm8k_train_perturbed3_prompts.jsonl \
    --prompt-field question --prompt-suffix "$suffix" \
    --output runs/embedded/gsm8k_train_perturbed3.jsonl --max-new-tokens 384 --batch-size 32
dflash train --config scripts/embedded/drafter_round5.yaml "$@"   # round 5 -> runs/embedded/drafter_round5
rm -rf dflash/assets/drafter && mkdir -p dflash/assets/drafter
cp runs/embedded/drafter_round5/config.json runs/embedded/drafter_round5/model.safetensors dflash/assets/drafter/
