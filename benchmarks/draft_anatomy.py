"""Where a draft's time goes during real decoding: the parts of `DFlashProposer.propose`, timed in place.

Decodes GSM8K test questions one at a time (greedy, the drafter's full block) with timers wrapped around the
proposer's own calls: the drafter's forward, the draft logits (the LM head), DFlash2's candidate lattice, and the
path through it (or each position's top-1 for a DFlash drafter); "prepare" is the rest of `propose` (the block and
the new context). Prints the median of each part over every draft, and the decode's tokens/s and tau.

    python benchmarks/draft_anatomy.py [--target DIR --draft DIR] [--questions 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from dflash.api import ASSETS, DFlash
from dflash.bench.datasets import DataOptions, load_samples
from dflash.decoding import proposer as proposer_module
from dflash.decoding.proposer import DFlashProposer


def timed(fn, times: list[float]):
    """`fn`, appending each call's wall time (ms) to `times`."""

    def call(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        times.append((time.perf_counter() - start) * 1000)
        return out

    return call


def time_the_parts(proposer: DFlashProposer) -> dict[str, list[float]]:
    """Wrap the calls `propose` makes (and `propose` itself) in timers; returns the lists they fill."""
    times: dict[str, list[float]] = defaultdict(list)
    drafter = proposer.drafter
    drafter.forward = timed(drafter.forward, times["forward"])  # nn.Module.__call__ finds the instance's forward
    proposer.draft_logits = timed(proposer.draft_logits, times["logits"])
    if drafter.selector is not None:
        drafter.selector.lattice = timed(drafter.selector.lattice, times["lattice"])
        proposer_module.draft_along_path = timed(proposer_module.draft_along_path, times["path"])
    else:
        proposer_module.draft_per_position = timed(proposer_module.draft_per_position, times["path"])
    proposer.propose = timed(proposer.propose, times["total"])
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="default: the embedded target")
    parser.add_argument("--draft", help="a DFlash drafter (default: the embedded one)")
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-dir", help="default: the bundled copies")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = DFlash.from_pretrained(args.target or (ASSETS / "target" if args.draft else None), args.draft, device="cpu")
    if not isinstance(pipe.engine.proposer, DFlashProposer):
        parser.error("--draft must be a DFlash drafter")
    samples = load_samples("gsm8k", DataOptions(data_dir=args.data_dir, max_samples=args.questions))
    prompts = [sample.turns[0] for sample in samples]
    pipe.generate(prompts[0], max_new_tokens=16, block_size=None)  # warm-up, untimed
    times = time_the_parts(pipe.engine.proposer)
    tokens = steps = 0
    start = time.perf_counter()
    for prompt in prompts:
        out = pipe.generate(prompt, max_new_tokens=args.max_new_tokens, block_size=None)
        tokens, steps = tokens + len(out.output_ids), steps + len(out.stats.acceptance_lengths) - 1
    elapsed = time.perf_counter() - start
    medians = {part: statistics.median(v) for part, v in times.items()}
    medians["prepare"] = medians["total"] - sum(v for part, v in medians.items() if part != "total")
    report = {"questions": len(prompts), "drafts": len(times["total"]), "tokens": tokens,
              "tau": round(tokens / max(steps, 1), 3), "tokens_per_s": round(tokens / elapsed, 1),
              "median_ms": {part: round(v, 3) for part, v in medians.items()},
              "target": str(args.target or Path(ASSETS / "target")), "draft": args.draft or "the embedded drafter"}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
