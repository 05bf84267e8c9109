"""Checks lm-eval's log-likelihoods from `dflash serve` against one transformers forward of the embedded target.

python benchmarks/reports/2026-12-07c/lm_eval/verify.py OUTPUT_DIR...  (lm_eval --log_samples --output_path dirs)
For every loglikelihood request in the samples: the sum of the continuation tokens' log-probabilities given the
context, and whether each is the most likely token, computed directly; prints the largest difference.
"""

import glob
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

TARGET = Path(__file__).resolve().parents[4] / "dflash" / "assets" / "target"
torch.set_num_threads(1)
tokenizer = AutoTokenizer.from_pretrained(TARGET)
model = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


def loglikelihood(context: str, continuation: str) -> tuple[float, bool]:
    """As lm-eval encodes it: trailing whitespace of the context moves to the continuation."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    cont = tokenizer(continuation, add_special_tokens=False).input_ids
    with torch.no_grad():
        logprobs = model(torch.tensor([ctx + cont])).logits[0].float().log_softmax(-1)
    rows = logprobs[len(ctx) - 1 : len(ctx) - 1 + len(cont)]
    return sum(rows[i, t].item() for i, t in enumerate(cont)), all(rows[i].argmax().item() == t
                                                                      for i, t in enumerate(cont))


for out_dir in sys.argv[1:]:
    for path in sorted(glob.glob(f"{out_dir}/**/samples_*.jsonl", recursive=True)):
        worst, requests, greedy_differs = 0.0, 0, 0
        for line in open(path):
            sample = json.loads(line)
            for args, resp in zip(sample["arguments"].values(), sample["resps"]):
                if "arg_1" not in args:  # a rolling request: checked by the bits_per_byte figure only
                    continue
                got, got_greedy = float(resp[0][0]), resp[0][1] in (True, "True")
                want, want_greedy = loglikelihood(args["arg_0"], args["arg_1"])
                worst, requests = max(worst, abs(got - want)), requests + 1
                greedy_differs += got_greedy != want_greedy
        if requests:
            print(f"{Path(path).name}: {requests} requests, largest difference {worst:.2e}, "
                  f"is_greedy differs in {greedy_differs}")
