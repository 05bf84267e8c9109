"""Is an acceptance length flattered by loops? Tau over the answers that loop and over those that do not.

Repetition is easy to draft, so a looping target can inflate tau. This script decodes GSM8K test questions
greedily with a pair and splits the verify steps by whether their answer loops (the calibrated criterion of
`scripts/embedded/loops.py`: a 10-token sequence 3+ times, or no EOS), printing the steps and tau of each
part as one JSON object.

    python benchmarks/tau_by_loops.py [--target DIR --draft DIR] [--max-samples 200] [--block-size 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pair_options import add_pair_options, load_pair

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "embedded"))
from loops import is_loop  # noqa: E402

from dflash.bench.datasets import DataOptions, load_samples  # noqa: E402


def part(answers: int, steps: list[int]) -> dict:
    return {"answers": answers, "verify_steps": len(steps), "tau": round(sum(steps) / len(steps), 3) if steps else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, max_samples=200)
    args = parser.parse_args()
    pipe = load_pair(args)
    eos = pipe.tokenizer.eos_token_id
    steps: dict[bool, list[int]] = {True: [], False: []}
    answers = {True: 0, False: 0}
    for sample in load_samples(args.dataset, DataOptions(max_samples=args.max_samples)):
        out = pipe.generate(sample.turns[0], max_new_tokens=args.max_new_tokens, block_size=args.block_size)
        loops = bool(is_loop(out.output_ids, eos)[0])
        answers[loops] += 1
        steps[loops] += out.stats.acceptance_lengths[1:]  # entry 0 is the prefill's token, not a verify step
    result = {"dataset": args.dataset, "block_size": args.block_size,
              "all": part(answers[True] + answers[False], steps[True] + steps[False]),
              "no_loop": part(answers[False], steps[False]), "loop": part(answers[True], steps[True])}
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
