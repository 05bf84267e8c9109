"""Why `dflash serve` decodes on its main thread: the same decode on the thread that loaded the models and on
a second thread (the layout the server had before).

Torch keeps one OpenMP thread pool per thread that runs ops. Once the main thread has run ops (loading,
warm-up), decoding on another thread makes a second pool; with more pool threads than cores, libgomp stops
spinning between parallel regions, and every op's workers sleep and wake.

    python benchmarks/decode_thread.py [--prompts 4] [--max-new-tokens 256] [--repeats 2]

Prints one JSON object: tokens/s of greedy DFlash and plain decoding of GSM8K test questions (the embedded
pair), on the main thread and on a second thread, alternating so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

from dflash.api import DFlash
from dflash.bench.datasets import DataOptions, load_samples
from dflash.decoding.engine import GenerationConfig, SpeculativeEngine


def tokens_per_s(engine: SpeculativeEngine, prompts: list[list[int]], max_new_tokens: int) -> float:
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    start, tokens = time.perf_counter(), 0
    for prompt in prompts:
        tokens += engine.generate([prompt], config)[0].stats.num_output_tokens
    return tokens / (time.perf_counter() - start)


def on_a_second_thread(fn, *args) -> float:
    result = {}
    thread = threading.Thread(target=lambda: result.update(value=fn(*args)))
    thread.start()
    thread.join()
    return result["value"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()

    pipe = DFlash.from_pretrained()
    samples = load_samples("gsm8k", DataOptions(max_samples=args.prompts))
    prompts = [pipe.encode(s.turns[0]) for s in samples]
    engines = {"dflash": pipe.engine, "plain": SpeculativeEngine(pipe.target)}
    results: dict[str, list[float]] = {}
    for engine in engines.values():
        tokens_per_s(engine, prompts[:1], 32)  # warm-up on the main thread, as `dflash serve` does
    for _ in range(args.repeats):
        for name, engine in engines.items():
            results.setdefault(f"{name}_main_thread", []).append(tokens_per_s(engine, prompts, args.max_new_tokens))
            results.setdefault(f"{name}_second_thread", []).append(
                on_a_second_thread(tokens_per_s, engine, prompts, args.max_new_tokens))
    print(json.dumps({key: round(sum(v) / len(v), 1) for key, v in results.items()}, indent=2))


if __name__ == "__main__":
    main()
