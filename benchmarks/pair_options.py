"""The options and the loading that the scripts decoding a dataset with a pair share (`acceptance_by_confidence.py`,
`tau_by_loops.py`, `sampling_acceptance.py`, `penalties.py`, `structured.py`): a target and drafter (the embedded
pair by default), a dataset's first samples, a block size, an answer length, CPU threads and a JSON file to write."""

from __future__ import annotations

import argparse

import torch

from dflash.api import ASSETS, DFlash
from dflash.bench.datasets import DataOptions, load_samples


def add_pair_options(parser: argparse.ArgumentParser, max_samples: int, seed: int | None = None) -> None:
    """The shared flags; with `seed`, also --seed (its default): which samples `first_turn_prompts` takes."""
    parser.add_argument("--target", help="default: the embedded target (with or without --draft)")
    parser.add_argument("--draft")
    parser.add_argument("--dataset", default="gsm8k")
    parser.add_argument("--max-samples", type=int, default=max_samples)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the result here")
    if seed is not None:
        parser.add_argument("--seed", type=int, default=seed, help="which samples (a deterministic subset)")


def load_pair(args: argparse.Namespace) -> DFlash:
    """The pair the options name, with torch on --threads CPU threads."""
    torch.set_num_threads(args.threads)
    return DFlash.from_pretrained(args.target or (ASSETS / "target" if args.draft else None), args.draft)


def first_turn_prompts(args: argparse.Namespace, pipe: DFlash) -> list[list[int]]:
    """The token ids of the first turn (after its history) of the samples the options pick."""
    samples = load_samples(args.dataset, DataOptions(max_samples=args.max_samples, seed=getattr(args, "seed", 0)))
    return [pipe.encode(list(s.history) + [{"role": "user", "content": s.turns[0]}]) for s in samples]
