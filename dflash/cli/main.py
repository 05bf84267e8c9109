"""`dflash` command line: one subcommand per job, each in its own module."""

from __future__ import annotations

import argparse
import errno
import importlib
import re
import sys

# subcommand -> module with add_arguments(parser) and run(args) -> int
COMMANDS = {
    "generate": ("dflash.cli.generate", "decode a prompt with DFlash speculative decoding"),
    "datagen": ("dflash.cli.datagen", "have the target answer prompts (training data for a drafter)"),
    "train": ("dflash.cli.train", "train a DFlash drafter for a target"),
    "serve": ("dflash.cli.serve", "OpenAI-compatible server with batched DFlash decoding, or a vLLM/SGLang hand-off"),
    "bench": ("dflash.cli.bench", "measure DFlash speedup and acceptance on standard datasets, locally or on a server"),
}


# The generation options as the Python API names them in its errors (GenerationConfig, SamplingParams), and the flags
# that set them in the commands that decode: their errors there name the flag
GENERATION_FLAGS = {"max_new_tokens": "--max-new-tokens", "min_new_tokens": "--min-new-tokens",
                    "block_size": "--block-size", "branch_length": "--branch-length", "temperature": "--temperature",
                    "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p", "seed": "--seed",
                    "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
                    "repetition_penalty": "--repetition-penalty", "json_schema": "--json-schema", "regex": "--regex"}
DECODING_COMMANDS = ("generate", "datagen", "bench", "serve")

# Other tools' names for our flags (the reference benchmark's, vLLM's), for a hint when one is given.
FLAG_ALIASES = {"--draft-model": "--draft", "--model": "--target", "--speculative-model": "--draft",
                "--max-tokens": "--max-new-tokens", "--min-tokens": "--min-new-tokens",
                "--num-speculative-tokens": "--block-size",
                "--stop-strings": "--stop", "--stop-string": "--stop"}  # the API's stop_strings
# Aliases whose value means another number here: vLLM's speculative tokens are the draft tokens, one fewer than the
# block (the anchor and its draft tokens)
ALIAS_VALUES = {"--num-speculative-tokens": "N + 1 for N speculative tokens: the block holds the anchor too"}


def build_parser(commands: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of `commands` alone (the others are listed, without their flags: a command's
    module imports torch and transformers, seconds that `dflash --help` need not wait)."""
    from dflash import __version__

    parser = argparse.ArgumentParser(prog="dflash", description="Lossless block-diffusion speculative decoding.")
    parser.add_argument("--version", action="version", version=f"dflash {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parser.commands = {}  # name -> its parser, for errors in the subcommand's own words
    for name, (module, help_text) in COMMANDS.items():
        command = parser.commands[name] = sub.add_parser(name, help=help_text, description=help_text)
        if commands is None or name in commands:
            importlib.import_module(module).add_arguments(command)
        command.set_defaults(module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    if sys.stdout is None:  # started with stdout closed (`>&-`): Python has no stream to print the results to
        print("dflash: standard output is closed, so there is nowhere to write the results; redirect it to a file "
              "(> FILE) or to /dev/null instead of closing it", file=sys.stderr)
        return 2
    given = sys.argv[1:] if argv is None else argv
    command = next((word for word in given if not word.startswith("-")), None)  # the top level has flags alone
    try:
        parser = build_parser([command])  # imports that command's torch and transformers: seconds to Ctrl-C in
    except KeyboardInterrupt:
        prog = f"dflash {command}" if command in COMMANDS else "dflash"  # as its later messages say
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage and a hint, where argparse would print the top level's usage alone
        sub = parser.commands[args.command]
        hint = unknown_flag_hint(unknown, sub) or list_hint(args.command, unknown)
        sub.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return run_command(args, f"dflash {args.command}{_rank_tag()}")


def unknown_flag_hint(unknown: list[str], parser: argparse.ArgumentParser) -> str:
    """" (did you mean --draft for --draft-model?)" for the first unknown flag with a known alias or a close
    spelling; "" for none."""
    import difflib

    ours = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    for given in unknown:
        flag = given.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        if flag in ours:  # a known flag is unknown only after "--", which ends the flags
            return f" ({flag} comes after --, which makes it text: give the flags before --)"
        alias = FLAG_ALIASES.get(flag)
        close = [alias] if alias in ours else difflib.get_close_matches(flag, ours, n=1, cutoff=0.75)
        if close:
            value = f", {ALIAS_VALUES[flag]}" if close[0] == alias and flag in ALIAS_VALUES else ""
            return f" (did you mean {close[0]} for {flag}{value}?)"
    return ""


def list_hint(command: str, unknown: list[str]) -> str:
    """bench's sweeps take their values joined by commas: "--concurrency 1 4" leaves "4" over; generate's prompt
    is one argument: `dflash generate What is 7 * 8?` leaves "is 7 * 8?" over."""
    import re

    if command == "bench" and re.fullmatch(r"[0-9.,]+|auto", unknown[0]):
        return " (a sweep's values go joined by commas: --concurrency 1,4, --block-size 8,16)"
    if command == "generate" and not unknown[0].startswith("-"):
        return " (a prompt of several words goes in quotes: dflash generate \"What is 7 * 8?\")"
    if command == "generate" and not unknown[0].startswith("--"):
        return f" (a prompt that starts with '-' goes after --: dflash generate -- \"{unknown[0]} ...\")"
    return ""


def _rank_tag() -> str:
    """Under torchrun every process reports its own errors: " [rank R/N]" says whose a line is."""
    import os

    world = os.environ.get("WORLD_SIZE", "1")
    return f" [rank {os.environ.get('RANK', '?')}/{world}]" if world.isdigit() and int(world) > 1 else ""


def run_command(args: argparse.Namespace, prog: str, flag_names: dict[str, str] | None = None) -> int:
    """Run `args.module`; a user's mistake is one line under `prog`, never a traceback. `flag_names`: the flags as
    the user spelled them, for a front end whose flags map onto ours (`python -m dflash.benchmark`)."""
    from dflash.errors import UserError, in_brief

    _quiet_libraries()
    _show_our_warnings(prog)
    previous = _terminate_as_interrupt()
    try:
        return importlib.import_module(args.module).run(args) or 0
    except UserError as err:
        print(f"{prog}: error: {_respelled(_as_flags(err, args), flag_names or {})}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:  # an optional package (serve, bench) not installed: name the extra
        from dflash.extras import as_missing_extra

        missing = as_missing_extra(err, "this command")
        if missing is None:
            raise
        print(f"{prog}: error: {missing}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # whoever read our output stopped (e.g. `| head`): stop quietly, as other tools do
        _drop_stdout()
        return 141  # 128 + SIGPIPE, what a shell reports for a command stopped by a closed pipe
    except (FileNotFoundError, OSError) as err:
        print(f"{prog}: error: {_os_error_text(err)}", file=sys.stderr)
        return 2
    except Terminated:
        print(f"{prog}: terminated", file=sys.stderr)
        return 143  # 128 + SIGTERM
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except (MemoryError, RuntimeError) as err:
        if not _out_of_memory(err):
            raise
        print(f"{prog}: error: out of memory ({in_brief(err)}); ask for less at once "
              "(a smaller --batch-size, --max-length, --max-new-tokens or --max-batch-size, a smaller model), or "
              "run where there is more memory", file=sys.stderr)
        return 1
    finally:
        if previous is not None:
            import signal

            signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler's stop, `kill`): the same clean stop as Ctrl-C, with what is done kept and the way
    to resume said (datagen, bench; train checkpoints first), instead of dying mid-write without a word."""


def _terminate_as_interrupt():
    """SIGTERM raises Terminated while a command runs; returns the handler to put back (None off the main thread,
    where signals cannot be handled)."""
    import signal
    import threading

    def terminated(signum, frame):
        raise Terminated

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, terminated)


def _show_our_warnings(prog: str) -> None:
    """Our warnings (`DFlashWarning`) as one line under `prog`, as our errors are; other libraries' as Python shows
    them."""
    import warnings

    from dflash.errors import DFlashWarning

    shown = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, DFlashWarning):
            print(f"{prog}: warning: {message}", file=sys.stderr)
        else:
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = show


def _as_flags(err, args: argparse.Namespace) -> str:
    """A GenerationError's message (a generation option out of range, a request too long) with each option named
    as the flag that sets it, in a command that decodes; any other error as it is (its paths and file fields are
    no flags)."""
    from dflash.errors import GenerationError

    message = str(err)
    if isinstance(err, GenerationError) and getattr(args, "command", None) in DECODING_COMMANDS:
        return _respelled(message, GENERATION_FLAGS)
    return message


def _os_error_text(err: OSError) -> str:
    """An OSError as one line, with what to do where the error alone does not say it."""
    if err.errno == errno.ENAMETOOLONG:  # the name given, or one the command writes beside it (OUTPUT.datagen.json)
        return (f"a file name is too long: {err.filename}; shorten the name you gave (most file systems take up to "
                "255 bytes per name, and some commands write files named after it, with a suffix)")
    return str(err)


def _respelled(message: str, flag_names: dict[str, str]) -> str:
    """`message` with each of our flags in `flag_names` written as the user's own (whole flags only)."""
    for ours, theirs in flag_names.items():
        # whole names only: not dflash_config.block_size, nor a name the message spells out already: "top_p (--top-p)"
        message = re.sub(rf"(?<![\w./\\-]){re.escape(ours)}(?![\w/\\-]| \(--)", theirs, message)
    return message


def _out_of_memory(err: BaseException) -> bool:
    """Whether an error is an allocation that failed (host or device), which only smaller sizes can fix."""
    text = str(err).lower()
    return isinstance(err, MemoryError) or "out of memory" in text or "can't allocate memory" in text


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so that Python's flush at exit does not fail on the closed pipe again."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no file descriptor (e.g. a test's captured stdout)
        pass


def _quiet_libraries() -> None:
    """Keep the terminal for our output: no per-load progress bars or advisory warnings from transformers."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass


if __name__ == "__main__":
    sys.exit(main())
