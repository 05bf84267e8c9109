"""What stop strings and streaming cost per generated token on a long answer (the long-use audit's measurement).

Feeds a long output (GSM8K test answers, joined) to the stop checker and the stream's text deltas in steps of a
few tokens, as drafted steps give them, and times both: once with a few short stop strings, once with 16 stop
strings of 1,000 characters (the server's limit). Neither may grow with the output's length.

    python benchmarks/stop_strings.py [--tokens 2000] [--step 4] [--target DIR]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from transformers import AutoTokenizer

from dflash.api import DEFAULT_TARGET
from dflash.decoding.detokenizer import TextDeltas
from dflash.decoding.stopping import StopChecker

GSM8K_TEST = Path(__file__).resolve().parents[1] / "dflash" / "bench" / "data" / "gsm8k" / "test.jsonl"
SHORT_STOPS = ["Question:", "\n\n\n"]
LONG_STOPS = [("x" * 999) + str(i) for i in range(10)] + ["9" * 1000, "a" * 1000, ". " * 500, "e" * 1000,
                                                          "5" * 1000, "0" * 1000]


def long_output(tokenizer, tokens: int) -> list[int]:
    ids: list[int] = []
    with GSM8K_TEST.open() as f:
        for line in f:
            record = json.loads(line)
            ids += tokenizer(record.get("answer") or record.get("prompt", ""), add_special_tokens=False)["input_ids"]
            if len(ids) >= tokens:
                return ids[:tokens]
    raise SystemExit(f"{GSM8K_TEST} holds fewer than {tokens} tokens of answers")


def measure(tokenizer, ids: list[int], stops: list[str], step: int) -> dict:
    deltas, checker = TextDeltas(tokenizer, stops), StopChecker([], stops, len(ids) + 1, tokenizer)
    started = time.perf_counter()
    for i in range(0, len(ids), step):
        deltas.add(ids[i: i + step])
    streamed = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(0, len(ids), step):
        checker.check(ids[:i], ids[i: i + step])
    return {"stop_strings": len(stops), "longest": max(map(len, stops)), "stream_deltas_s": round(streamed, 3),
            "stop_checks_s": round(time.perf_counter() - started, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(DEFAULT_TARGET), help="the tokenizer's model (default: embedded)")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--step", type=int, default=4, help="tokens per decode step")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    ids = long_output(tokenizer, args.tokens)
    for stops in (SHORT_STOPS, LONG_STOPS):
        print(json.dumps({"tokens": len(ids), "step": args.step, **measure(tokenizer, ids, stops, args.step)}))


if __name__ == "__main__":
    main()
