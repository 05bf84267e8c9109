"""What choosing the block size after drafting (`dflash/decoding/block_policy.py`) is worth on this CPU.

One pipeline, one process, three ways of decoding one row, taking turns prompt by prompt (the order alternates)
so that machine noise hits all alike:
- `after`: block size auto, chosen after drafting from the draft's confidence (the default for one greedy row);
- `before`: block size auto, chosen before drafting from the acceptance seen per position (the way batches and
  rejection-sampled rows choose);
- `fixed`: the drafter's own block size (`--fixed`, default its block size) every step.
All three share the policy (start-up costs, what it learned), so only the way of choosing differs. For each:
decode steps, tau (tokens per verify forward), the mean block verified, milliseconds per step in the drafter
(with the choice) and the target, and decode tokens/s (the steps' own time, prefill left out); and whether the
outputs are the same (they must be: greedy).

    python benchmarks/block_choice.py [--questions 30] [--seed 1] [--rounds 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json

import torch

import dflash.api
from dflash.api import DFlash
from dflash.bench.datasets import DataOptions, load_samples
from dflash.decoding.engine import GenerationConfig, StepProfile

WAYS = ("after", "before", "fixed")


def decode_in_turns(pipe: DFlash, prompts: list[list[int]], fixed: int, rounds: int,
                    max_new_tokens: int) -> dict:
    engine = pipe.engine
    engine.generate([prompts[0]], GenerationConfig(max_new_tokens=8, block_size="auto"))  # times start-up
    policy = engine._block_policy
    after_costs = policy.after_drafting_costs
    profiles = {way: StepProfile() for way in WAYS}
    totals = {way: {"tokens": 0, "verified": 0, "outputs": []} for way in WAYS}
    for r in range(rounds):
        for i, prompt in enumerate(prompts):
            for way in WAYS if (i + r) % 2 == 0 else WAYS[::-1]:
                policy.after_drafting_costs = after_costs if way == "after" else None  # None: choose before
                engine.profile = profiles[way]
                block = fixed if way == "fixed" else "auto"
                out = engine.generate([prompt], GenerationConfig(max_new_tokens=max_new_tokens, block_size=block))[0]
                totals[way]["tokens"] += sum(out.stats.acceptance_lengths[1:])  # [0] is the prefill's token
                totals[way]["verified"] += sum(out.stats.block_sizes)
                if r == 0:
                    totals[way]["outputs"].append(out.output_ids)
    policy.after_drafting_costs = after_costs
    report = {"start_up_ms": {f"{k}": round(s * 1e3, 2) for (_, k), s in sorted(after_costs.seconds.items())}}
    line = policy.after_drafting_line.fit()
    report["served_line_ms"] = None if line is None else {"a": round(line[0] * 1e3, 2), "b": round(line[1] * 1e3, 3)}
    for way, p in profiles.items():
        t = totals[way]
        report[way] = {
            "steps": p.steps,
            "tau": round(t["tokens"] / p.steps, 3),
            "mean_block": round(t["verified"] / p.steps, 2),
            "draft_ms_per_step": round(p.draft_s / p.steps * 1e3, 2),
            "target_ms_per_step": round(p.target_s / p.steps * 1e3, 2),
            "ms_per_step": round(p.total_s / p.steps * 1e3, 2),
            "decode_tokens_per_s": round(t["tokens"] / p.total_s, 1),
        }
    report["after_over_before"] = round(report["after"]["decode_tokens_per_s"]
                                        / report["before"]["decode_tokens_per_s"], 3)
    report["after_over_fixed"] = round(report["after"]["decode_tokens_per_s"]
                                       / report["fixed"]["decode_tokens_per_s"], 3)
    report["same_outputs"] = totals["after"]["outputs"] == totals["before"]["outputs"] == totals["fixed"]["outputs"]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="default: the embedded target (with or without --draft)")
    parser.add_argument("--draft")
    parser.add_argument("--questions", type=int, default=30, help="GSM8K test questions")
    parser.add_argument("--seed", type=int, default=1, help="which questions (the subset's seed)")
    parser.add_argument("--rounds", type=int, default=2, help="passes over the questions")
    parser.add_argument("--fixed", type=int, help="the fixed block size (default: the drafter's own)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = args.target or (str(dflash.api.ASSETS / "target") if args.draft else None)
    pipe = DFlash.from_pretrained(target, args.draft)
    samples = load_samples("gsm8k", DataOptions(max_samples=args.questions, seed=args.seed))
    prompts = [pipe.encode(list(s.history) + [{"role": "user", "content": s.turns[0]}]) for s in samples]
    report = {"threads": args.threads, "questions": len(prompts), "seed": args.seed, "rounds": args.rounds,
              **decode_in_turns(pipe, prompts, args.fixed or pipe.engine.proposer.block_size, args.rounds,
                                args.max_new_tokens)}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
