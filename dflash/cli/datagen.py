"""`dflash datagen`: the target answers the prompts; the drafter is then trained on its own text."""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash.training.datagen import DatagenConfig, done_ids, read_prompts, run_datagen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="target model: directory or hub id (default: the embedded target)")
    parser.add_argument("--prompts", required=True,
                        help="JSONL with `prompt`, `turns` or `messages` per line, a dataset directory, or a "
                        "Hugging Face dataset name (org/name)")
    parser.add_argument("--output", required=True, help="output JSONL (re-running resumes it)")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16, help="prompts decoded together")
    parser.add_argument("--limit", type=int, help="only the first N prompts")
    parser.add_argument("--split", default="train", help="dataset split (datasets)")
    parser.add_argument("--subset", help="dataset configuration, e.g. main for openai/gsm8k (datasets)")
    parser.add_argument("--prompt-field", help="dataset column holding the prompt")
    parser.add_argument("--prompt-suffix", default="", help="text appended to every user turn")
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto")
    parser.add_argument("--device")


def run(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    config = DatagenConfig(**{k: v for k, v in vars(args).items() if k in DatagenConfig.__dataclass_fields__})
    records = read_prompts(config)  # once: a hub dataset is not fetched twice
    total = len(records)
    with Progress(transient=False) as progress:
        task = progress.add_task("datagen", total=total)
        progress.update(task, completed=len(done_ids(Path(config.output))))
        written = run_datagen(config, progress=lambda n: progress.advance(task, n), records=records)
    print(f"wrote {written} new records to {config.output} ({total} prompts in all)")
    return 0
