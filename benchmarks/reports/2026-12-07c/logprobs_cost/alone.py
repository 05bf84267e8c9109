"""`token_logprobs` timed alone: a step's log-probabilities for one row, over a (16, 4,096) logits tensor (the
embedded target's vocabulary), torch 2 threads, 2,000 calls each; writes alone.json.

python benchmarks/reports/2026-12-07c/logprobs_cost/alone.py
"""

import json
import timeit
from pathlib import Path

import torch

from dflash.decoding.logprobs import token_logprobs

torch.set_num_threads(2)
logits = torch.randn(16, 4096)  # (positions, vocab)
tokens = list(range(5, 21))
result = {}
for n, top in [(1, 0), (5, 5), (16, 5), (16, 20)]:
    seconds = timeit.timeit(lambda n=n, top=top: token_logprobs(logits[:n], tokens[:n], top), number=2000) / 2000
    result[f"{n} tokens, top {top}"] = round(seconds * 1e6, 1)  # us
print(json.dumps(result, indent=1))
(Path(__file__).parent / "alone.json").write_text(json.dumps(result, indent=1) + "\n")
