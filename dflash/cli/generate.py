"""`dflash generate`: stream one generation to the terminal, then a stats line (or one JSON object)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from dflash.api import make_config, refuse_greedy_ignores
from dflash.chat import check_text
from dflash.cli.common import add_model_arguments, chat_template_kwargs, load_pipeline
from dflash.decoding.engine import SpeculativeEngine
from dflash.errors import UserError

_ESCAPES = {"\\n": "\n", "\\t": "\t", "\\r": "\r", "\\\\": "\\"}


class _GivenOnce(argparse.Action):
    """A flag that may appear once: a second --prompt would otherwise silently replace the first."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not None:
            raise argparse.ArgumentError(self, "given more than once; dflash generate decodes one prompt (decode "
                                               "several with `dflash bench` or the Python API's generate_batch)")
        setattr(namespace, self.dest, values)


WARM_UP = {"max_new_tokens": 2, "min_new_tokens": 0}  # the options of a warm-up run before the timed ones


def stop_string(text: str) -> str:
    """A --stop value with \\n, \\t, \\r and \\\\ read as the characters they name (as the shell passes them)."""
    if not text:
        raise argparse.ArgumentTypeError("a stop string cannot be empty")
    return re.sub(r"\\[ntr\\]", lambda m: _ESCAPES[m.group()], text)


def json_schema(text: str) -> dict:
    """A --json-schema value: the schema's JSON text, or a file holding it."""
    path = Path(text).expanduser()
    source = f"the file {text}" if path.is_file() else "the text"
    try:
        schema = json.loads(path.read_text() if path.is_file() else text)
    except (OSError, ValueError) as err:
        raise argparse.ArgumentTypeError(f"a JSON schema, as JSON text or a file holding it; {source} is not "
                                         f"JSON ({err})") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError('a JSON schema is a JSON object, like {"type": "object"}')
    return schema


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser, auto_block_size=True)
    group = parser.add_argument_group("prompt and decoding")
    given = group.add_mutually_exclusive_group()  # or the PROMPT argument (`read_prompt` wants exactly one)
    given.add_argument("--prompt", action=_GivenOnce,
                       help="the prompt text ('-': read it from standard input); the chat template is applied unless "
                            "--raw")
    given.add_argument("--prompt-file", metavar="PATH", help="read the prompt text from this UTF-8 file")
    # outside the group: an unknown flag's value lands here, and the unknown flag's hint must come first
    group.add_argument("prompt_text", nargs="?", metavar="PROMPT", help="the prompt text, as --prompt takes it")
    group.add_argument("--system", metavar="TEXT", help="a system message before the prompt (chat template only)")
    group.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    group.add_argument("--max-new-tokens", type=int, default=256,
                       help="the most tokens to generate (default 256); the prompt and these must fit the target's "
                            "context")
    group.add_argument("--min-new-tokens", type=int, default=0,
                       help="no stop (EOS, --stop) before this many tokens, up to --max-new-tokens (default 0; "
                            "vLLM's min_tokens)")
    group.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily; > 0 samples")
    group.add_argument("--top-p", type=float, default=1.0,
                       help="sample from the most likely tokens that make up this probability, in (0, 1] "
                            "(default 1: all)")
    group.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (default 0: all)")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="sample from the tokens at least this fraction as likely as the likeliest, in [0, 1] "
                            "(default 0: all)")
    group.add_argument("--seed", type=int,
                       help="when sampling: the same seed gives the same text, at any block size, with or without "
                            "the drafter")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="subtracted once from the logit of each token the answer holds so far, from -2 to 2 "
                            "(default 0: off; OpenAI's)")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="subtracted from a token's logit once per time the answer holds it so far, from -2 to 2 "
                            "(default 0: off; OpenAI's)")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="divides the positive logits, and multiplies the others, of tokens the prompt or answer "
                            "holds, > 0 (default 1: off; above 1 discourages repeating; transformers' and vLLM's)")
    group.add_argument("--json-schema", type=json_schema, metavar="SCHEMA",
                       help="the answer is JSON matching this schema (JSON text, or a file holding it; needs "
                            "pip install 'dflash[structured]')")
    group.add_argument("--regex", help="the answer matches this regular expression (needs "
                                       "pip install 'dflash[structured]')")
    group.add_argument("--stop", action="append", default=[], type=stop_string,
                       help=r"stop before this text (repeatable; \n and \t stand for newline and tab)")
    group.add_argument("--compare", action="store_true",
                       help="also decode plainly with the same target and report the speedup")
    group.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")


def run(args: argparse.Namespace) -> int:
    prompt = read_prompt(args)
    options = _check_arguments(args, prompt)
    pipe = load_pipeline(args)
    if not args.raw and not pipe.has_chat_template:
        if args.system is not None:
            raise UserError("--system adds a message for the chat template, and this target's tokenizer has none; put "
                            "the instructions at the start of the prompt instead")
    prompt_ids = pipe.encode(_conversation(prompt, args.system), raw=args.raw)
    _check_room(pipe.engine, len(prompt_ids), args.max_new_tokens)  # before the warm-up asks for fewer tokens
    pipe.generate(prompt_ids, **{**options, **WARM_UP})  # so that timings are steady-state
    out = pipe.generate(prompt_ids, **options) if args.json else _stream(pipe, prompt_ids, options)
    report = summary(out)
    try:
        if args.compare:
            report.update(compare_with_plain(pipe, prompt_ids, options, out))
    finally:  # Ctrl-C during the plain decode still reports the DFlash one
        if args.json:
            print(json.dumps(report))
        else:
            print(stats_line(report), file=sys.stderr)
    return 0


def read_prompt(args: argparse.Namespace) -> str:
    """The prompt text: --prompt's or the PROMPT argument's (standard input's for '-'), or --prompt-file's. A file's
    or the input's one final line break is dropped: `echo` and editors end the text with one (a shell's
    `$(cat FILE)` drops it too)."""
    source, value = _prompt_source(args)
    if source == "--prompt-file":
        return _without_final_newline(_read_file(Path(value).expanduser()))
    if value == "-":
        return _without_final_newline(_read_stdin())
    return value


def _prompt_source(args: argparse.Namespace) -> tuple[str, str]:
    """How the prompt was given (--prompt, --prompt-file or PROMPT) and the value; exactly one way is."""
    given = [(flag, value) for flag, value in [("--prompt", args.prompt), ("--prompt-file", args.prompt_file),
                                               ("PROMPT", getattr(args, "prompt_text", None))] if value is not None]
    if len(given) != 1:
        ways = "as PROMPT (`dflash generate \"What is 7 * 8?\"`), --prompt TEXT or --prompt-file PATH"
        raise UserError(f"the prompt was given as {' and '.join(flag for flag, _ in given)}; give it once, {ways}"
                        if given else f"no prompt: give it {ways}")
    return given[0]


def _without_final_newline(text: str) -> str:
    return text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text


def _read_stdin() -> str:
    if sys.stdin is None or sys.stdin.closed:
        raise UserError("--prompt - reads the prompt from standard input, and there is none; pipe the text in "
                        "(`echo \"What is 7 * 8?\" | dflash generate --prompt -`) or pass it as --prompt TEXT")
    if sys.stdin.isatty():
        print("reading the prompt from standard input; end it with Ctrl-D", file=sys.stderr)
    return sys.stdin.read()


def _read_file(path: Path) -> str:
    """The prompt in a text file, or in a pipe (`<(...)`, /dev/stdin)."""
    if path.is_dir() or not path.exists():
        raise UserError(f"--prompt-file {path} {'is a directory' if path.is_dir() else 'does not exist'}; give the "
                        "path of a text file holding the prompt")
    try:
        return path.read_text(encoding="utf-8-sig")  # without the byte order mark some editors write
    except UnicodeDecodeError as err:
        raise UserError(f"--prompt-file {path} is not UTF-8 text (byte {err.start}); save it as UTF-8") from None
    except OSError as err:
        raise UserError(f"cannot read --prompt-file {path}: {err.strerror or err}") from None


def _conversation(prompt: str, system: str | None) -> str | list[dict]:
    """The text alone, or the chat messages that put --system before it."""
    if system is None:
        return prompt
    return [{"role": "system", "content": system}, {"role": "user", "content": prompt}]


def _check_arguments(args: argparse.Namespace, prompt: str) -> dict:
    """The generation options, checked before any model loads: a typo should not wait for a model."""
    source, value = _prompt_source(args)
    if not prompt.strip():
        stdin = source != "--prompt-file" and value == "-"
        raise UserError(f"{source} {'(standard input) ' if stdin else ''}is empty; give the text to decode, e.g. "
                        "--prompt \"What is 7 * 8?\"")
    check_text(prompt, source)
    for stop in args.stop or []:  # a stop string that is not text could never be met
        check_text(stop, "--stop", "give the text that ends the answer, or leave the flag out")
    if args.system is not None:
        check_text(args.system, "--system", "give the system message, or leave the flag out")
        if args.raw:
            raise UserError("--system adds a message for the chat template, and --raw sends the prompt without the "
                            "template: drop one of them")
    if args.compare and args.no_draft:
        raise UserError("--compare measures DFlash against plain decoding of the same target; drop --no-draft")
    if args.raw and chat_template_kwargs(args) is not None:
        raise UserError("--enable-thinking and --chat-template-kwargs set chat template variables, and --raw sends "
                        "the prompt without the template: drop one of them")
    if args.max_new_tokens < 1:  # the engine takes 0 (a prompt read alone); here it is a mistake
        raise UserError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    options = dict(max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
                   temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                   seed=args.seed, stop_strings=args.stop,
                   presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                   repetition_penalty=args.repetition_penalty, json_schema=args.json_schema, regex=args.regex)
    make_config(**options)
    refuse_greedy_ignores(options)
    if args.branch_length > 0 and args.temperature > 0 and args.seed is None:
        raise UserError("--branch-length verifies a branch in greedy or seeded decoding, and sampling without a "
                        "--seed decodes without one (its exactness needs the block alone): give --seed, or drop "
                        "--branch-length")
    return options


def _check_room(engine: SpeculativeEngine, prompt_tokens: int, max_new_tokens: int) -> None:
    """Refuse a prompt + --max-new-tokens that the target's context cannot hold, saying how many tokens fit."""
    room = engine.room(prompt_tokens)
    if room is None or max_new_tokens <= room:
        return
    if room < 1:
        raise UserError(f"the prompt ({prompt_tokens} tokens) leaves no room for an answer in the target's context "
                        f"of {engine.target.context_words}; shorten the prompt")
    raise UserError(f"the prompt ({prompt_tokens} tokens) leaves room for at most {room} new "
                    f"token{'' if room == 1 else 's'} in the target's "
                    f"context of {engine.target.context_words}; lower --max-new-tokens to {room} or shorten the "
                    "prompt")


def _stream(pipe, prompt_ids: list[int], options: dict):
    """Write the text as it is decoded; the GenerationOutput afterwards."""
    stream = pipe.stream(prompt_ids, **options)
    try:
        for piece in stream:
            sys.stdout.write(piece)
            sys.stdout.flush()
    finally:  # end the line (also on Ctrl-C), and before the stats line on stderr
        sys.stdout.write("\n")
        sys.stdout.flush()
    return stream.result


COMPARE_ROUNDS = 3  # plain and DFlash decodes, in turns; each side's fastest counts


def compare_with_plain(pipe, prompt_ids: list[int], options: dict, out) -> dict:
    """Decode the same prompt with the target alone: its speed, the speedup, and whether the output is the same.

    Plain decoding and DFlash take `COMPARE_ROUNDS` turns (the streamed answer is DFlash's first) and each side's
    fastest decode counts: on a busy machine one run can be caught by a burst of other work (a plain decode once
    ran at a fifteenth of its speed beside a datagen, and read as a 37x speedup)."""
    plain = SpeculativeEngine(pipe.target)  # the same target, no drafter
    config = make_config(**options)
    plain.generate_one(prompt_ids, make_config(**{**options, **WARM_UP}))
    baseline = plain.generate_one(prompt_ids, config)
    theirs, ours = [baseline.stats.decode_tokens_per_s], [out.stats.decode_tokens_per_s]
    for _ in range(COMPARE_ROUNDS - 1):
        ours.append(pipe.generate(prompt_ids, **options).stats.decode_tokens_per_s)
        theirs.append(plain.generate_one(prompt_ids, config).stats.decode_tokens_per_s)
    timed = min(ours) > 0 and min(theirs) > 0  # a decode step to time, not the prefill's token alone
    return {
        "baseline_decode_tokens_per_s": round(max(theirs), 2),
        "fastest_decode_tokens_per_s": round(max(ours), 2),
        "compare_rounds": COMPARE_ROUNDS,
        "speedup": round(max(ours) / max(theirs), 2) if timed else None,
        # sampled without a seed, two decodes draw different text whatever decodes them: nothing to compare
        "matches_baseline": (baseline.output_ids == out.output_ids
                             if config.sampling.greedy or config.seed is not None else None),
    }


def summary(out) -> dict:
    s = out.stats
    return {
        "text": out.text,
        "output_ids": out.output_ids,
        "num_output_tokens": s.num_output_tokens,
        "finish_reason": out.finish_reason,
        "stop_string": out.stop_string,  # the --stop that ended the text, else null
        "acceptance_lengths": s.acceptance_lengths,
        "mean_acceptance_length": round(s.mean_acceptance_length, 3),
        # the block each verify step checked (varies under --block-size auto): acceptance_lengths[1:], step by step
        "block_sizes": s.block_sizes,
        "time_to_first_token_s": round(s.time_to_first_token_s, 4),
        "decode_tokens_per_s": round(s.decode_tokens_per_s, 2),
        "target_forwards": s.target_forwards,
        "drafter_forwards": s.drafter_forwards,
    }


def stats_line(report: dict) -> str:
    n = report["num_output_tokens"]
    parts = [f"{n} token{'' if n == 1 else 's'}"]
    if len(report["acceptance_lengths"]) > 1:
        parts += [f"acceptance length {report['mean_acceptance_length']:.2f}",
                  f"{report['decode_tokens_per_s']:.1f} tok/s"]
    else:  # the prefill's token only
        parts.append("no decode step to measure")
    parts.append(f"TTFT {report['time_to_first_token_s'] * 1000:.0f} ms")
    if "matches_baseline" in report:
        same = {True: "identical output", False: "OUTPUT DIFFERS",
                None: "output not compared (sampled without --seed; add one to compare)"}[report["matches_baseline"]]
        if report["speedup"] is None:
            parts.append(f"plain decoding: {same}")
        else:
            ours, baseline = report["fastest_decode_tokens_per_s"], report["baseline_decode_tokens_per_s"]
            parts.append(f"fastest of {report['compare_rounds']}: {ours:.1f} tok/s, plain decoding {baseline:.1f} "
                         f"tok/s -> {report['speedup']:.2f}x, {same}")
    return "[" + " | ".join(parts) + "]"
