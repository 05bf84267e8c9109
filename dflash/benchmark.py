"""`python -m dflash.benchmark`: the reference DFlash project's benchmark flags, run by `dflash bench`.

    python -m dflash.benchmark --backend transformers --model TARGET --draft-model DRAFT \\
        --dataset gsm8k --max-samples 50 --block-size 16 --max-new-tokens 2048 --temperature 0
    python -m dflash.benchmark --backend vllm --base-url http://127.0.0.1:8000 --model NAME \\
        --dataset gsm8k --num-prompts 64 --concurrency 1,8,32

As in the reference, --base-url is the server's root (/v1 is added), --num-prompts with the in-process
backend is the number of samples (--max-samples), --timeout-s is the per-request timeout, and chat prompts
are rendered with thinking off unless --enable-thinking is given. Any other
`dflash bench` flag (--output-dir, --gpu-hourly-usd, ...) passes through unchanged.
"""

from __future__ import annotations

import argparse
import sys

PROG = "python -m dflash.benchmark"
LOCAL_BACKENDS = {"local", "transformers", "hf", "huggingface", "torch"}
SERVER_BACKENDS = {"server", "vllm", "sglang", "openai", "dflash"}


def build_parser() -> argparse.ArgumentParser:
    from dflash.cli.common import SweepOnce

    parser = argparse.ArgumentParser(prog=PROG, description="DFlash benchmark (reference-compatible flags; see "
                                                            "`dflash bench -h` for the rest)")
    parser.add_argument("--backend", default="transformers",
                        help=f"{', '.join(sorted(LOCAL_BACKENDS))} (in process) or "
                             f"{', '.join(sorted(SERVER_BACKENDS))} (an OpenAI-compatible server)")
    parser.add_argument("--dataset", nargs="+", action=SweepOnce)  # default: dflash bench's (gsm8k)
    parser.add_argument("--max-samples", type=int)
    parser.add_argument("--num-prompts", type=int, help="server: conversations per level, each a distinct sample "
                                                       "where the dataset has that many; in process: samples")
    parser.add_argument("--concurrency", action=SweepOnce)
    parser.add_argument("--base-url", help="the server's root or its /v1")
    parser.add_argument("--model", "--model-name-or-path", dest="model",
                        help="local: the target model; server: the model name the server knows")
    parser.add_argument("--draft-model", "--draft-name-or-path", dest="draft_model",
                        help="local: the drafter (a server uses its own)")
    parser.add_argument("--block-size", action=SweepOnce)
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--timeout-s", type=float, help="server: seconds per request, the whole of it")
    parser.add_argument("--enable-thinking", action="store_true",
                        help="thinking on in the chat template (as in the reference, it is off by default)")
    return parser


def to_bench_argv(argv: list[str]) -> list[str]:
    """Translate reference flags into `dflash bench` arguments (unknown flags pass through)."""
    from dflash.errors import UserError

    args, rest = build_parser().parse_known_args(argv)
    backend = args.backend.lower()
    if backend not in LOCAL_BACKENDS | SERVER_BACKENDS:
        raise UserError(f"unknown --backend {args.backend!r}; use one of "
                        f"{', '.join(sorted(LOCAL_BACKENDS | SERVER_BACKENDS))}")
    server = backend in SERVER_BACKENDS
    out = ["--backend", "server" if server else "local", *(["--dataset", *args.dataset] if args.dataset else [])]
    if args.model:
        out += ["--model" if server else "--target", args.model]
    if args.draft_model and server:  # reference scripts pass it to every backend: say where it goes, then go on
        print(f"{PROG}: note: --draft-model is not used with --backend {args.backend}: the server drafts with the "
              "drafter it was started with", file=sys.stderr)
    elif args.draft_model:
        out += ["--draft", args.draft_model]
    block_size = args.block_size
    if block_size is not None and server:  # the same: the server's block is its speculative config's
        print(f"{PROG}: note: --block-size is not used with --backend {args.backend}: the server verifies the block "
              "it was started with (vLLM: num_speculative_tokens + 1; SGLang: --speculative-num-draft-tokens)",
              file=sys.stderr)
        block_size = None
    max_samples, num_prompts = args.max_samples, args.num_prompts
    if not server and num_prompts is not None:  # in process, the reference's prompt count is the sample count
        if num_prompts < 1:  # as --max-samples, 0 would mean every sample: hours where the server refuses it
            raise UserError(f"--num-prompts must be >= 1, got {num_prompts}")
        if max_samples is not None and max_samples != num_prompts:
            raise UserError(f"--num-prompts {num_prompts} and --max-samples {max_samples} both set the number of "
                            "samples with an in-process backend; give one")
        max_samples, num_prompts = num_prompts, None
    if args.base_url and not server:
        raise UserError(f"--base-url is a server's address, and --backend {args.backend} decodes in this process: "
                        "benchmark the server with --backend vllm or sglang (any OpenAI-compatible server, dflash "
                        "serve too), or drop --base-url")
    if args.timeout_s is not None and not server:
        raise UserError("--timeout-s is the per-request timeout of a server backend (--backend vllm or sglang); "
                        "drop it for an in-process run")
    for flag, value in (("--max-samples", max_samples), ("--num-prompts", num_prompts),
                        ("--concurrency", args.concurrency), ("--base-url", args.base_url),
                        ("--block-size", block_size), ("--max-new-tokens", args.max_new_tokens),
                        ("--temperature", args.temperature), ("--top-p", args.top_p), ("--top-k", args.top_k),
                        ("--request-timeout", args.timeout_s)):
        if value is not None:
            out += [flag, str(value)]
    completions = "--endpoint=completions" in rest or any(
        a == "--endpoint" and b == "completions" for a, b in zip(rest, rest[1:]))
    if not completions:  # the reference renders chat prompts with thinking off
        out.append("--enable-thinking" if args.enable_thinking else "--no-enable-thinking")
    return out + rest


def main(argv: list[str] | None = None) -> int:
    from dflash.cli import bench
    from dflash.cli.main import run_command
    from dflash.errors import UserError

    argv = sys.argv[1:] if argv is None else argv
    try:
        bench_argv = to_bench_argv(argv)
    except UserError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    # `dflash bench` itself, its errors under this name
    parser = argparse.ArgumentParser(prog=PROG, usage="%(prog)s [reference flags: see --help] [dflash bench flags: "
                                                      "see `dflash bench --help`]")
    bench.add_arguments(parser)
    args = parser.parse_args(bench_argv)
    args.module, args.command = "dflash.cli.bench", "bench"
    args.timeout_flag = "--timeout-s"  # a request past the limit says which flag to raise, as the user knows it
    return run_command(args, PROG, flag_names=reference_flag_names(args.backend))


def reference_flag_names(backend: str) -> dict[str, str]:
    """`dflash bench` flags that this front end fills from the reference's, spelled as the user typed them."""
    names = {"--request-timeout": "--timeout-s"}
    if backend == "local":
        names.update({"--target": "--model", "--draft": "--draft-model"})
    return names


if __name__ == "__main__":
    sys.exit(main())
