"""Greedy decoding of several GSM8K test questions together (one ragged batch), by each drafter and plainly.

What `dflash serve` does under load, without the server: `--rows` questions start together and decode as one
batch until each is done. Each pipeline takes its turn in every round (who goes first alternates, so that bursts
of other work hit all alike); a round's tokens/s is its output tokens over its wall time. Prints one JSON object:
per pipeline the median tokens/s over rounds, the speedup over plain decoding (median of per-round ratios),
the pooled tau (tokens per verify forward, prefill's token left out), and whether its outputs equal plain
decoding's (they must).

    python benchmarks/batched_decoding.py [--rows 8] [--rounds 3] [--max-new-tokens 128] [--block-size auto]
        [--draft-model runs/embedded/draft_model_l2 --draft-model-block 5]

Without --target the embedded pair (plain, its DFlash drafter); `--draft-model` adds classic speculative
decoding with that causal LM (same tokenizer) at `--draft-model-block`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dflash.api import DEFAULT_TARGET, DFlash
from dflash.bench.datasets import DataOptions, load_samples
from dflash.cli.common import block_size


def pipelines(args: argparse.Namespace) -> dict[str, DFlash]:
    """plain, DFlash and (with --draft-model) the draft model, each on its own copy of the target."""
    pipes = {"plain": DFlash.from_pretrained(args.target, no_draft=True, device="cpu"),
             "DFlash": DFlash.from_pretrained(args.target, args.draft, device="cpu", block_size=args.block_size)}
    if args.draft_model:
        target = args.target or str(DEFAULT_TARGET)
        pipes["draft model"] = DFlash.from_pretrained(target, args.draft_model, device="cpu",
                                                      block_size=args.draft_model_block)
    return pipes


def decode_round(pipe: DFlash, prompts: list[list[int]], max_new_tokens: int) -> dict:
    start = time.perf_counter()
    outs = pipe.generate_batch(prompts, max_new_tokens=max_new_tokens)  # at the pipeline's block size
    seconds = time.perf_counter() - start
    steps = [length for out in outs for length in out.stats.acceptance_lengths[1:]]
    return {"seconds": seconds, "tokens": sum(len(o.output_ids) for o in outs),
            "verified": sum(steps), "forwards": len(steps), "outputs": [o.output_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="default: the embedded target")
    parser.add_argument("--draft", help="its DFlash drafter (default: the embedded one; needs --target)")
    parser.add_argument("--draft-model", help="a causal LM to draft token by token, for comparison")
    parser.add_argument("--block-size", type=block_size, default="auto",
                        help="DFlash's block size: a number or auto (default, as dflash generate and serve)")
    parser.add_argument("--draft-model-block", type=int, default=5)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipes = pipelines(args)
    samples = load_samples("gsm8k", DataOptions(max_samples=args.rows))
    prompts = [pipes["plain"].encode(s.turns[0]) for s in samples]
    for pipe in pipes.values():  # warm-up on the whole batch: first calls allocate, and auto times its step costs
        decode_round(pipe, prompts, 8)
    rounds: dict[str, list[dict]] = {name: [] for name in pipes}
    for i in range(args.rounds):
        for name in (list(pipes) if i % 2 == 0 else list(reversed(pipes))):
            rounds[name].append(decode_round(pipes[name], prompts, args.max_new_tokens))
    plain = rounds["plain"]
    report = {"rows": len(prompts), "rounds": args.rounds, "max_new_tokens": args.max_new_tokens,
              "threads": args.threads}
    for name, runs in rounds.items():
        speedups = [(r["tokens"] / r["seconds"]) / (p["tokens"] / p["seconds"]) for r, p in zip(runs, plain)]
        forwards = sum(r["forwards"] for r in runs)
        report[name] = {
            "tokens_per_s": round(statistics.median(r["tokens"] / r["seconds"] for r in runs), 1),
            "speedup": round(statistics.median(speedups), 3),
            "speedup_range": [round(min(speedups), 3), round(max(speedups), 3)],
            "tau": round(sum(r["verified"] for r in runs) / forwards, 2) if forwards else None,
            "same_outputs_as_plain": all(r["outputs"] == p["outputs"] for r, p in zip(runs, plain)),
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
