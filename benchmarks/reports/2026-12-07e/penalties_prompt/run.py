"""One row-step of the repetition, frequency and presence penalties (16 slots, a 152k vocabulary, a 4,000-token
prompt, 200 output tokens, 15 draft tokens), with the code before the prompt's index was made once
(`penalties_before.py`: the prompt's set unioned, sorted and indexed at every step) and after: the time of a call,
and the largest difference between their logits.

    python benchmarks/reports/2026-12-07e/penalties_prompt/run.py
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[3]))

from dflash.decoding import penalties as after  # noqa: E402


def before_module():
    spec = importlib.util.spec_from_file_location("penalties_before", HERE / "penalties_before.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["penalties_before"] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(2)
    prompt = torch.randint(0, 150000, (4000,)).tolist()
    output = torch.randint(0, 150000, (200,)).tolist()
    drafted = torch.randint(0, 150000, (15,)).tolist()
    logits = torch.randn(16, 152000)  # (q, vocab)
    sees = torch.ones(16, 16, dtype=torch.bool).tril()[:, 1:]  # (q, q - 1): slot i sees the draft tokens before it
    results = {}
    for name, module in (("before", before_module()), ("after", after)):
        counts = module.TokenCounts(prompt)
        counts.add(output)
        penalties = module.Penalties(0.5, 0.3, 1.2)
        penalized = logits.clone()
        module._penalize_row(penalized, penalties, counts, drafted, sees)
        results[name] = penalized
        start = time.perf_counter()
        for _ in range(50):
            module._penalize_row(logits.clone(), penalties, counts, drafted, sees)
        print(f"{name}: {(time.perf_counter() - start) / 50 * 1e3:.2f} ms a row-step (with a 9.7 MB clone)")
    print("largest difference", (results["before"] - results["after"]).abs().max().item())


if __name__ == "__main__":
    main()
