"""Is the drafter or the target the limit? Acceptance of draft tokens against the target's own confidence.

A drafter predicts the target's greedy tokens. Where the target is sure of its token (top-1 probability near 1)
a good drafter should match it almost always; where the target hesitates between tokens, its choice hangs on
details of its full computation that a small drafter only approximates. This script decodes a dataset's
prompts greedily (block `--block-size`), then gives, for every draft position the target judged, the target's
top-1 probability at that token (one extra target forward over each finished answer) and whether the draft
token was accepted, binned by that probability:

- acceptance well below 1 in the top bins: the drafter has room to learn (more data, training, capacity);
- most judged positions in the low bins: the target's own uncertainty caps the acceptance length, whatever
  the drafter.

Decoding starts its blocks where the last one missed, which is where the target hesitates. With
`--random-anchors K` the script also starts K blocks per answer at random tokens of it (the prompt plus the
answer before that token as context, exactly as decoding would have it) and gives the same table for them.
The main table counts every decoding step, while the random blocks are K per answer and must end before the
answer's last token; `--replay-decoding-anchors K` samples K decoding steps per answer under that same rule, so
those two tables compare like with like (lower acceptance at decoding anchors *within the same confidence bin*
would say the drafter is weaker where decoding needs it than training at random anchors measures). It also
redrafts each sampled block from a fresh prefill at its anchor, without the drafter's cache: the verdicts must
be the same. Each table also breaks down the tokens the target is sure of by its confidence at the anchor.

    python benchmarks/acceptance_by_confidence.py [--target DIR --draft DIR] [--dataset gsm8k]
        [--max-samples 40] [--block-size 16] [--max-new-tokens 256] [--random-anchors K]
        [--replay-decoding-anchors K] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass

import torch
from pair_options import add_pair_options, load_pair

from dflash.api import DFlash
from dflash.bench.datasets import DataOptions, load_samples
from dflash.decoding.engine import GenerationConfig, GenerationOutput

BIN_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)


@dataclass
class Judged:
    confidence: float  # the target's top-1 probability at the drafted token's position
    accepted: bool
    position: int  # 1 = the first draft token of its block
    anchor_confidence: float  # the target's top-1 probability when it chose the block's anchor token


def target_confidence(pipe: DFlash, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """[i] = the target's top-1 probability when it chose output token i (one forward over the whole answer)."""
    ids = torch.tensor([prompt_ids + output_ids])  # (1, T)
    positions = torch.arange(ids.shape[1])[None]
    out = pipe.target.forward(ids, positions, pipe.target.new_cache())
    probs = out.logits[0, len(prompt_ids) - 1: -1].softmax(-1)  # (len(output), vocab)
    return probs.max(-1).values.tolist()


def decoding_steps(output: GenerationOutput) -> list[tuple[int, int]]:
    """(first, kept) of every decoding step but the last: the step kept `kept` tokens, the first of them output token
    `first` (its anchor is output token first - 1; the prefill's token was not drafted). The last step is left out:
    a stop or the token limit may have cut its tokens, so how many it kept does not say where the rejection was."""
    lengths, steps = output.stats.acceptance_lengths, []
    first = lengths[0]
    for kept in lengths[1:-1]:
        steps.append((first, kept))
        first += kept
    return steps


def judged_positions(output: GenerationOutput, confidence: list[float], block_size: int) -> list[Judged]:
    """Every draft token the target judged, step by step (`judge_step`)."""
    return [j for first, kept in decoding_steps(output) for j in judge_step(confidence, first, kept, block_size)]


def judge_step(confidence: list[float], first: int, kept: int, block_size: int) -> list[Judged]:
    """A step that kept `kept` tokens, the first of them output token `first`: draft tokens 1..kept-1 were
    accepted, draft token `kept` (if the block had one) was rejected."""
    anchor = confidence[first - 1]
    return [Judged(confidence[first + j], accepted=j < kept - 1, position=j + 1, anchor_confidence=anchor)
            for j in range(min(kept, block_size - 1))]


def random_anchor_judged(pipe: DFlash, prompt_ids: list[int], output_ids: list[int], confidence: list[float],
                         block_size: int, count: int, rng: random.Random) -> list[Judged]:
    """Blocks started at `count` random tokens of the answer (`fresh_block_judged`)."""
    last_anchor = len(output_ids) - block_size - 1
    if last_anchor < 1:
        return []
    anchors = rng.sample(range(1, last_anchor + 1), min(count, last_anchor))
    return fresh_block_judged(pipe, prompt_ids, output_ids, confidence, block_size, anchors)


def blocks_before_the_end(output: GenerationOutput, block_size: int) -> list[tuple[int, int]]:
    """The `decoding_steps` whose anchor random anchors could have drawn (`random_anchor_judged`): from output token
    1 on, with the whole block before the answer's last token."""
    last_anchor = len(output.output_ids) - block_size - 1
    return [(first, kept) for first, kept in decoding_steps(output) if 1 <= first - 1 <= last_anchor]


def fresh_block_judged(pipe: DFlash, prompt_ids: list[int], output_ids: list[int], confidence: list[float],
                       block_size: int, anchors: list[int]) -> list[Judged]:
    """One drafted step from a fresh prefill at each anchor s: the target prefills the prompt and the answer before
    token s (its greedy next token is output token s, the anchor), then one drafted step is judged. Only anchors
    whose whole block lies before the answer's last token are given, so neither a stop nor the limit cuts the
    step."""
    judged = []
    config = GenerationConfig(max_new_tokens=1 + block_size, block_size=block_size, ignore_eos=True)
    for s in anchors:
        output = pipe.engine.generate([prompt_ids + output_ids[:s]], config)[0]
        if output.output_ids[0] != output_ids[s]:  # a near-tie the full prefill broke otherwise: not this anchor
            continue
        judged += judge_step(confidence, s + 1, output.stats.acceptance_lengths[1], block_size)
    return judged


def totals_of(judged: list[Judged], **fields) -> dict:
    first = [j for j in judged if j.position == 1]
    return {**fields, "judged_draft_tokens": len(judged),
            "accepted": round(sum(j.accepted for j in judged) / max(1, len(judged)), 3),
            "mean_target_top1_at_judged": round(sum(j.confidence for j in judged) / max(1, len(judged)), 3),
            "mean_target_top1_at_first_position": round(sum(j.confidence for j in first) / max(1, len(first)), 3),
            "mean_target_top1_at_anchor": round(sum(j.anchor_confidence for j in first) / max(1, len(first)), 3)}


def print_table(title: str, totals: dict | None, table: list[dict], binned_by: str = "target top-1") -> None:
    print(title)
    if totals is not None:
        print(json.dumps(totals))
    print(f"{binned_by:>15}  {'share':>6}  {'accepted':>8}  {'first draft token accepted':>26}")
    for row in table:
        print(f"{row['bin']:>15}  {row['share_of_judged']:6.3f}  {row['accepted']:8.3f}  "
              f"{row['first_position_accepted']:26.3f}")


def summarize(judged: list[Judged], key=lambda j: j.confidence) -> list[dict]:
    """Share and acceptance of the judged draft tokens, binned by key (default: the target's top-1 there)."""
    rows = []
    for lo, hi in zip(BIN_EDGES, BIN_EDGES[1:]):
        inside = [j for j in judged if lo <= key(j) < hi or (hi == 1.0 and key(j) == 1.0)]
        first = [j for j in inside if j.position == 1]
        rows.append({
            "bin": f"{lo:.1f}-{hi:.1f}",
            "share_of_judged": round(len(inside) / max(1, len(judged)), 3),
            "accepted": round(sum(j.accepted for j in inside) / max(1, len(inside)), 3),
            "first_position_accepted": round(sum(j.accepted for j in first) / max(1, len(first)), 3),
        })
    return rows


SURE = 0.7  # the anchor breakdown looks at tokens the target is at least this sure of


def by_anchor_confidence(judged: list[Judged]) -> list[dict]:
    """The draft tokens the target is sure of (top-1 >= SURE), binned by the target's top-1 at the block's anchor:
    whether a block that starts after a token the target hesitated on is accepted less on the sure tokens."""
    return summarize([j for j in judged if j.confidence >= SURE], key=lambda j: j.anchor_confidence)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_pair_options(parser, max_samples=40, seed=0)
    parser.add_argument("--random-anchors", type=int, default=0, help="also judge K blocks per answer started at "
                        "random tokens (0 = off)")
    parser.add_argument("--replay-decoding-anchors", type=int, default=0,
                        help="also redraft K of each answer's decoding blocks from a fresh prefill at the same anchor "
                             "(no drafter cache): the same acceptance says the cache gives the drafter what a "
                             "fresh start would")
    args = parser.parse_args()
    pipe = load_pair(args)
    samples = load_samples(args.dataset, DataOptions(max_samples=args.max_samples, seed=args.seed))
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, block_size=args.block_size)
    rng = random.Random(args.seed)  # random anchors
    replay_rng = random.Random(args.seed + 1)  # which decoding steps to replay: the random anchors do not depend on it
    judged, at_random, in_decoding, replayed, steps, tokens = [], [], [], [], 0, 0
    for sample in samples:
        prompt_ids = pipe.encode(list(sample.history) + [{"role": "user", "content": sample.turns[0]}])
        output = pipe.engine.generate([prompt_ids], config)[0]
        confidence = target_confidence(pipe, prompt_ids, output.output_ids)
        judged += judged_positions(output, confidence, args.block_size)
        if args.random_anchors:
            at_random += random_anchor_judged(pipe, prompt_ids, output.output_ids, confidence, args.block_size,
                                              args.random_anchors, rng)
        if args.replay_decoding_anchors:
            candidates = blocks_before_the_end(output, args.block_size)
            chosen = replay_rng.sample(candidates, min(args.replay_decoding_anchors, len(candidates)))
            in_decoding += [j for first, kept in chosen for j in judge_step(confidence, first, kept, args.block_size)]
            replayed += fresh_block_judged(pipe, prompt_ids, output.output_ids, confidence, args.block_size,
                                           [first - 1 for first, _ in chosen])
        steps += len(output.stats.acceptance_lengths) - 1
        tokens += sum(output.stats.acceptance_lengths[1:])
    report = {"totals": totals_of(judged, dataset=args.dataset, prompts=len(samples), block_size=args.block_size,
                                  mean_acceptance_length=round(tokens / max(1, steps), 3)),
              "by_target_confidence": summarize(judged),
              "sure_tokens_by_anchor_confidence": by_anchor_confidence(judged)}
    print_table("at decoding anchors", report["totals"], report["by_target_confidence"])
    print_table(f"  tokens the target is >= {SURE} sure of", None, report["sure_tokens_by_anchor_confidence"],
                "anchor's top-1")
    if args.random_anchors:
        blocks = sum(j.position == 1 for j in at_random)
        tau = 1 + sum(j.accepted for j in at_random) / max(1, blocks)
        report["random_anchors"] = {
            "totals": totals_of(at_random, blocks=blocks, mean_acceptance_length=round(tau, 3)),
            "by_target_confidence": summarize(at_random),
            "sure_tokens_by_anchor_confidence": by_anchor_confidence(at_random)}
        print_table("at random anchors", report["random_anchors"]["totals"],
                    report["random_anchors"]["by_target_confidence"])
        print_table(f"  tokens the target is >= {SURE} sure of", None,
                    report["random_anchors"]["sure_tokens_by_anchor_confidence"], "anchor's top-1")
    if args.replay_decoding_anchors:
        replay = report["replayed_decoding_anchors"] = {
            "in_decoding": totals_of(in_decoding), "fresh_prefill": totals_of(replayed),
            "by_target_confidence": summarize(in_decoding)}
        print("the same decoding steps, judged in decoding and redrafted from a fresh prefill")
        print(json.dumps(replay["in_decoding"]))
        print(json.dumps(replay["fresh_prefill"]))
        print_table(f"  {args.replay_decoding_anchors} decoding steps per answer, sampled like --random-anchors", None,
                    replay["by_target_confidence"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
