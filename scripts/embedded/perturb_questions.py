"""More drafter training data for the embedded pair: GSM8K training questions with new numbers.

The drafter learns from the target's own answers, and GSM8K train has only 7,473 questions. Each
question here is rewritten with its standalone integers replaced (the same number gets the same new
number throughout a question; the new number has as many digits, and stays a multiple of 10 or 5 when
the old one was; 0 and 1 are kept, since they are often words such as "1 hour"). The target then answers
the new questions with `dflash datagen`, like the originals.

Questions the drafter's held-out split uses are skipped, so no variant of a held-out question reaches
training. That holds only for the split of the same seed and fraction as the trainer's: `--config` takes them
from the drafter's training YAML (`seed`, `eval_fraction`). Without it, `--holdout-seed` and
`--holdout-fraction` (by default the trainer's defaults) must match that config by hand (the draws rounds
20-22 trained on were made with seed 0 for configs of seed 1, so variants of their held-out questions were
trained on).

    python scripts/embedded/perturb_questions.py --config scripts/embedded/drafter_round22.yaml --seed 2 \
        --out runs/embedded/gsm8k_train_perturbed3_prompts.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dflash.training.config import TrainConfig, load_config  # noqa: E402
from dflash.training.data import split_examples  # noqa: E402

# an integer not glued to a decimal point, a digit group, a fraction or a time (12.5, 1,000, 1/2, 3:30)
INTEGER = re.compile(r"(?<![\d.,/:])\d+(?![\d]|[.,/:]\d)")


def new_number(old: int, rng: random.Random) -> int:
    if old <= 1:
        return old
    digits = len(str(old))
    low, high = (2, 9) if digits == 1 else (10 ** (digits - 1), 10**digits - 1)
    step = 10 if old % 10 == 0 and digits > 1 else 5 if old % 5 == 0 and digits > 1 else 1
    candidates = range(-(-low // step) * step, high + 1, step)
    return rng.choice(candidates)


def perturb(question: str, rng: random.Random) -> str:
    mapping: dict[str, str] = {}

    def replace(match: re.Match) -> str:
        text = match.group(0)
        if text not in mapping:
            mapping[text] = text if text.startswith("0") else str(new_number(int(text), rng))
        return mapping[text]

    return INTEGER.sub(replace, question)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--questions", default="scripts/embedded/data/gsm8k_train.jsonl")
    p.add_argument("--out", required=True)
    p.add_argument("--config", help="the drafter's training YAML: its held-out split (seed, eval_fraction) is skipped")
    p.add_argument("--holdout-fraction", type=float, help="default: --config's eval_fraction, else the trainer's")
    p.add_argument("--holdout-seed", type=int, help="default: --config's seed, else the trainer's")
    p.add_argument("--seed", type=int, default=1234, help="seed of the new numbers")
    a = p.parse_args()
    split = load_config(a.config, {}) if a.config else TrainConfig  # the trainer's defaults without a config
    if a.holdout_fraction is None:  # a flag overrides the config, as with `dflash train`
        a.holdout_fraction = split.eval_fraction
    if a.holdout_seed is None:
        a.holdout_seed = split.seed

    rows = [json.loads(line) for line in open(a.questions) if line.strip()]
    _, held = split_examples(list(range(len(rows))), a.holdout_fraction, a.holdout_seed)
    held = set(held)
    rng = random.Random(a.seed)
    changed = 0
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    with open(a.out, "w") as f:
        for i, row in enumerate(rows):
            if i in held:
                continue
            question = perturb(row["question"], rng)
            changed += question != row["question"]
            f.write(json.dumps({"question": question}) + "\n")
    print(f"wrote {len(rows) - len(held)} questions to {a.out} ({changed} with new numbers; "
          f"{len(held)} held-out questions skipped: split seed {a.holdout_seed}, fraction {a.holdout_fraction})")


if __name__ == "__main__":
    main()
