"""Does the drafter need its full trained width? Acceptance length when it drafts fewer positions.

The engine always runs the drafter over the block it was trained on (16 positions for the embedded pair) and
verifies the first `block_size - 1` draft tokens. Drafting only `width` positions would make the drafter's
forward cheaper; this script decodes GSM8K test questions greedily at each (block size, width) and prints
the mean acceptance length of each, so that saving can be weighed against what it costs in tau (the step
times are `benchmarks/batched_step.py`'s).

    python benchmarks/draft_width.py [--target DIR --draft DIR] [--max-samples 40] [--pairs 4:4,4:16,8:8,8:16]
"""

from __future__ import annotations

import argparse
import json

import torch

from dflash.api import ASSETS, DFlash
from dflash.bench.datasets import DataOptions, load_samples
from dflash.decoding.engine import GenerationConfig, SpeculativeEngine
from dflash.decoding.proposer import DFlashProposer


def mean_acceptance_length(engine: SpeculativeEngine, prompts: list[list[int]], max_new_tokens: int) -> float:
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    steps = [n for p in prompts for n in engine.generate([p], config)[0].stats.acceptance_lengths[1:]]
    return sum(steps) / len(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="default: the embedded target (with or without --draft)")
    parser.add_argument("--draft")
    parser.add_argument("--max-samples", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--pairs", default="4:4,4:8,4:16,8:8,8:12,8:16,16:16", help="BLOCK:WIDTH, comma-separated")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = DFlash.from_pretrained(args.target or (ASSETS / "target" if args.draft else None), args.draft)
    samples = load_samples("gsm8k", DataOptions(max_samples=args.max_samples))
    prompts = [pipe.encode(s.turns[0]) for s in samples]
    for pair in args.pairs.split(","):
        block, width = (int(x) for x in pair.split(":"))
        if not 2 <= block <= width <= pipe.drafter.config.block_size:
            parser.error(f"{pair}: need 2 <= BLOCK <= WIDTH <= {pipe.drafter.config.block_size} (the trained width)")
        proposer = DFlashProposer(pipe.drafter, pipe.target, block)
        proposer.draft_width = width  # positions in the drafter's forward (the anchor + width - 1 masks)
        tau = mean_acceptance_length(SpeculativeEngine(pipe.target, proposer, pipe.tokenizer), prompts,
                                     args.max_new_tokens)
        print(json.dumps({"block_size": block, "draft_width": width, "prompts": len(prompts),
                          "mean_acceptance_length": round(tau, 3)}), flush=True)


if __name__ == "__main__":
    main()
