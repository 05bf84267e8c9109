"""Where a draft's time goes during real decoding: each part of `DFlashProposer.propose`, timed in place.

Decodes GSM8K test questions one at a time (greedy, the drafter's full block) with the proposer's `propose`
replaced by the same steps under timers: preparing the block and the new context, the drafter's forward, the
draft logits (the LM head), DFlash2's candidate lattice, and the path through it (or each position's top-1 for a
DFlash drafter). Prints the median of each part over every draft, and the decode's tokens/s and tau.

    python benchmarks/draft_anatomy.py [--target DIR --draft DIR] [--questions 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from dflash.api import ASSETS, DFlash
from dflash.bench.datasets import DataOptions, load_samples
from dflash.decoding.proposer import DFlashProposer, draft_along_path, draft_per_position

PARTS = ("prepare", "forward", "logits", "lattice", "path")


def timed_propose(times: dict[str, list[float]]):
    """`DFlashProposer.propose`, step by step, each step's wall time appended to `times` (ms)."""

    @torch.inference_mode()
    def propose(self: DFlashProposer, state, anchors, anchor_positions, rows):
        marks = [time.perf_counter()]
        pending, state.pending = state.pending, None
        b, width = anchors.shape[0], self.draft_width
        block_tokens = torch.full((b, width), self.mask_token_id, dtype=torch.long, device=anchors.device)
        block_tokens[:, 0] = anchors
        context = self.drafter.project_context(pending.features.to(self.drafter.dtype))
        embeds = self.target.embed(block_tokens).to(context.dtype)
        marks.append(time.perf_counter())
        hidden = self.drafter(block_embeds=embeds, block_positions=anchor_positions[:, None] + torch.arange(width),
                              context=context, context_positions=pending.positions, context_valid=pending.valid,
                              cache=state.cache, outputs=slice(1, self.block_size))  # (b, k, h)
        marks.append(time.perf_counter())
        logits = self.draft_logits(hidden)  # (b, k, vocab)
        marks.append(time.perf_counter())
        selector = self.drafter.selector
        lattice = selector.lattice(logits, hidden, anchors) if selector is not None else None
        marks.append(time.perf_counter())
        draft = (draft_along_path(lattice, rows, logits.shape[-1]) if lattice is not None
                 else draft_per_position(logits, rows))
        marks.append(time.perf_counter())
        for part, start, end in zip(PARTS, marks, marks[1:]):
            times[part].append((end - start) * 1000)
        times["total"].append((marks[-1] - marks[0]) * 1000)
        return draft

    return propose


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="default: the embedded target")
    parser.add_argument("--draft", help="a DFlash drafter (default: the embedded one)")
    parser.add_argument("--questions", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--data-dir", help="default: the bundled copies")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = DFlash.from_pretrained(args.target or (ASSETS / "target" if args.draft else None), args.draft, device="cpu")
    if not isinstance(pipe.engine.proposer, DFlashProposer):
        parser.error("--draft must be a DFlash drafter")
    samples = load_samples("gsm8k", DataOptions(data_dir=args.data_dir, max_samples=args.questions))
    prompts = [sample.turns[0] for sample in samples]
    times: dict[str, list[float]] = defaultdict(list)
    pipe.generate(prompts[0], max_new_tokens=16, block_size=None)  # warm-up, untimed
    type(pipe.engine.proposer).propose = timed_propose(times)
    tokens = steps = 0
    start = time.perf_counter()
    for prompt in prompts:
        out = pipe.generate(prompt, max_new_tokens=args.max_new_tokens, block_size=None)
        tokens, steps = tokens + len(out.output_ids), steps + len(out.stats.acceptance_lengths) - 1
    elapsed = time.perf_counter() - start
    report = {"questions": len(prompts), "drafts": len(times["total"]), "tokens": tokens,
              "tau": round(tokens / max(steps, 1), 3), "tokens_per_s": round(tokens / elapsed, 1),
              "median_ms": {part: round(statistics.median(v), 3) for part, v in times.items()},
              "target": str(args.target or Path(ASSETS / "target")), "draft": args.draft or "the embedded drafter"}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
