"""What asking the drafter only for the verified positions saves: its forward + logits, full width vs trimmed.

A block of k verifies draft tokens 1..k-1 of the drafter's full-width draft. `DFlashDraftModel.forward(...,
outputs=slice(1, k))` runs the last layer's queries, attention output and MLP, and the LM head, for those
alone; the full forward computes every position and slices after. Both are timed at each (rows, k) with a
drafter cache of `--context` tokens, interleaved, best of `--repeats` (other work on the machine only adds
time). One JSON line per shape.

    python benchmarks/drafter_outputs.py [--target DIR --draft DIR] [--rows 1,8] [--blocks 2,4,8,16]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dflash.api import ASSETS, DFlash
from dflash.model.drafter import DrafterCache


def best_ms(pipe: DFlash, rows: int, block: int, context: int, repeats: int) -> dict[str, float]:
    drafter, target = pipe.drafter, pipe.target
    width, n = drafter.config.block_size, drafter.config.num_features
    embeds = target.embed(torch.full((rows, width), drafter.config.mask_token_id))  # (rows, width, h)
    block_positions = torch.arange(context, context + width).repeat(rows, 1)
    features = torch.randn(rows, context, n)  # (rows, context, features): only the cost counts
    verified = slice(1, block)

    def draft(trimmed: bool) -> float:
        cache = DrafterCache(len(drafter.layers))
        drafter(embeds, block_positions, drafter.project_context(features), torch.arange(context).repeat(rows, 1),
                cache=cache)  # the context so far
        new = drafter.project_context(torch.randn(rows, 3, n))  # (rows, 3, h): this step's accepted tokens
        start = time.perf_counter()
        hidden = drafter(embeds, block_positions, new, torch.arange(context, context + 3).repeat(rows, 1),
                         cache=cache, outputs=verified if trimmed else slice(None))
        target.lm_head(hidden if trimmed else hidden[:, verified]).argmax(-1)
        return (time.perf_counter() - start) * 1000

    best = {"full_ms": float("inf"), "trimmed_ms": float("inf")}
    with torch.inference_mode():
        for _ in range(repeats):
            best["full_ms"] = min(best["full_ms"], draft(False))
            best["trimmed_ms"] = min(best["trimmed_ms"], draft(True))
    return {k: round(v, 2) for k, v in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="default: the embedded target (with or without --draft)")
    parser.add_argument("--draft")
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--blocks", default="2,4,8,16")
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = DFlash.from_pretrained(args.target or (ASSETS / "target" if args.draft else None), args.draft)
    for rows in (int(r) for r in args.rows.split(",")):
        for block in (int(k) for k in args.blocks.split(",")):
            print(json.dumps({"rows": rows, "block_size": block, "context": args.context,
                              **best_ms(pipe, rows, block, args.context, args.repeats)}), flush=True)


if __name__ == "__main__":
    main()
