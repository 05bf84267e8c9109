"""Decode-step times of a batch: plain steps and drafted steps of each block size, at several row counts.

What a server step costs once its rows have a realistic context (a prompt and part of an answer): every row
holds `--context` tokens, then steps are timed (median). Prints one JSON line per (rows, block size); block
size 1 is a plain step (no drafter). With `--profile ROWSxBLOCK` it also prints the operators that took the
most time in that shape (torch.profiler), which is how the KV-cache copies were found.

    python benchmarks/batched_step.py --rows 1,4,8 --context 400 [--threads 2] [--profile 8x2] [--keep-layout]
        [--temperature 1.0 [--top-p 0.95] [--seed 0]]

`--keep-layout` keeps every weight row-major (what `nn.Linear` makes) instead of the layout `dflash` measures
faster on this CPU (`dflash/model/cpu_layout.py`), to see what that choice is worth. To compare with an older
version of the package, run this script with `PYTHONPATH` pointing at a checkout of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dflash.api import ASSETS, DFlash
from dflash.decoding.engine import GenerationConfig
from dflash.decoding.proposer import NoDraftProposer

SAMPLING: dict = {}  # --temperature, --top-p, --seed: how every row decodes (greedy by default)


def batch_at_context(engine, proposer, rows: int, context: int, max_new_tokens: int):
    vocab = engine.target.vocab_size
    prompt = [(7 * i + 11) % vocab for i in range(context)]  # any valid ids: only the time counts
    config = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True, **SAMPLING)
    return engine.merge([engine.prefill(engine.new_sequence(prompt, config), proposer) for _ in range(rows)])


def step_time_ms(engine, proposer, rows: int, context: int, repeats: int) -> float:
    batch = batch_at_context(engine, proposer, rows, context, (repeats + 4) * proposer.block_size)
    for _ in range(3):  # warm-up at this shape
        engine.step(batch)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.step(batch)
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def profile(engine, proposer, rows: int, context: int, top: int = 12) -> None:
    batch = batch_at_context(engine, proposer, rows, context, 20 * proposer.block_size)
    for _ in range(3):
        engine.step(batch)
    steps = 5
    with torch.profiler.profile(record_shapes=True) as prof:
        for _ in range(steps):
            engine.step(batch)
    events = sorted(prof.key_averages(group_by_input_shape=True), key=lambda e: -e.self_cpu_time_total)[:top]
    for e in events:
        print(f"  {e.self_cpu_time_total / steps / 1000:6.2f} ms/step  {e.count / steps:5.1f} calls/step  "
              f"{e.key}  {str(e.input_shapes)[:100]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="default: the embedded target (with or without --draft)")
    parser.add_argument("--draft")
    parser.add_argument("--rows", default="1,4,8", help="row counts, comma-separated")
    parser.add_argument("--block-sizes", default="2,4,8,16")
    parser.add_argument("--context", type=int, default=400, help="tokens each row holds before the timed steps")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", help="ROWSxBLOCK, e.g. 8x2 (block 1 = plain)")
    parser.add_argument("--keep-layout", action="store_true", help="keep row-major weights (no layout choice)")
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (both models)")
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: every row samples (default greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, help="sampling rows seeded (each row's noise its own positions'); "
                                                 "default: unseeded rejection sampling")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    SAMPLING.update(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if args.keep_layout:
        import dflash.api

        dflash.api.use_fast_layout = lambda modules: 0
    target = args.target or (ASSETS / "target" if args.draft else None)
    pipe = DFlash.from_pretrained(target, args.draft, dtype=args.dtype)
    engine = pipe.engine

    def proposer_for(block: int):
        return NoDraftProposer() if block == 1 else engine.proposer.with_block_size(block)

    if args.profile:
        rows, block = (int(x) for x in args.profile.lower().split("x"))
        print(f"profile: {rows} rows x block {block}, context {args.context}")
        profile(engine, proposer_for(block), rows, args.context)
        return
    blocks = [1] + [int(k) for k in args.block_sizes.split(",")]
    for rows in (int(r) for r in args.rows.split(",")):
        for block in blocks:
            ms = step_time_ms(engine, proposer_for(block), rows, args.context, args.repeats)
            print(json.dumps({"rows": rows, "block_size": block, "context": args.context, "step_ms": round(ms, 2),
                              "threads": args.threads, "dtype": args.dtype, **SAMPLING}), flush=True)


if __name__ == "__main__":
    main()
