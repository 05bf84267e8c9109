"""What drafting with bfloat16 matrix products (`dflash/model/cpu_precision.py`) is worth on this CPU.

Builds the pipeline twice from the same checkpoints, `drafter_precision` "bfloat16" and "float32" (whatever the
measurement at build time says; `bfloat16_chosen_at_build` reports what "auto" chose). Then, taking
turns so that machine noise hits both alike:
- decode-step times (median) of `--rows` rows at `--context` tokens each, for each block size in `--block-sizes`;
- greedy decoding of `--questions` GSM8K test questions: tau (tokens per verify forward, pooled), tokens/s,
  and whether both pipelines generated the same text (they must: only the drafts can differ).

    python benchmarks/drafter_precision.py [--rows 1,8] [--block-sizes 8,16] [--questions 20] [--rounds 3]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from batched_step import step_time_ms

import dflash.api
from dflash.api import DFlash
from dflash.bench.datasets import DataOptions, load_samples
from dflash.decoding.engine import GenerationConfig


def build(target: str | None, draft: str | None, precision: str) -> DFlash:
    """The pipeline with the drafter's products in `precision` ("auto": as `dflash` builds it by default)."""
    return DFlash.from_pretrained(target, draft, device="cpu", drafter_precision=precision)


def decode(pipes: dict[str, DFlash], prompts: list[list[int]], max_new_tokens: int) -> dict:
    """Greedy decoding of every prompt by each pipeline in turn: pooled tau, tokens/s and the outputs of each."""
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    totals = {name: {"seconds": 0.0, "tokens": 0, "forwards": 0, "outputs": []} for name in pipes}
    for i, prompt in enumerate(prompts):
        names = list(pipes) if i % 2 == 0 else list(reversed(pipes))  # who goes first alternates
        for name in names:
            start = time.perf_counter()
            result = pipes[name].engine.generate([prompt], config)[0]
            total = totals[name]
            total["seconds"] += time.perf_counter() - start
            decode_steps = result.stats.acceptance_lengths[1:]  # [0] is the prefill's token
            total["tokens"] += sum(decode_steps)
            total["forwards"] += len(decode_steps)
            total["outputs"].append(result.output_ids)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="default: the embedded target (with or without --draft)")
    parser.add_argument("--draft")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--block-sizes", default="8,16")
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=15, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="turns each pipeline takes per measurement")
    parser.add_argument("--questions", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = args.target or (str(dflash.api.ASSETS / "target") if args.draft else None)
    pipes = {name: build(target, args.draft, name) for name in ("bfloat16", "float32")}
    chosen = build(target, args.draft, "auto").drafter.draft_head is not None
    report: dict = {"threads": args.threads, "bfloat16_chosen_at_build": chosen, "steps": []}
    for rows in (int(r) for r in args.rows.split(",")):
        for block in (int(b) for b in args.block_sizes.split(",")):
            times: dict[str, list[float]] = {name: [] for name in pipes}
            for _ in range(args.rounds):
                for name, pipe in pipes.items():
                    proposer = pipe.engine.proposer.with_block_size(block)
                    times[name].append(step_time_ms(pipe.engine, proposer, rows, args.context, args.repeats))
            report["steps"].append({"rows": rows, "block_size": block,
                                    **{f"{name}_step_ms": round(statistics.median(t), 2) for name, t in times.items()}})
            print(json.dumps(report["steps"][-1]), flush=True)
    samples = load_samples("gsm8k", DataOptions(max_samples=args.questions, seed=0))
    prompts = [pipes["float32"].encode(list(s.history) + [{"role": "user", "content": s.turns[0]}]) for s in samples]
    totals = decode(pipes, prompts, args.max_new_tokens)
    for name, total in totals.items():
        report[f"{name}_tau"] = round(total["tokens"] / max(total["forwards"], 1), 3)
        report[f"{name}_tokens_per_s"] = round(sum(map(len, total["outputs"])) / total["seconds"], 1)
    report["questions"] = len(prompts)
    report["same_outputs"] = totals["bfloat16"]["outputs"] == totals["float32"]["outputs"]
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
