"""What one epoch of `dflash train` costs on multi-turn conversations: a conversation as one sequence against a
sequence per turn.

The target answers conversations of several GSM8K training questions (`dflash datagen`, greedy), then a fresh
1-layer drafter trains one epoch on them twice, each layout on the same blocks (every response token with a
label after it is an anchor when --anchors-per-sequence exceeds them) and the same number of steps (the
per-turn run takes --turns times the batch). Prints one JSON object per layout: examples, tokens the target
computes per epoch, drafted blocks, wall seconds, final loss.

    python benchmarks/multi_turn_training.py [--conversations 40] [--turns 3] [--anchors 512] [--json FILE]

The per-turn layout is what `dflash train` did before 2026-12-06 for templates that continue a conversation
(it still does for those that do not, e.g. Qwen3's with thinking); here it is forced by grouping no turns.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import dflash.training.data as data
from dflash.training.config import load_config
from dflash.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def conversations(path: Path, count: int, turns: int) -> None:
    """`count` prompts of `turns` GSM8K training questions each, one user turn per question."""
    lines = (ROOT / "scripts" / "embedded" / "data" / "gsm8k_train.jsonl").read_text().splitlines()
    questions = [json.loads(line)["question"] for line in lines[: count * turns]]
    with path.open("w") as f:
        for i in range(count):
            f.write(json.dumps({"turns": [q + SUFFIX for q in questions[i * turns: (i + 1) * turns]]}) + "\n")


def train_epoch(answers: Path, output: Path, batch_size: int, anchors: int, per_turn: bool) -> dict:
    grouping = data._continued_turns
    if per_turn:
        data._continued_turns = lambda turns: [[i] for i in range(len(turns))]
    try:
        config = load_config(None, dict(data=str(answers), output=str(output), overwrite=True, epochs=1,
                                        batch_size=batch_size, anchors_per_sequence=anchors, eval_fraction=0,
                                        eval_every=0, draft_layers=1, max_length=2048, seed=0, log_every=1))
        trainer = Trainer(config).setup()
        blocks = []
        original = trainer._loss

        def counting(batch, *args, **kwargs):
            out = original(batch, *args, **kwargs)
            blocks.append(int(out[0].blocks))
            return out

        trainer._loss = counting
        start = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - start
        steps = [json.loads(line) for line in (output / "train_log.jsonl").read_text().splitlines()]
        losses = [r["loss"] for r in steps if "loss" in r]
        return {"layout": "a sequence per turn" if per_turn else "a sequence per conversation",
                "examples": len(trainer.train_examples), "steps": trainer.total_steps,
                "target_tokens": sum(len(e) for e in trainer.train_examples), "blocks": sum(blocks),
                "seconds": round(seconds, 1), "last_loss": losses[-1] if losses else None}
    finally:
        data._continued_turns = grouping


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--conversations", type=int, default=40)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=4, help="conversations per step")
    parser.add_argument("--work-dir", default="runs/multi_turn_training")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    prompts, answers = work / "prompts.jsonl", work / "answers.jsonl"
    conversations(prompts, args.conversations, args.turns)
    subprocess.run([sys.executable, "-m", "dflash", "datagen", "--prompts", str(prompts), "--output", str(answers),
                    "--max-new-tokens", str(args.max_new_tokens), "--batch-size", "8"], check=True)
    results = [train_epoch(answers, work / "conversation", args.batch_size, args.anchors, per_turn=False),
               train_epoch(answers, work / "turn", args.batch_size * args.turns, args.anchors, per_turn=True)]
    for result in results:
        print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
