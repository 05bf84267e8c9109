"""Acceptance length of sampled decoding, with a seed (the seeded coupling) and without (rejection sampling).

Both keep the target's distribution; they differ in how often a draft token is accepted. This script samples
answers to GSM8K test questions with a pair at each temperature, `--rounds` times each with a seed of its own and as
often without one, and prints the verify steps and tau of each setting as a JSON line. Sampled answers are
heavy-tailed (one that wanders off into text the drafter cannot follow takes hundreds of steps), so small samples
swing by a whole token of tau: use several rounds.

    python benchmarks/sampling_acceptance.py [--target DIR --draft DIR] [--max-samples 20] [--rounds 3]
        [--temperatures 0.7,1.0] [--block-size 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pair_options import add_pair_options, load_pair

from dflash.bench.datasets import DataOptions, load_samples


def tau(steps: list[int]) -> float | None:
    return round(sum(steps) / len(steps), 3) if steps else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, max_samples=20)
    parser.add_argument("--rounds", type=int, default=3, help="answers per question and setting")
    parser.add_argument("--temperatures", default="0.7,1.0")
    args = parser.parse_args()
    pipe = load_pair(args)
    samples = load_samples(args.dataset, DataOptions(max_samples=args.max_samples))
    runs = []
    for temperature in (float(t) for t in args.temperatures.split(",")):
        for seeded in (True, False):
            steps: list[int] = []
            for n in range(args.rounds):
                for i, sample in enumerate(samples):
                    seed = n * len(samples) + i if seeded else None
                    out = pipe.generate(sample.turns[0], max_new_tokens=args.max_new_tokens,
                                        block_size=args.block_size, temperature=temperature, seed=seed)
                    steps += out.stats.acceptance_lengths[1:]  # entry 0 is the prefill's token, not a verify step
            runs.append({"temperature": temperature, "seeded": seeded, "answers": len(samples) * args.rounds,
                         "verify_steps": len(steps), "tau": tau(steps)})
            print(json.dumps(runs[-1]), flush=True)
    result = {"dataset": args.dataset, "block_size": args.block_size, "max_new_tokens": args.max_new_tokens,
              "rounds": args.rounds,
              "runs": runs}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
