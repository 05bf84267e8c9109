"""`python -m dflash.benchmark`: the reference DFlash project's benchmark flags, run by `dflash bench`.

    python -m dflash.benchmark --backend transformers --model TARGET --draft-model DRAFT \\
        --dataset gsm8k --max-samples 50 --block-size 16 --max-new-tokens 2048 --temperature 0
    python -m dflash.benchmark --backend vllm --base-url http://127.0.0.1:8000/v1 --model NAME \\
        --dataset gsm8k --num-prompts 64 --concurrency 1,8,32

Any other `dflash bench` flag (--output-dir, --gpu-hourly-usd, ...) passes through unchanged.
"""

from __future__ import annotations

import argparse
import sys

LOCAL_BACKENDS = {"local", "transformers", "hf", "huggingface", "torch"}
SERVER_BACKENDS = {"server", "vllm", "sglang", "openai", "dflash"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m dflash.benchmark",
                                     description="DFlash benchmark (reference-compatible flags; see `dflash bench -h`)")
    parser.add_argument("--backend", default="transformers",
                        help=f"{', '.join(sorted(LOCAL_BACKENDS))} (in process) or "
                             f"{', '.join(sorted(SERVER_BACKENDS))} (an OpenAI-compatible server)")
    parser.add_argument("--dataset", nargs="+", default=["gsm8k"])
    parser.add_argument("--max-samples", type=int)
    parser.add_argument("--num-prompts", type=int)
    parser.add_argument("--concurrency")
    parser.add_argument("--base-url")
    parser.add_argument("--model", "--model-name-or-path", dest="model",
                        help="local: the target model; server: the model name the server knows")
    parser.add_argument("--draft-model", "--draft-name-or-path", dest="draft_model", help="local: the drafter")
    parser.add_argument("--block-size")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    return parser


def to_bench_argv(argv: list[str]) -> list[str]:
    """Translate reference flags into `dflash bench` arguments (unknown flags pass through)."""
    args, rest = build_parser().parse_known_args(argv)
    backend = args.backend.lower()
    if backend not in LOCAL_BACKENDS | SERVER_BACKENDS:
        from dflash.errors import UserError

        raise UserError(f"unknown --backend {args.backend!r}; use one of "
                        f"{', '.join(sorted(LOCAL_BACKENDS | SERVER_BACKENDS))}")
    server = backend in SERVER_BACKENDS
    out = ["--backend", "server" if server else "local", "--dataset", *args.dataset]
    if args.model:
        out += ["--model" if server else "--target", args.model]
    if args.draft_model and not server:
        out += ["--draft", args.draft_model]
    for flag, value in (("--max-samples", args.max_samples), ("--num-prompts", args.num_prompts),
                        ("--concurrency", args.concurrency), ("--base-url", args.base_url),
                        ("--block-size", args.block_size), ("--max-new-tokens", args.max_new_tokens),
                        ("--temperature", args.temperature)):
        if value is not None:
            out += [flag, str(value)]
    return out + rest


def main(argv: list[str] | None = None) -> int:
    from dflash.cli.main import main as dflash_main
    from dflash.errors import UserError

    try:
        bench_argv = to_bench_argv(sys.argv[1:] if argv is None else argv)
    except UserError as err:
        print(f"python -m dflash.benchmark: error: {err}", file=sys.stderr)
        return 2
    return dflash_main(["bench", *bench_argv])


if __name__ == "__main__":
    sys.exit(main())
