"""What verifying a branch with each block (`dflash/decoding/branch.py`) is worth on this machine.

One pipeline, one process, one greedy row at a time; the ways of decoding take turns prompt by prompt (the order
alternates) so that machine noise hits all alike. A way is BLOCK:BRANCH, a block size (a number or auto) and a
branch length (0: none). For each: tau (tokens per verify forward), the tokens verified per step (block and
branch), decode tokens/s (the steps' own time, prefill left out), and whether its outputs are those of the first
way (they must be: greedy).

    python benchmarks/branches.py [--ways 16:0,16:2,16:4,16:6,auto:0,auto:4] [--questions 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

from dflash.api import DFlash
from dflash.bench.datasets import DataOptions, load_samples
from dflash.decoding.engine import GenerationConfig


def parse_way(text: str) -> tuple[int | str, int]:
    block, branch = text.split(":")
    return (block if block == "auto" else int(block)), int(branch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target")
    parser.add_argument("--draft")
    parser.add_argument("--ways", default="16:0,16:2,16:4,16:6,auto:0,auto:4")
    parser.add_argument("--dataset", default="gsm8k")
    parser.add_argument("--questions", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = DFlash.from_pretrained(args.target, args.draft)
    prompts = [pipe.encode(s.turns[0]) for s in load_samples(args.dataset, DataOptions(max_samples=args.questions,
                                                                                         seed=args.seed))]
    ways = [w.strip() for w in args.ways.split(",")]
    configs = {w: GenerationConfig(max_new_tokens=args.max_new_tokens, block_size=parse_way(w)[0],
                                   branch_length=parse_way(w)[1]) for w in ways}
    for w in ways:  # warm-up (and auto's start-up timing)
        pipe.engine.generate([prompts[0]], GenerationConfig(**{**configs[w].__dict__, "max_new_tokens": 16}))
    totals = {w: {"tokens": 0, "steps": 0, "verified": 0, "seconds": 0.0, "outputs": []} for w in ways}
    for i, prompt in enumerate(prompts):
        for w in ways if i % 2 == 0 else ways[::-1]:
            out = pipe.engine.generate([prompt], configs[w])[0]
            t = totals[w]
            t["tokens"] += sum(out.stats.acceptance_lengths[1:])  # decoded after the prefill's token
            t["steps"] += len(out.stats.acceptance_lengths) - 1
            t["verified"] += sum(out.stats.block_sizes)
            t["seconds"] += out.stats.decode_time_s
            t["outputs"].append(out.output_ids)
    first = totals[ways[0]]["outputs"]
    report = {}
    for w, t in totals.items():
        report[w] = {"tau": round(t["tokens"] / t["steps"], 3),
                     "verified_per_step": round(t["verified"] / t["steps"], 2),
                     "tokens_per_s": round(t["tokens"] / t["seconds"], 1),
                     "same_outputs": sum(a == b for a, b in zip(t["outputs"], first))}
    base = report[ways[0]]["tokens_per_s"]
    for w in ways:
        report[w]["speed_vs_first"] = round(report[w]["tokens_per_s"] / base, 3)
        print(f"{w:8s} {report[w]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"questions": len(prompts), "dataset": args.dataset, "ways": report}, f, indent=1)


if __name__ == "__main__":
    main()
