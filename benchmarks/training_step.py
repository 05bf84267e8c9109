"""How long one `dflash train` step takes with the embedded drafter's recipe (DFlash2 from the shipped drafter,
block 16, 32 anchors per sequence, batch 16, float32), and the losses it gives.

The embedded target answers GSM8K training questions first (`dflash datagen`, greedy, 256 new tokens; kept in
--work-dir and reused). After a warm-up step, --steps steps are timed one by one; prints their median, each time
and each loss as one JSON object, so two trees can be compared on one machine (run it from each, with
PYTHONPATH pointing at it).

    python benchmarks/training_step.py [--steps 5] [--batch-size 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dflash.training.config import load_config
from dflash.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def answers(work: Path, count: int) -> Path:
    path = work / "answers.jsonl"
    prompts = work / "prompts.jsonl"
    lines = (ROOT / "scripts" / "embedded" / "data" / "gsm8k_train.jsonl").read_text().splitlines()[:count]
    prompts.write_text("".join(json.dumps({"prompt": json.loads(line)["question"] + SUFFIX}) + "\n"
                               for line in lines))
    subprocess.run([sys.executable, "-m", "dflash", "datagen", "--prompts", str(prompts), "--output", str(path),
                    "--max-new-tokens", "256", "--batch-size", "16"], check=True)  # resumes: nothing new to do
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--work-dir", default="runs/training_step")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data = answers(work, args.batch_size * (args.steps + 1))
    config = load_config(None, dict(data=str(data), output=str(work / "out"), overwrite=True, max_steps=args.steps + 1,
                                    init_from=str(ROOT / "dflash" / "assets" / "drafter"), selector_loss_weight=1.0,
                                    block_size=16, anchors_per_sequence=32, max_length=512,
                                    batch_size=args.batch_size, eval_fraction=0, eval_every=0, seed=1))
    trainer = Trainer(config).setup()
    batches = [list(range(i * args.batch_size, (i + 1) * args.batch_size)) for i in range(args.steps + 1)]
    trainer._train_step(batches[0], epoch=0)  # warm-up
    times, losses = [], []
    for batch in batches[1:]:
        start = time.perf_counter()
        stats = trainer._train_step(batch, epoch=0)
        times.append(time.perf_counter() - start)
        losses.append(round(stats["loss"], 5))
    result = {"median_step_s": round(statistics.median(times), 3), "step_s": [round(t, 3) for t in times],
              "losses": losses, "batch_size": args.batch_size}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
