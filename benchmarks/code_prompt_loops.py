"""How often targets loop on the code prompts (HumanEval, MBPP): the share of greedy answers in which some 10-token
sequence occurs 3+ times or that never stop (the calibrated loop criterion, `scripts/embedded/loops.py`).

    python benchmarks/code_prompt_loops.py --targets DIR [DIR ...] [--max-samples 20] [--max-new-tokens 256]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "embedded"))
from loops import is_loop  # noqa: E402

from dflash.api import DFlash  # noqa: E402
from dflash.bench.datasets import DataOptions, load_samples  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", required=True)
    parser.add_argument("--datasets", nargs="+", default=["humaneval", "mbpp"])
    parser.add_argument("--max-samples", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="also write the counts here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    counts = {}
    for target in args.targets:
        pipe = DFlash.from_pretrained(target, no_draft=True)
        eos = pipe.tokenizer.eos_token_id
        for dataset in args.datasets:
            samples = load_samples(dataset, DataOptions(max_samples=args.max_samples))
            loops = 0
            for sample in samples:
                out = pipe.generate(sample.turns[0], max_new_tokens=args.max_new_tokens)
                loops += is_loop(out.output_ids, eos)[0]
            counts[f"{target}/{dataset}"] = loops
            print(f"{target} {dataset}: {loops} of {len(samples)} answers loop", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(counts, indent=1) + "\n")


if __name__ == "__main__":
    main()
