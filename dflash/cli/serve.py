"""`dflash serve`: an OpenAI-compatible server with DFlash inside, or a hand-off to vLLM / SGLang.

    dflash serve                                         # the embedded pair on 127.0.0.1:8000
    dflash serve --target T --draft D --api-key KEY --max-batch-size 8
    dflash serve --target T --draft D --engine vllm --dry-run   # print the vLLM command
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import logging
import math
import os
import signal
import socket
import sys
import threading
from pathlib import Path

from dflash.cli.common import (
    add_model_arguments,
    changed_flags,
    chat_template_kwargs,
    check_draft_has_target,
    load_pipeline,
    refuse_empty_flags,
)
from dflash.errors import UserError

DEFAULT_MAX_BATCH_SIZE = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    net = parser.add_argument_group("server")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    net.add_argument("--port", type=int, default=8000, help="default: 8000")
    net.add_argument("--api-key", default=os.environ.get("DFLASH_API_KEY") or None,  # exported but empty: none
                     help="require 'Authorization: Bearer KEY' on /v1 (default: $DFLASH_API_KEY, else none)")
    net.add_argument("--allowed-origins", type=_origins, default=(), metavar="ORIGINS",
                     help="browser origins that may call the API, comma-separated (e.g. http://localhost:3000), "
                     "or '*' for any (default: none, no CORS headers)")
    net.add_argument("--served-model-name", help="the model id clients send (default: the --target value)")
    net.add_argument("--max-model-len", type=int, help="context limit, prompt + max_tokens (default: the target's)")
    net.add_argument("--max-batch-size", type=int,
                     help=f"requests decoded together (default: {DEFAULT_MAX_BATCH_SIZE}; with --engine, the engine's)")
    net.add_argument("--max-queue", type=int, default=64,
                     help="requests waiting for a batch slot; more are answered 429 (default: 64)")
    net.add_argument("--max-prefill-tokens", type=int, default=1024,
                     help="prompt tokens prefilled between two decode steps while requests decode (at least one "
                     "prompt), so a burst of long prompts does not hold every stream (default: 1024)")
    net.add_argument("--max-request-bytes", type=int,
                     help="larger request bodies are answered 413 (default: 4 MiB)")
    net.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                     help="what a request that leaves out temperature, top_p or top_k gets: auto = what the "
                     "target's generation_config.json sets (as vLLM and SGLang do by default), whose max_new_tokens "
                     "also caps max_tokens (as vLLM does); vllm (or openai) = OpenAI's defaults; DIR = the "
                     "generation_config.json in that directory (default: auto)")
    net.add_argument("--shutdown-timeout", type=float, metavar="SECONDS",
                     help="on Ctrl-C or SIGTERM, refuse new requests (503, and 503 on /health) and give those "
                     "decoding or queued up to SECONDS to finish, then stop those left (503); a second signal "
                     "stops them after the step under way (default: 0, stop after the step under way, as vLLM "
                     "stops at once; with --engine vllm, passed on)")
    net.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="default: info")
    fb = parser.add_argument_group("adaptive drafting (a fallback to plain decoding, and the block size of each step)")
    fb.add_argument("--fallback-min-acceptance", type=_threshold, default="auto", metavar="TAU|auto",
                    help="mean acceptance length below which a workload stops drafting; 0 = never; auto = where "
                    "drafting stops paying, from the step costs measured at start-up (default: auto)")
    fb.add_argument("--fallback-window", type=int, default=64,
                    help="drafts (one per row per drafted step) in the rolling mean (default: 64)")
    fb.add_argument("--fallback-probe-after", type=int, default=32,
                    help="requests decoded plainly before drafting is tried again (default: 32; doubled by "
                         "each failed try, up to 8x, until drafting holds)")
    fb.add_argument("--fallback-probe-window", type=int, default=16,
                    help="drafts of the probe request before drafting comes back or stays off (default: 16)")
    fb.add_argument("--fallback-hysteresis", type=float, default=0.1, metavar="FRACTION",
                    help="drafting stops below threshold x (1 - FRACTION) and comes back above threshold x "
                    "(1 + FRACTION), so noise near break-even does not move rows back and forth (default: 0.1)")
    fb.add_argument("--adaptive-block-size", action=argparse.BooleanOptionalAction, default=True,
                    help="measure step costs at start-up, then choose each drafted step's block size (up to "
                    "--block-size or the drafter's) for the most tokens/s at the current batch size and "
                    "acceptance, for a lone greedy or seeded request from its own draft (default: on; "
                    "--no-adaptive-block-size verifies the full block every step)")
    handoff = parser.add_argument_group("hand-off to a distributed engine")
    handoff.add_argument("--engine", choices=["dflash", "vllm", "sglang"], default="dflash",
                         help="dflash (this server), or launch vLLM / SGLang with the DFlash speculative config")
    handoff.add_argument("--dry-run", action="store_true", help="with --engine vllm|sglang: print the command only")
    handoff.add_argument("--attention-backend", metavar="NAME",
                         help="with --engine vllm|sglang: the target's attention backend, or auto for the engine's "
                         "own choice for the drafter too (default: the engine's choice for the target; vLLM's "
                         "drafter, whose block attends both ways, gets FLASH_ATTN in its speculative config)")


def _threshold(value: str) -> str | float:
    if value == "auto":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {value!r}") from None


def _origins(value: str) -> tuple[str, ...]:
    """'*' or origins like https://app.example.com (scheme://host[:port], as a browser sends them)."""
    origins = tuple(o.strip().rstrip("/") for o in value.split(",") if o.strip())
    if not origins:
        raise argparse.ArgumentTypeError("expected origins like http://localhost:3000, comma-separated, or '*'")
    for origin in origins:
        scheme, sep, rest = origin.partition("://")
        if origin != "*" and (scheme not in ("http", "https") or not sep or not rest or "/" in rest):
            raise argparse.ArgumentTypeError(f"{origin!r} is not an origin: give scheme://host[:port], e.g. "
                                             "http://localhost:3000, or '*' for any")
    return origins


def run(args: argparse.Namespace) -> int:
    _check_args(args)
    if args.engine != "dflash":
        return _hand_off(args)
    return _serve(args)


def _check_args(args: argparse.Namespace) -> None:
    check_draft_has_target(args)
    batch = args.max_batch_size if args.max_batch_size is not None else DEFAULT_MAX_BATCH_SIZE
    for flag, value, low in (("--max-batch-size", batch, 1), ("--max-queue", args.max_queue, 0),
                             ("--max-prefill-tokens", args.max_prefill_tokens, 1), ("--port", args.port, 0),
                             ("--fallback-window", args.fallback_window, 1),
                             ("--fallback-probe-after", args.fallback_probe_after, 1),
                             ("--fallback-probe-window", args.fallback_probe_window, 1)):
        if value < low:
            raise UserError(f"{flag} must be >= {low}, got {value}")
    if args.port > 65535:
        raise UserError(f"--port must be at most 65535, got {args.port}")
    if not 0 <= args.fallback_hysteresis < 1:
        raise UserError(f"--fallback-hysteresis must be at least 0 and below 1, got {args.fallback_hysteresis}")
    if args.max_request_bytes is not None and args.max_request_bytes < 1:
        raise UserError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if args.shutdown_timeout is not None and not (math.isfinite(args.shutdown_timeout) and args.shutdown_timeout >= 0):
        raise UserError(f"--shutdown-timeout is the seconds requests get to finish at a stop, a number >= 0 (0: stop "
                        f"at once), got {args.shutdown_timeout}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise UserError(f"--max-model-len must be >= 2, got {args.max_model_len}")
    threshold = args.fallback_min_acceptance
    if threshold != "auto" and not (math.isfinite(threshold) and threshold >= 0):
        raise UserError(f"--fallback-min-acceptance must be a number >= 0 or auto, got {threshold}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise UserError("--served-model-name is empty; give the name clients send, or leave the flag out")
    if args.served_model_name is not None and args.served_model_name != args.served_model_name.strip():
        raise UserError(f"--served-model-name {args.served_model_name!r} starts or ends with spaces, which every "
                        "client would have to send too; drop them")
    if args.branch_length and args.engine != "dflash":
        raise UserError(f"--branch-length is this package's engine's; {args.engine} verifies the block alone: drop it "
                        "or serve with --engine dflash")
    if args.dry_run and args.engine == "dflash":
        raise UserError("--dry-run prints the command of a hand-off; use it with --engine vllm or --engine sglang")
    if args.attention_backend is not None and args.engine == "dflash":
        raise UserError("--attention-backend picks vLLM's or SGLang's attention kernels; use it with --engine vllm "
                        "or --engine sglang")
    refuse_empty_flags(args, {"--attention-backend": "flash_attn, or auto",
                              "--generation-config": "auto, vllm or a directory", "--host": "127.0.0.1",
                              "--target": None, "--draft": None})
    _check_generation_config(args.generation_config, args.target)
    if args.api_key is not None and not args.api_key:
        raise UserError("--api-key is empty; give a key or leave the flag out")
    if args.block_size == "auto":  # as in dflash generate: the adaptive block size, up to the drafter's
        if not args.adaptive_block_size:
            raise UserError("--block-size auto chooses each step's block size, and --no-adaptive-block-size verifies "
                            "the full block every step: drop one of them")
        args.block_size = None
    _check_drafting_flags(args)


# the flags that tune drafting on this server: the fallback to plain decoding and the adaptive block size
DRAFTING_FLAGS = ("fallback_min_acceptance", "fallback_window", "fallback_probe_after", "fallback_probe_window",
                  "fallback_hysteresis", "adaptive_block_size")


def _check_drafting_flags(args: argparse.Namespace) -> None:
    """Refuse, before any model loads, drafting flags that cannot apply: given with --no-draft, or a fallback
    threshold left to `auto` without the step costs the adaptive block size measures."""
    if args.engine != "dflash":
        return  # a hand-off refuses every one of them (`_refuse_native_only_flags`)
    if args.no_draft:
        given = changed_flags(args, add_arguments, DRAFTING_FLAGS)
        if given:
            flags = ", ".join(_flag(name) for name in given)
            raise UserError(f"{flags} tune{'s' if len(given) == 1 else ''} drafting, and --no-draft serves the "
                            "target alone: drop one or the other")
    elif not args.adaptive_block_size and args.fallback_min_acceptance == "auto":
        from dflash.serve.fallback import AUTO_NEEDS_STEP_COSTS

        raise UserError(AUTO_NEEDS_STEP_COSTS)


def _check_generation_config(choice: str, target: str | None) -> None:
    """Read what --generation-config names now, before any model loads: a directory given, or with auto a local
    target's own file (a hub target's comes with its download; one transformers cannot read is its loader's to name)."""
    from dflash.api import DEFAULT_TARGET
    from dflash.serve.sampling_defaults import read_generation_config, sampling_defaults

    own = None
    directory = Path(target).expanduser() if target else DEFAULT_TARGET
    if choice == "auto" and (directory / "generation_config.json").is_file():
        with contextlib.suppress(UserError):
            own = read_generation_config(str(directory))
    sampling_defaults(choice, own)


def _flag(name: str) -> str:
    return "--no-adaptive-block-size" if name == "adaptive_block_size" else "--" + name.replace("_", "-")


def _hand_off(args: argparse.Namespace) -> int:
    from dflash.api import DEFAULT_TARGET, HANDOFF_DRAFT
    from dflash.serve import handoff

    target = args.target or str(DEFAULT_TARGET)
    draft = None if args.no_draft else (args.draft or (None if args.target else str(HANDOFF_DRAFT)))
    if args.target and not args.draft and not args.no_draft:
        raise UserError("--target needs --draft (or --no-draft to serve the target alone)")
    if args.mask_token_id is not None:
        raise UserError("--mask-token-id does not carry over: vLLM and SGLang read the mask token id from the "
                        "drafter's config.json (dflash_config.mask_token_id); put it there")
    if args.revision is not None or args.draft_revision is not None:
        raise UserError("--revision and --draft-revision do not carry over to the engine: download that version first "
                        "(`hf download ID --revision REV --local-dir DIR`) and give its directory")
    _refuse_native_only_flags(args)
    options = handoff.HandoffOptions(
        host=args.host, port=args.port, api_key=args.api_key, max_model_len=args.max_model_len,
        # the name dflash serve gives: the --target value (the engines' default too), or dflash for the embedded pair
        served_model_name=args.served_model_name or (None if args.target else "dflash"),
        max_batch_size=args.max_batch_size,
        dtype=None if args.dtype == "auto" else args.dtype, chat_template_kwargs=chat_template_kwargs(args),
        log_level=None if args.log_level == "info" else args.log_level,  # info: both engines' default
        trust_remote_code=args.trust_remote_code, generation_config=args.generation_config,
        attention_backend=args.attention_backend, shutdown_timeout=args.shutdown_timeout,
    )
    with _warnings_to_stderr():
        command = handoff.engine_command(args.engine, target, draft, args.block_size, options)
    _warn_if_open(args)
    if args.dry_run:
        print(command.shown())
        for note in command.notes:
            print(f"dflash serve: note: {note}", file=sys.stderr)
        if args.api_key:
            print(f"dflash serve: note: the command reads the API key from ${handoff.API_KEY_ENV}; export it in the "
                  "shell that runs the command", file=sys.stderr)
        return 0
    return handoff.launch(args.engine, command, args.shutdown_timeout)


# this server's own flags: the engines have their own ways (or none) for what they set
NATIVE_ONLY_FLAGS = ("device", "allowed_origins", "drafter_precision", "max_queue", "max_prefill_tokens",
                     "max_request_bytes", "fallback_min_acceptance", "fallback_window", "fallback_probe_after",
                     "fallback_probe_window", "fallback_hysteresis", "adaptive_block_size")


def _refuse_native_only_flags(args: argparse.Namespace) -> None:
    """A hand-off cannot carry these over: one given with another value than its default is refused, not dropped."""
    given = changed_flags(args, add_arguments, NATIVE_ONLY_FLAGS)
    if given:
        flags = ", ".join(_flag(name) for name in given)
        one = len(given) == 1
        raise UserError(f"{flags} {'is' if one else 'are'} this server's own and {'does' if one else 'do'} not carry "
                        f"over to {args.engine}: drop {'it' if one else 'them'}, or set the engine's own options "
                        "on the command it runs (--dry-run prints it)")


@contextlib.contextmanager
def _warnings_to_stderr():
    """The hand-off's checks warn through the `dflash` logger, which no server configured yet: their warnings read as
    this command's others do."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("dflash serve: warning: %(message)s"))
    logger = logging.getLogger("dflash")
    logger.addHandler(handler)
    propagate, logger.propagate = logger.propagate, False  # once, even where the root logger has a handler too
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate


def _warn_if_open(args: argparse.Namespace) -> None:
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print(f"dflash serve: warning: listening on {args.host} without --api-key; anyone who can reach it can "
              "use it", file=sys.stderr)


def _serve(args: argparse.Namespace) -> int:
    from dflash.extras import require

    require(["fastapi", "uvicorn", "prometheus_client"], "dflash serve")  # all it lacks named at once
    import uvicorn
    from prometheus_client import disable_created_metrics

    from dflash.serve.app import ServeConfig, create_app
    from dflash.serve.limits import DEFAULT_MAX_REQUEST_BYTES
    from dflash.serve.scheduler import SchedulerConfig

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_address(args.host, args.port)  # before the models load, which can take minutes
    disable_created_metrics()  # as vLLM's server does: no `*_created` series beside every counter and histogram
    pipe = load_pipeline(args, warn_unapplied=False)  # the server says what it leaves out (`Server`)
    config = ServeConfig(
        served_model_name=args.served_model_name or args.target or "dflash",
        api_key=args.api_key,
        allowed_origins=args.allowed_origins,
        max_model_len=args.max_model_len,
        max_request_bytes=args.max_request_bytes or DEFAULT_MAX_REQUEST_BYTES,
        scheduler=SchedulerConfig(args.max_batch_size or DEFAULT_MAX_BATCH_SIZE, args.max_queue,
                                  args.max_prefill_tokens),
        fallback=_fallback_config(args),
        adaptive_block_size=args.adaptive_block_size,
        generation_config=args.generation_config,
        decode_thread=False,
    )
    app = create_app(pipe, config)
    _warm_up(pipe)
    # the models' and libraries' objects live as long as the server: out of the collector's sight, a full
    # collection no longer walks them while requests wait, nor at exit (seconds, after the last request had gone)
    gc.collect()
    gc.freeze()
    _warn_if_open(args)
    http = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level))
    return _run(http, app.state.server.scheduler, f"{args.host}:{args.port}", args.shutdown_timeout or 0.0)


def check_address(host: str, port: int) -> None:
    """Whether this machine can listen on host:port now (bound and released at once, as uvicorn will bind it):
    a taken port or a wrong --host is named before any model loads."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise UserError(f"--host {host} is not an address or a name this machine resolves ({err.strerror}); use "
                        "127.0.0.1 (this machine only) or 0.0.0.0 (every interface)") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            probe.bind(address)
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                raise UserError(f"port {port} on {host} is in use by another program; pick another with --port") \
                    from None
            raise UserError(f"cannot listen on {host}:{port} ({err.strerror or err}); check --host and --port "
                            "(--host must be an address of this machine)") from None


def _run(http, scheduler, address: str, shutdown_timeout: float = 0.0) -> int:
    """HTTP on a thread, decoding on this one: the thread that loaded, warmed up and calibrated the models (see
    `Scheduler.run`). Ctrl-C or SIGTERM stops both once the requests taken have finished or `shutdown_timeout`
    has passed (0: after the step under way), those left ending with a 503; a second signal stops after the step
    under way, a third at once. So does the HTTP side stopping on its own."""
    def serve_http() -> None:
        try:
            http.run()
        finally:
            scheduler.stop()

    signals = 0

    def on_signal(signum, frame) -> None:
        nonlocal signals
        signals += 1
        if signals > 2:  # a decode loop held in one long forward (a huge prompt's prefill) stops there
            raise KeyboardInterrupt
        # between steps, not inside one: a request taken from the queue but not yet decoding is never lost
        scheduler.drain(shutdown_timeout if signals == 1 else 0.0)

    thread = threading.Thread(target=serve_http, name="dflash-http", daemon=True)
    # a SIGINT ignored from the start (a background job of a shell) stays ignored
    caught = [sig for sig in (signal.SIGTERM, signal.SIGINT) if signal.getsignal(sig) is not signal.SIG_IGN]
    previous = {sig: signal.signal(sig, on_signal) for sig in caught}
    interrupted = False
    try:
        scheduler.run(on_start=thread.start)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        http.should_exit = True
        thread.join(timeout=30)
    if not http.started and not interrupted and not scheduler.draining:
        raise UserError(f"the server could not listen on {address} (the log above says why); if the port is in "
                        "use, pick another with --port")
    return 0


def _fallback_config(args: argparse.Namespace):
    from dflash.serve.fallback import FallbackConfig

    auto = args.fallback_min_acceptance == "auto"
    return FallbackConfig(0.0 if auto else args.fallback_min_acceptance, args.fallback_window,
                          args.fallback_probe_after, args.fallback_probe_window, auto=auto,
                          hysteresis=args.fallback_hysteresis)


def _warm_up(pipe) -> None:
    """One short decode with and without the drafter, so the first client does not pay for lazy set-up."""
    from dflash.decoding.engine import GenerationConfig, SpeculativeEngine

    ids = pipe.encode("Hello", raw=True) if pipe.tokenizer is not None else [0]
    config = GenerationConfig(max_new_tokens=4, ignore_eos=True)
    pipe.engine.generate_one(ids, config)
    SpeculativeEngine(pipe.target).generate_one(ids, config)
