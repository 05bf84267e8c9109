"""What the benchmarks that decode GSM8K-style questions one at a time share: their flags, and the pipeline and
questions those name."""

from __future__ import annotations

import argparse

import torch

from dflash.api import DFlash
from dflash.bench.datasets import DataOptions, load_samples


def question_arguments(parser: argparse.ArgumentParser, questions: int = 20) -> None:
    """--target, --draft (default: the embedded pair), --dataset, --questions, --seed, --max-new-tokens, --threads
    and --json (a file for the report)."""
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--dataset", default="gsm8k")
    parser.add_argument("--questions", type=int, default=questions)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")


def pipeline_and_questions(args: argparse.Namespace) -> tuple[DFlash, list[list[int]]]:
    """The pipeline the flags name, and the first turns of the dataset's questions as its prompt token ids."""
    torch.set_num_threads(args.threads)
    pipe = DFlash.from_pretrained(args.target, args.draft)
    samples = load_samples(args.dataset, DataOptions(max_samples=args.questions, seed=args.seed))
    return pipe, [pipe.encode(s.turns[0]) for s in samples]
