"""What structured output does to DFlash: speed, acceptance, losslessness, and whether answers keep the structure.

One pipeline, one process, one greedy row at a time. For each structure (none, a JSON schema, a regex), plain
decoding (the target alone, with the same structure) and DFlash decode every question, taking turns (the order
alternates) so that machine noise hits both alike. For each: tau (tokens per verify forward), decode tokens/s
(the steps' own time, the prefill left out), how many outputs equal plain decoding's (all must) and how many
answers that ended (not cut at max_new_tokens) match the structure.

    python benchmarks/structured.py [--max-samples 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import re

from pair_options import add_pair_options, first_turn_prompts, load_pair

from dflash.decoding.engine import GenerationConfig, SpeculativeEngine

# compact JSON (llguidance's option): with any whitespace allowed between items (the default, as vLLM's), the
# embedded target, which never saw JSON, writes newlines after the brace until max_new_tokens
SCHEMA = {"type": "object", "properties": {"steps": {"type": "string"}, "answer": {"type": "integer"}},
          "required": ["steps", "answer"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
REGEX = r"[^\n]{1,200}\nThe answer is [0-9]{1,6}\."
STRUCTURES = {"none": {}, "json_schema": {"json_schema": SCHEMA}, "regex": {"regex": REGEX}}


def keeps(structure: str, text: str) -> bool:
    if structure == "json_schema":
        try:
            answer = json.loads(text)
        except ValueError:
            return False
        return set(answer) == {"steps", "answer"} and isinstance(answer["answer"], int)
    if structure == "regex":
        return re.fullmatch(REGEX, text) is not None
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, max_samples=20, seed=1)
    args = parser.parse_args()
    pipe = load_pair(args)
    prompts = first_turn_prompts(args, pipe)
    engines = {"plain": SpeculativeEngine(pipe.target), "dflash": pipe.engine}
    report = {}
    for structure, options in STRUCTURES.items():
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size, **options)
        for engine in engines.values():  # warm-up
            engine.generate([prompts[0]], GenerationConfig(**{**config.__dict__, "max_new_tokens": 16}))
        totals = {w: {"tokens": 0, "steps": 0, "seconds": 0.0, "outputs": []} for w in engines}
        ended = kept = 0
        for i, prompt in enumerate(prompts):
            for way in list(engines) if i % 2 == 0 else list(engines)[::-1]:
                out = engines[way].generate([prompt], config)[0]
                t = totals[way]
                t["tokens"] += sum(out.stats.acceptance_lengths[1:])  # decoded after the prefill's token
                t["steps"] += len(out.stats.acceptance_lengths) - 1
                t["seconds"] += out.stats.decode_time_s
                t["outputs"].append(out.output_ids)
                if way == "dflash" and out.finish_reason == "stop":
                    ended += 1
                    kept += keeps(structure, out.text)
        plain, ours = totals["plain"], totals["dflash"]
        row = {"tau": round(ours["tokens"] / ours["steps"], 3),
               "dflash_tokens_per_s": round(ours["tokens"] / ours["seconds"], 1),
               "plain_tokens_per_s": round(plain["tokens"] / plain["seconds"], 1),
               "same_as_plain": sum(a == b for a, b in zip(ours["outputs"], plain["outputs"])),
               "answers_ended": ended, "ended_answers_keeping_the_structure": kept,
               "mean_output_tokens": round(sum(map(len, ours["outputs"])) / len(prompts), 1)}
        row["speedup"] = round(row["dflash_tokens_per_s"] / row["plain_tokens_per_s"], 2)
        report[structure] = row
        print(f"{structure:12s} {json.dumps(row)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"questions": len(prompts), "dataset": args.dataset, "block_size": args.block_size,
                       "schema": SCHEMA, "regex": REGEX, "structures": report}, f, indent=1)


if __name__ == "__main__":
    main()
