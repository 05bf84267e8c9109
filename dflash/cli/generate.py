"""`dflash generate`: stream one generation to the terminal, then a stats line (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import sys

from dflash.api import make_config
from dflash.cli.common import add_model_arguments, load_pipeline
from dflash.decoding.engine import SpeculativeEngine
from dflash.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, auto_block_size=True)
    parser.add_argument("--prompt", required=True, help="the prompt text (the chat template is applied)")
    parser.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 = no top-k")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--compare", action="store_true",
                        help="also decode plainly with the same target and report the speedup")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")


def run(args: argparse.Namespace) -> int:
    if not args.prompt.strip():
        raise UserError("--prompt is empty; give the text to decode, e.g. --prompt \"What is 7 * 8?\"")
    if args.compare and args.no_draft:
        raise UserError("--compare measures DFlash against plain decoding of the same target; drop --no-draft")
    pipe = load_pipeline(args)
    options = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                   top_k=args.top_k, seed=args.seed, stop_strings=args.stop)
    prompt_ids = pipe.encode(args.prompt, raw=args.raw)
    pipe.generate(prompt_ids, **{**options, "max_new_tokens": 2})  # warm-up, so timings are steady-state
    if args.json:
        out = pipe.generate(prompt_ids, **options)
    else:
        stream = pipe.stream(prompt_ids, **options)
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        out = stream.result
    report = summary(out)
    if args.compare:
        plain = SpeculativeEngine(pipe.target)  # the same target, no drafter
        plain.generate([prompt_ids], make_config(**{**options, "max_new_tokens": 2}))  # warm-up
        baseline = plain.generate([prompt_ids], make_config(**options))[0]
        report["baseline_decode_tokens_per_s"] = round(baseline.stats.decode_tokens_per_s, 2)
        report["speedup"] = round(out.stats.decode_tokens_per_s / max(baseline.stats.decode_tokens_per_s, 1e-9), 2)
        report["matches_baseline"] = baseline.output_ids == out.output_ids
    if args.json:
        print(json.dumps(report))
    else:
        print(stats_line(report), file=sys.stderr)
    return 0


def summary(out) -> dict:
    s = out.stats
    return {
        "text": out.text,
        "output_ids": out.output_ids,
        "num_output_tokens": s.num_output_tokens,
        "finish_reason": out.finish_reason,
        "acceptance_lengths": s.acceptance_lengths,
        "mean_acceptance_length": round(s.mean_acceptance_length, 3),
        "block_sizes": s.block_sizes,  # the block each verify step checked (varies under --block-size auto)
        "time_to_first_token_s": round(s.time_to_first_token_s, 4),
        "decode_tokens_per_s": round(s.decode_tokens_per_s, 2),
        "target_forwards": s.target_forwards,
        "drafter_forwards": s.drafter_forwards,
    }


def stats_line(report: dict) -> str:
    line = (f"[{report['num_output_tokens']} tokens | acceptance length {report['mean_acceptance_length']:.2f} | "
            f"{report['decode_tokens_per_s']:.1f} tok/s | TTFT {report['time_to_first_token_s'] * 1000:.0f} ms")
    if "speedup" in report:
        same = "identical output" if report["matches_baseline"] else "OUTPUT DIFFERS"
        baseline = report["baseline_decode_tokens_per_s"]
        line += f" | plain decoding {baseline:.1f} tok/s -> {report['speedup']:.2f}x, {same}"
    return line + "]"
