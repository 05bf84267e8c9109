"""What presence, frequency and repetition penalties do to DFlash: speed, acceptance and losslessness.

One pipeline, one process, one greedy row at a time. For each penalty setting, these ways decode every question,
taking turns (the order alternates) so that machine noise hits all alike:
- plain: the target alone, with the penalties (the reference: DFlash must give its tokens);
- dflash: as it ships, the drafter drafting as without penalties (`dflash.decoding.penalties`);
- penalized-drafts: each draft position penalized as the output so far stands, to measure what that is worth.
For each: tau (tokens per verify forward), decode tokens/s (the steps' own time, the prefill left out), and how
many outputs equal plain decoding's (all must). `--per-position` drops a DFlash2 drafter's candidate selector, so
that each position's draft token is its own top-1, as a DFlash drafter's is.

At d28ca30 the drafters penalized their drafts (DFlash and draft models counting their own draft tokens before
each position too): benchmarks/reports/2026-12-07d/penalties holds what this script measured there, and why they
no longer do.

    python benchmarks/penalties.py [--settings none,p0.5f0.5,r1.1] [--max-samples 20] [--per-position] [--json FILE]

A setting is `none` or letters and values: p (presence), f (frequency), r (repetition), e.g. p0.5f0.5 or r1.1.
"""

from __future__ import annotations

import argparse
import json
import re
from unittest import mock

from pair_options import add_pair_options, first_turn_prompts, load_pair

from dflash.decoding import proposer as proposers
from dflash.decoding.choice import choice_logits
from dflash.decoding.engine import GenerationConfig, SpeculativeEngine

NAMES = {"p": "presence_penalty", "f": "frequency_penalty", "r": "repetition_penalty"}


def parse_setting(text: str) -> dict[str, float]:
    if text == "none":
        return {}
    pairs = re.findall(r"([pfr])(-?[0-9.]+)", text)
    if "".join(a + b for a, b in pairs) != text:
        raise SystemExit(f"a setting is none or letters p/f/r with values, like p0.5f0.5; got {text!r}")
    return {NAMES[letter]: float(value) for letter, value in pairs}


def decode(pipe, plain: SpeculativeEngine, way: str, prompt: list[int], config: GenerationConfig):
    if way == "plain":
        return plain.generate([prompt], config)[0]
    if way == "penalized-drafts":
        with mock.patch.object(proposers, "add_logit_bias", choice_logits):
            return pipe.engine.generate([prompt], config)[0]
    return pipe.engine.generate([prompt], config)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default="none,p0.5f0.5,p1.5,r1.1")
    parser.add_argument("--per-position", action="store_true")
    add_pair_options(parser, max_samples=20, seed=1)
    args = parser.parse_args()
    pipe = load_pair(args)
    prompts = first_turn_prompts(args, pipe)
    plain = SpeculativeEngine(pipe.target)
    ways = ["plain", "dflash", "penalized-drafts"]
    if args.per_position and hasattr(pipe.engine.proposer.drafter, "candidate_selector"):
        del pipe.engine.proposer.drafter.candidate_selector
    settings = [s.strip() for s in args.settings.split(",")]
    report: dict[str, dict] = {}
    unpenalized: list[list[int]] | None = None
    for setting in settings:
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size,
                                  **parse_setting(setting))
        for way in ways:  # warm-up
            decode(pipe, plain, way, prompts[0], GenerationConfig(**{**config.__dict__, "max_new_tokens": 16}))
        totals = {w: {"tokens": 0, "steps": 0, "seconds": 0.0, "outputs": []} for w in ways}
        for i, prompt in enumerate(prompts):
            for way in ways if i % 2 == 0 else ways[::-1]:
                out = decode(pipe, plain, way, prompt, config)
                t = totals[way]
                t["tokens"] += sum(out.stats.acceptance_lengths[1:])  # decoded after the prefill's token
                t["steps"] += len(out.stats.acceptance_lengths) - 1
                t["seconds"] += out.stats.decode_time_s
                t["outputs"].append(out.output_ids)
        reference = totals["plain"]["outputs"]
        if setting == "none":
            unpenalized = reference
        changed = None if unpenalized is None else sum(a != b for a, b in zip(reference, unpenalized))
        row = {"outputs_changed_by_the_penalties": changed,  # against setting none's, where it ran before
               "mean_output_tokens": round(sum(map(len, reference)) / len(reference), 1)}
        for way, t in totals.items():
            row[way] = {"tokens_per_s": round(t["tokens"] / t["seconds"], 1),
                        "same_as_plain": sum(a == b for a, b in zip(t["outputs"], reference))}
            if way != "plain":
                row[way]["tau"] = round(t["tokens"] / t["steps"], 3)
                row[way]["speedup"] = round(row[way]["tokens_per_s"] / row["plain"]["tokens_per_s"], 2)
        report[setting] = row
        print(f"{setting:10s} {json.dumps(row)}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"questions": len(prompts), "dataset": args.dataset, "block_size": args.block_size,
                       "per_position": args.per_position, "settings": report}, f, indent=1)


if __name__ == "__main__":
    main()
