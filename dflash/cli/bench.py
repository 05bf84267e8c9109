"""`dflash bench`: DFlash against plain decoding on the standard datasets (local), or load on a server."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import os
import sys
from pathlib import Path

from dflash.api import refuse_greedy_ignores
from dflash.bench.report import OUTPUT_FILES
from dflash.cli.common import (
    SweepOnce,
    add_model_arguments,
    changed_flags,
    chat_template_kwargs,
    int_list,
    load_pipeline,
    refuse_empty_flags,
)
from dflash.decoding.sampling import MAX_TEMPERATURE
from dflash.errors import UserError

DATASET_HELP = ("gsm8k (default), math500, humaneval, mbpp, mt-bench, or all (several: space or comma separated, "
                "after one --dataset: given twice, it is refused); with --data-file, the dataset whose records the "
                "file holds (without it, the results are named after the file)")
MAX_SAMPLES = 20  # samples per dataset when neither --max-samples nor a server's --num-prompts says

# flags that only one backend reads: giving one to the other backend is an error, never silently ignored
SERVER_FLAGS = {"base_url": "--base-url", "api_key": "--api-key", "model": "--model", "endpoint": "--endpoint",
                "concurrency": "--concurrency",
                "num_prompts": "--num-prompts", "duration": "--duration", "metrics_url": "--metrics-url",
                "baseline_url": "--baseline-url", "rounds": "--rounds", "request_timeout": "--request-timeout",
                "no_stream": "--no-stream"}
LOCAL_FLAGS = {"target": "--target", "draft": "--draft", "no_draft": "--no-draft", "mask_token_id": "--mask-token-id",
               "block_size": "--block-size", "device": "--device", "branch_length": "--branch-length",
               "dtype": "--dtype", "drafter_precision": "--drafter-precision",
               "trust_remote_code": "--trust-remote-code", "revision": "--revision",
               "draft_revision": "--draft-revision"}
LOCAL_INSTEAD = {"--model": "--target names the model", "--num-prompts": "--max-samples sets how many samples"}


MAX_HOURLY_USD = 1e9  # far above any machine's price, far below where the cost of 1M tokens overflows a float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, block_size_sweep=True)
    data = parser.add_argument_group("data")
    data.add_argument("--dataset", nargs="+", metavar="NAME", action=SweepOnce, help=DATASET_HELP)
    data.add_argument("--data-file", help="JSONL with the dataset's own records, or 'prompt', 'turns', 'messages' "
                                          "or ShareGPT 'conversations' per line (one dataset only)")
    data.add_argument("--data-dir", help="directory laid out like gsm8k/test.jsonl, math500/test.jsonl, ... "
                                         "(default: $DFLASH_DATA_DIR)")
    data.add_argument("--max-samples", type=int,
                      help=f"samples per dataset, a deterministic subset (0 = all; default {MAX_SAMPLES}, or against "
                           "a server --num-prompts, so that each conversation of a level is a distinct sample where "
                           "the dataset has that many)")
    data.add_argument("--seed", type=int, default=0, help="picks the subset; seeds sampling at temperature > 0")
    gen = parser.add_argument_group("generation")
    gen.add_argument("--max-new-tokens", type=int, default=256,
                     help="the longest answer of each turn, in tokens (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy; outputs must match at any temperature "
                     "(each prompt is sampled with its own seed)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling at temperature > 0 (1 = off)")
    gen.add_argument("--top-k", type=int,
                     help="top-k sampling at temperature > 0 (0 or -1 = off, the default in this process; against a "
                     "server, top_k is sent only when given, as -1 for off: left out, the server's default applies, "
                     "which vLLM, SGLang and dflash serve take from the model's generation_config.json)")
    gen.add_argument("--warmup-tokens", type=int, help="tokens of the untimed warm-up generation (a server: one "
                     "request to each server; default 16, 0 = none)")
    server = parser.add_argument_group("server backend (any OpenAI-compatible server)")
    server.add_argument("--backend", choices=["local", "server"],
                        help="local: decode in this process (default); server: send requests to --base-url")
    server.add_argument("--base-url", help="e.g. http://127.0.0.1:8000/v1; /v1 is added to a bare "
                                           "http://host:port (implies --backend server)")
    server.add_argument("--model", help="model name sent to the server (default: the first it lists)")
    server.add_argument("--endpoint", choices=["chat", "completions"], help="default: chat")
    server.add_argument("--api-key", help="default: $OPENAI_API_KEY")
    server.add_argument("--concurrency", type=int_list, action=SweepOnce,
                        help="one value or a sweep like 1,4,8, given once (default 1); a level above its number of "
                             "conversations is warned of, as fewer requests were in flight")
    server.add_argument("--num-prompts", type=int,
                        help="conversations per concurrency level, each a distinct sample where the dataset (and "
                             "--max-samples) has enough, else repeated with a warning (default: each sample once)")
    server.add_argument("--duration", type=float, help="seconds of load per level instead of a prompt count (not "
                                                       "with --num-prompts; prompts cycle)")
    server.add_argument("--metrics-url", help="Prometheus metrics (default: /metrics at the server's root)")
    server.add_argument("--baseline-url", help="the same target served without a drafter, for the speedup")
    server.add_argument("--rounds", type=int,
                        help="run each level this many times (default 1); with --baseline-url the two servers take "
                             "turns to go first and the speedup is the median of the rounds' (robust on a busy "
                             "machine)")
    server.add_argument("--request-timeout", type=float, help="seconds per request, the whole of it (default 600); "
                                                              "a request past it counts as failed")
    server.add_argument("--no-stream", action="store_true",
                        help="plain JSON answers instead of server-sent events (no time to first token then); for "
                             "servers that do not send usage in a stream (stream_options.include_usage)")
    out = parser.add_argument_group("output")
    out.add_argument("--output-dir", help="write results.json, results.md and plots here, updated after every "
                                          "dataset and setting (a directory holding an earlier run's: --overwrite)")
    out.add_argument("--overwrite", action="store_true", help="replace the results an earlier run left in --output-dir")
    out.add_argument("--gpu-hourly-usd", type=float, help="machine price per hour: adds the cost of 1M output tokens")
    out.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    from dflash.bench.runner import load_data, run_bench

    config = bench_config(args)
    with _claimed(config.output_dir, getattr(args, "overwrite", False)):
        data = load_data(config)  # a bad record is named before the models load, which can take minutes
        _note_small_datasets(args.max_samples, data)
        pipe = None if config.backend == "server" else _load_pair(args)
        results = run_bench(config, pipe, data=data)
    return 1 if any(r.mismatches or r.errors or r.baseline_errors for r in results) else 0


def _note_small_datasets(max_samples: int | None, data: dict) -> None:
    """A note on stderr for each dataset holding fewer samples than an explicit --max-samples asked for: the
    run measures all it holds, and the report's num_prompts would otherwise be the first sign."""
    if not max_samples:
        return
    for name, samples in data.items():
        if len(samples) < max_samples:
            print(f"note: {name} holds {len(samples)} samples, fewer than --max-samples {max_samples}; all "
                  f"{len(samples)} are used", file=sys.stderr)


@contextlib.contextmanager
def _claimed(output_dir: str | None, overwrite: bool):
    """--output-dir locked against a second dflash bench writing into it (their results would replace each other's)
    until this run ends; its results are checked again once the lock is held, as a run may have just finished."""
    from dflash.training.lock import lock_or_refuse

    if output_dir is None:
        yield
        return
    fd = os.open(output_dir, os.O_RDONLY)
    try:
        lock_or_refuse(fd, f"another dflash bench is writing into --output-dir {output_dir}; let it finish, or pass "
                           "another --output-dir")
        _check_earlier_results(Path(output_dir), overwrite)  # once the lock is held: a running bench is told apart
        yield
    finally:
        os.close(fd)


def bench_config(args: argparse.Namespace):
    """Every flag checked before anything is loaded or sent."""
    from dflash.bench.datasets import DataOptions, resolve_names
    from dflash.bench.runner import BenchConfig
    from dflash.extras import require

    refuse_empty_flags(args, dict.fromkeys(("--output-dir", "--base-url", "--baseline-url", "--metrics-url",
                                            "--data-file", "--data-dir", "--target", "--draft", "--revision",
                                            "--draft-revision")))
    backend = args.backend or ("server" if args.base_url else "local")
    if backend == "server" and not args.base_url:
        raise UserError("the server backend needs --base-url, e.g. http://127.0.0.1:8000/v1")
    require(["httpx"] if backend == "server" else [], "benchmarking a server")
    require(["matplotlib"] if args.output_dir else [], "the plots written into --output-dir")
    _check_backend_flags(args, backend)
    _check_numbers(args)
    names = resolve_names(args.dataset or ["gsm8k"])
    if args.data_file and len(names) > 1:
        raise UserError(f"--data-file holds one dataset, but {len(names)} were asked for; pass one --dataset")
    if args.output_dir:
        _check_output_dir(Path(args.output_dir))
    server = None
    if backend == "server" and args.endpoint == "completions" and chat_template_kwargs(args) is not None:
        raise UserError("--enable-thinking and --chat-template-kwargs set chat template variables, and --endpoint "
                        "completions sends raw text: drop one of them")
    if backend == "server":
        from dflash.bench.server import ServerConfig

        api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
        server = ServerConfig(base_url=args.base_url, model=args.model, endpoint=args.endpoint or "chat",
                              api_key=api_key, concurrency=_distinct(args.concurrency) or [1],
                              num_prompts=args.num_prompts,
                              duration_s=args.duration, timeout_s=_or(args.request_timeout, 600.0),
                              timeout_flag=getattr(args, "timeout_flag", "--request-timeout"),
                              metrics_url=args.metrics_url, baseline_url=args.baseline_url,
                              rounds=_or(args.rounds, 1), chat_template_kwargs=chat_template_kwargs(args),
                              stream=not args.no_stream, warmup_tokens=_or(args.warmup_tokens, 16))
    label = _file_label(args.data_file) if args.data_file and not args.dataset else None
    data = DataOptions(data_file=args.data_file, data_dir=args.data_dir, max_samples=_max_samples(args, backend),
                       seed=args.seed, label=label)
    _check_data(names, data)
    return BenchConfig(
        datasets=names,
        data=data,
        backend=backend, block_sizes=_distinct(args.block_size) or [None], max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        branch_length=args.branch_length, warmup_tokens=_or(args.warmup_tokens, 16), server=server,
        output_dir=args.output_dir,
        gpu_hourly_usd=args.gpu_hourly_usd, show_progress=not args.no_progress,
    )


def _check_data(names: list[str], data) -> None:
    """Every dataset has somewhere to come from (--data-file, --data-dir, the bundled files or the hub)."""
    from dflash.bench.datasets import data_source

    if data.data_file and not Path(data.data_file).is_file():
        raise UserError(f"--data-file {data.data_file} is not a file; pass an existing JSONL file")
    for name in names:
        data_source(name, data)  # a UserError naming what is missing


def _max_samples(args: argparse.Namespace, backend: str) -> int | None:
    """Samples to load per dataset (None: all): --max-samples; else, against a server, one per conversation of a
    level (--num-prompts), as a repeated prompt would be answered from a server's prefix cache; else MAX_SAMPLES."""
    if args.max_samples is not None:
        return args.max_samples or None
    if backend == "server" and args.num_prompts:
        return args.num_prompts
    return MAX_SAMPLES


def _distinct(values: list | None) -> list:
    """A sweep's values in the order given, each once (`8,8` measures 8 once)."""
    return list(dict.fromkeys(values or []))


def _or(value, default):
    return default if value is None else value


def _check_backend_flags(args: argparse.Namespace, backend: str) -> None:
    """A flag the chosen backend would not read is a mistake to point out, not to ignore."""
    wrong = SERVER_FLAGS if backend == "local" else LOCAL_FLAGS
    given = [wrong[name] for name in changed_flags(args, add_arguments, wrong)]
    if not given:
        return
    applies = "applies" if len(given) == 1 else "apply"
    if backend == "local":
        hints = "".join(f"; locally, {LOCAL_INSTEAD[f]}" for f in given if f in LOCAL_INSTEAD)
        raise UserError(f"{', '.join(given)} only {applies} to a server benchmark (--base-url URL); the local "
                        f"backend decodes one prompt at a time in this process{hints}")
    raise UserError(f"{', '.join(given)} only {applies} to the local backend; a server decodes with its own model "
                    "and block size (set them when starting it, e.g. `dflash serve --block-size`): drop "
                    f"{'it' if len(given) == 1 else 'them'}")


def _check_numbers(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.max_samples is not None and args.max_samples < 0:
        raise UserError(f"--max-samples must be >= 0 (0 = all), got {args.max_samples}")
    if not (math.isfinite(args.temperature) and 0 <= args.temperature <= MAX_TEMPERATURE):
        raise UserError(f"--temperature must be a finite number >= 0 (0 = greedy) and at most {MAX_TEMPERATURE:g}, "
                        f"got {args.temperature}")
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise UserError(f"--top-p must be in (0, 1] (1 = off), got {args.top_p}")
    if args.top_k is not None and args.top_k < -1:
        raise UserError(f"--top-k must be a number of tokens >= 1, or 0 or -1 (off), got {args.top_k}")
    refuse_greedy_ignores({"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k})  # as generate
    if args.branch_length < 0:
        raise UserError(f"--branch-length must be >= 0 (0 = no branch), got {args.branch_length}")
    if args.warmup_tokens is not None and args.warmup_tokens < 0:
        raise UserError(f"--warmup-tokens must be >= 0 (0 = no warm-up), got {args.warmup_tokens}")
    if args.gpu_hourly_usd is not None and not 0 < args.gpu_hourly_usd <= MAX_HOURLY_USD:
        raise UserError(f"--gpu-hourly-usd must be a price per hour > 0 and at most {MAX_HOURLY_USD:g} (a cost of 1M "
                        f"tokens must stay a number), got {args.gpu_hourly_usd}")
    for size in args.block_size or []:
        if size != "auto" and size < 2:
            raise UserError(f"--block-size {size} is too small: a block holds the anchor and at least one draft token "
                            "(2 or more, or auto)")
    for flag, values, example in (("--block-size", args.block_size, "16 or auto,8,16"),
                                  ("--concurrency", args.concurrency, "1 or 1,4,8")):
        if values == []:
            raise UserError(f"{flag} was given no value; pass one or a comma-separated list, like {example}")


def _check_output_dir(path: Path) -> None:
    """Before any measurement: a run must not end in an error about where its results go. (What the directory
    holds is checked once this run has locked it: `_claimed`.)"""
    if path.exists() and not path.is_dir():
        raise UserError(f"--output-dir {path} is a file; give a directory (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"cannot create --output-dir {path}: {err.strerror or err}") from None
    if not os.access(path, os.W_OK):
        raise UserError(f"--output-dir {path} is not writable; pick another directory")


def _check_earlier_results(path: Path, overwrite: bool) -> None:
    """Nothing is replaced unasked: an earlier run's results need --overwrite, and files bench would write over in a
    directory no bench wrote (a model's config.json) are refused."""
    ours = (path / "results.json").is_file()  # an earlier bench run's directory (its results checked below)
    foreign = [name for name in OUTPUT_FILES if (path / name).exists()] if not ours else []
    if foreign:  # e.g. a model's directory: bench would write its own config.json over the model's
        raise UserError(f"--output-dir {path} holds {', '.join(foreign)}, which dflash bench would replace, and no "
                        "results.json of an earlier bench run: pass a new or empty --output-dir")
    if _holds_results(path / "results.json") and not overwrite:
        raise UserError(f"--output-dir {path} holds an earlier run's results (results.json{_stopped_early(path)}); "
                        "pass another --output-dir, or --overwrite to replace them")


def _stopped_early(path: Path) -> str:
    """', of a run stopped after 2 of 6 runs' where the earlier run's config.json says it did not finish."""
    try:
        finished = json.loads((path / "config.json").read_text()).get("runs_finished", "")
        done, planned = (int(n) for n in finished.split(" of "))
    except (OSError, ValueError, AttributeError):
        return ""
    return f", of a run stopped after {done} of {planned} runs" if done < planned else ""


def _holds_results(path: Path) -> bool:
    """Whether results.json holds an earlier run's results: one that measured nothing left `[]`."""
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()) != []
    except (OSError, ValueError):  # unreadable or not JSON: not ours to replace unasked
        return True


def _load_pair(args: argparse.Namespace):
    """The pair at the drafter's own block size; the sweep sets the block size per run."""
    if args.no_draft:
        raise UserError("dflash bench measures DFlash against plain decoding itself; drop --no-draft")
    if args.target and not args.draft:
        raise UserError("--target needs --draft, the DFlash drafter trained for it: dflash bench measures it against "
                        "plain decoding of the same target")
    if not args.target:
        from dflash.api import DEFAULT_DRAFT, DEFAULT_TARGET

        missing = [p for p in (DEFAULT_TARGET / "config.json", DEFAULT_DRAFT) if not p.exists()]
        if missing:
            raise UserError(f"the embedded pair is not installed ({missing[0]} is missing); "
                            "pass --target and --draft, or benchmark a server with --base-url")
    single = copy.copy(args)
    single.block_size = None
    return load_pipeline(single)


def _file_label(path: str) -> str:
    """A data file's name without its suffixes (sharegpt.jsonl.gz -> sharegpt), what its results go by."""
    name = Path(path).name
    return name.split(".")[0] or name
