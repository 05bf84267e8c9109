"""Where a DFlash decode step's time goes on this machine (issue 2's measurement).

Measures, for a target + drafter pair (default: the embedded pair):
- a target forward of 1 token and of one block, with a KV cache at a realistic context length;
- a drafter forward (context injection + one block);
- the engine's own overhead per step: step time minus the model forwards inside it;
- memory facts: the features kept per forward (only `target_layer_ids`, never every layer) and the
  drafter's context cache size against the number of accepted tokens.

    python benchmarks/engine_overhead.py [--target DIR --draft DIR] [--threads 1] [--context 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from dflash.api import ASSETS, DFlash
from dflash.decoding.engine import GenerationConfig


def timed(fn, repeats: int) -> float:
    """Median wall time of fn() in milliseconds."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def forward_costs(pipe: DFlash, context: int, block: int, repeats: int) -> dict:
    target, drafter = pipe.target, pipe.drafter
    ids = torch.randint(0, target.vocab_size - 1, (1, context))
    layer_ids = drafter.config.target_layer_ids

    def fresh_cache():
        cache = target.new_cache()
        out = target.forward(ids, torch.arange(context)[None], cache, logits_to_keep=1, feature_layer_ids=layer_ids)
        return cache, out.features

    cache, features = fresh_cache()
    from dflash.model import hf_compat

    def verify(width: int):
        def run():
            tokens = torch.randint(0, target.vocab_size - 1, (1, width))
            target.forward(tokens, torch.arange(context, context + width)[None], cache, feature_layer_ids=layer_ids)
            hf_compat.crop_cache(cache, context)
        return run

    def draft():
        from dflash.model.drafter import DrafterCache

        state = DrafterCache(len(drafter.layers))
        ctx = drafter.project_context(features[:, -block:])
        embeds = target.embed(torch.full((1, block), drafter.config.mask_token_id))
        with torch.inference_mode():
            hidden = drafter(embeds, torch.arange(context, context + block)[None], ctx,
                             torch.arange(context - block, context)[None], cache=state)
            target.lm_head(hidden[:, 1:])

    with torch.inference_mode():
        return {
            "target_forward_1_token_ms": round(timed(verify(1), repeats), 3),
            f"target_forward_{block}_tokens_ms": round(timed(verify(block), repeats), 3),
            "drafter_forward_ms": round(timed(draft, repeats), 3),
            "features_kept_per_token": features.shape[-1],
            "all_layer_hidden_states_would_be": (target.num_layers + 1) * target.hidden_size,
        }


def engine_profile(pipe: DFlash, prompt_ids: list[int], max_new_tokens: int) -> dict:
    engine = pipe.engine
    engine.generate([prompt_ids], GenerationConfig(max_new_tokens=8))  # warm-up
    engine.profile = type(engine.profile)(synchronize=True)  # a GPU's forwards timed as they run
    seq = engine.new_sequence(prompt_ids, GenerationConfig(max_new_tokens=max_new_tokens))
    batch = engine.prefill(seq)
    slots_vs_accepted = []
    while not seq.finished:
        engine.step(batch)
        cache = batch.draft_state.cache
        slots_vs_accepted.append((cache.num_slots, len(prompt_ids) + len(seq.output_ids)))
    p = engine.profile
    return {
        "steps": p.steps,
        "step_ms": round(p.total_s / p.steps * 1000, 3),
        "draft_ms_per_step": round(p.draft_s / p.steps * 1000, 3),
        "target_ms_per_step": round(p.target_s / p.steps * 1000, 3),
        "engine_overhead_ms_per_step": round(p.overhead_s / p.steps * 1000, 3),
        "engine_overhead_share": round(p.overhead_s / p.total_s, 4),
        "mean_acceptance_length": round(seq.stats.mean_acceptance_length, 3),
        # the drafter caches only accepted tokens: slots trail the sequence by the uninjected tail
        "drafter_cache_slots_max_minus_sequence": max(s - n for s, n in slots_vs_accepted),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="default: the embedded target (with or without --draft)")
    parser.add_argument("--draft")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--prompt", default="Natalia sold clips to 48 of her friends in April, and then she sold half "
                        "as many clips in May. How many clips did Natalia sell altogether in April and May?\n"
                        "Please reason step by step, and put your final answer within \\boxed{}.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    pipe = DFlash.from_pretrained(args.target or (ASSETS / "target" if args.draft else None), args.draft, device="cpu")
    block = pipe.engine.proposer.block_size
    report = {"threads": args.threads, "target_layers": pipe.target.num_layers,
              "hidden_size": pipe.target.hidden_size, "drafter_layers": len(pipe.drafter.layers), "block_size": block}
    report.update(forward_costs(pipe, args.context, block, args.repeats))
    report.update(engine_profile(pipe, pipe.encode(args.prompt), args.max_new_tokens))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
