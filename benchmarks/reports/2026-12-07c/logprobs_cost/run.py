"""What log-probabilities cost a decode: the embedded pair on GSM8K test questions, greedy, block auto, one prompt
at a time, with logprobs=5 (and prompt_logprobs=5) and without, in alternating rounds.

python benchmarks/reports/2026-12-07c/logprobs_cost/run.py [--questions 12] [--rounds 3]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dflash import DFlash
from dflash.bench.datasets import DataOptions, load_samples

parser = argparse.ArgumentParser()
parser.add_argument("--questions", type=int, default=12)
parser.add_argument("--rounds", type=int, default=3)
args = parser.parse_args()
torch.set_num_threads(2)
pipe = DFlash.from_pretrained()
prompts = [s.turns[0] for s in load_samples("gsm8k", DataOptions(max_samples=args.questions))]
settings = {"without": {}, "logprobs=5": {"logprobs": 5}, "logprobs=5, prompt_logprobs=5": {"logprobs": 5,
                                                                                          "prompt_logprobs": 5}}
pipe.generate(prompts[0], max_new_tokens=32)  # warm-up
rates: dict[str, list[float]] = {name: [] for name in settings}
outputs: dict[str, list] = {}
for _ in range(args.rounds):
    for name, options in settings.items():
        tokens, start = 0, time.perf_counter()
        outs = [pipe.generate(p, max_new_tokens=256, block_size="auto", **options) for p in prompts]
        elapsed = time.perf_counter() - start
        rates[name].append(sum(len(o.output_ids) for o in outs) / elapsed)
        outputs[name] = [o.output_ids for o in outs]
same = all(outputs[name] == outputs["without"] for name in settings)
result = {name: {"tokens_per_s": r, "median": statistics.median(r)} for name, r in rates.items()}
result["identical_outputs"] = same
print(json.dumps(result, indent=1))
(Path(__file__).parent / "result.json").write_text(json.dumps(result, indent=1) + "\n")
