"""What a row joining or leaving a batch costs: the membership change itself, then the next step.

A server decodes its requests in one batch; a request that arrives joins it between steps (`engine.merge`)
and a finished one leaves it (`engine.select_rows`). Both rewrite the batch's KV caches. This script builds
a batch of `--rows` rows holding `--context` tokens each, then times, median of `--repeats`:
- `step`: a step with no change (the reference);
- `join`: merging a freshly prefilled row into the batch (without one row), and the step after it;
- `leave`: dropping one row from the middle of the batch, and the step after it.
The step after a change is timed apart because a change that leaves the caches without spare room makes
that step copy them again.

    python benchmarks/batch_membership.py [--rows 8] [--context 1000] [--block-size 16] [--threads 2]

To compare with an older version of the package, run it with `PYTHONPATH` pointing at a checkout of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dflash.api import DFlash
from dflash.decoding.engine import GenerationConfig
from dflash.decoding.proposer import NoDraftProposer


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - start) * 1000


def new_row(engine, proposer, context: int, salt: int):
    vocab = engine.target.vocab_size
    prompt = [(7 * i + 11 * salt + 3) % vocab for i in range(context)]  # any valid ids: only the time counts
    config = GenerationConfig(max_new_tokens=20 * proposer.block_size, ignore_eos=True)
    return engine.prefill(engine.new_sequence(prompt, config), proposer)


def batch_of(engine, proposer, rows: int, context: int):
    batch = engine.merge([new_row(engine, proposer, context, salt) for salt in range(rows)])
    for _ in range(3):  # rows accept different counts: the caches get holes, as a server's do
        engine.step(batch)
    return batch


def one_round(engine, proposer, rows: int, context: int) -> dict[str, float]:
    batch = batch_of(engine, proposer, rows - 1, context)
    joining = new_row(engine, proposer, context, rows)
    batch, join_ms = timed(lambda: engine.merge([batch, joining]))
    _, step_after_join_ms = timed(lambda: engine.step(batch))
    _, step_ms = timed(lambda: engine.step(batch))
    keep = [i for i in range(len(batch)) if i != rows // 2]
    batch, leave_ms = timed(lambda: engine.select_rows(batch, keep))
    _, step_after_leave_ms = timed(lambda: engine.step(batch))
    return {"step_ms": step_ms, "join_ms": join_ms, "step_after_join_ms": step_after_join_ms,
            "leave_ms": leave_ms, "step_after_leave_ms": step_after_leave_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="default: the embedded target (with its drafter unless --block-size 1)")
    parser.add_argument("--draft")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=1000, help="tokens each row holds")
    parser.add_argument("--block-size", type=int, default=16, help="1: plain steps (no drafter)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engine = DFlash.from_pretrained(args.target, args.draft).engine
    proposer = NoDraftProposer() if args.block_size == 1 else engine.proposer.with_block_size(args.block_size)
    one_round(engine, proposer, args.rows, args.context)  # warm-up
    rounds = [one_round(engine, proposer, args.rows, args.context) for _ in range(args.repeats)]
    medians = {key: round(statistics.median(r[key] for r in rounds), 2) for key in rounds[0]}
    print(json.dumps({"rows": args.rows, "context": args.context, "block_size": args.block_size,
                      "threads": args.threads, **medians}))


if __name__ == "__main__":
    main()
