"""Keep the target's own answers that are fit to train on again (self-distillation, phase 4).

Reads `dflash datagen` output (the target's greedy answers to training questions) and keeps an answer when
it stopped on EOS, ends with a boxed answer, and no 10-gram of its tokens occurs 3+ times (the calibrated
loop criterion of `eval_target.py`). Writes the kept rows unchanged: `train_target.py --extra-train` reads
their `messages`.

    python scripts/embedded/select_own_answers.py runs/embedded/gsm8k_train_regenerated.jsonl \
        runs/embedded/gsm8k_train_perturbed4.jsonl --out runs/embedded/own_answers.jsonl
"""
import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_target import BOXED_END  # noqa: E402
from loops import K, N, repeats  # noqa: E402


def verdict(row: dict) -> str:
    """'keep', or why the answer is left out."""
    if row.get("finish_reason") != "stop":
        return "no EOS"
    if repeats(row["response_ids"], N, K):
        return f"a {N}-gram occurs {K}+ times"
    if not BOXED_END.search(row["messages"][-1]["content"]):
        return "no boxed answer at the end"
    return "keep"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    counts: Counter[str] = Counter()
    with open(args.out, "w") as out:
        for path in args.inputs:
            with open(path) as rows:
                for line in filter(str.strip, rows):
                    why = verdict(json.loads(line))
                    counts[why] += 1
                    if why == "keep":
                        out.write(line if line.endswith("\n") else line + "\n")
    print(json.dumps(dict(counts), indent=1))


if __name__ == "__main__":
    main()
