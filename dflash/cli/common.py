"""Flags shared by the subcommands that load a model pair."""

from __future__ import annotations

import argparse
import json

from dflash.config_types import blank_option, parse_int_list, split_list
from dflash.errors import UserError


def int_list(text: str) -> list[int]:
    """'4,8,16' -> [4, 8, 16] (a trailing comma is allowed, and no value at all is [] for the caller to name; an
    empty item between two is a typo, refused)."""
    try:
        return parse_int_list(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def changed_flags(args: argparse.Namespace, add_arguments, names) -> list[str]:
    """Of `names` (argparse dests), those `args` holds at another value than the default of the parser that
    `add_arguments` builds: the flags a user gave (a flag given at its default cannot be told apart, nor matter)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return [name for name in names if getattr(args, name, None) != parser.get_default(name)]


def block_size(text: str) -> int | str:
    """'8' -> 8; 'auto' stays 'auto'."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a block size (a number) or 'auto', got {text!r}") from None


def block_size_list(text: str) -> list[int | str]:
    """'auto,8,16' -> ['auto', 8, 16]; as `int_list`, a trailing comma is allowed and an empty item between two is
    a typo, refused."""
    try:
        items = split_list(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected block sizes separated by commas (like auto,8,16), got "
                                         f"{text!r}") from None
    return [block_size(x) for x in items]


def refuse_empty_flags(args: argparse.Namespace, examples: dict[str, str | None]) -> None:
    """A flag given as '' (or spaces) is refused rather than read as no flag at all, or as the path '.'.
    `examples`: each flag, with a value to show (None: none)."""
    flag = blank_option({flag: getattr(args, flag[2:].replace("-", "_"), None) for flag in examples})
    if flag is not None:
        shown = f" ({examples[flag]})" if examples[flag] else ""
        raise UserError(f"{flag} is empty; give a value{shown} or leave the flag out")


SWEEP_EXAMPLES = {"dataset": "gsm8k,mbpp", "block_size": "auto,8,16", "concurrency": "1,4,8"}  # in SweepOnce's error


class SweepOnce(argparse.Action):
    """A sweep flag (--dataset, --block-size, --concurrency) takes its whole list at once. Given twice, argparse
    would keep the last list alone, silently; a run that measures less than asked for is worse than an error."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is not self.default:
            parser.error(f"{option_string} was given twice; give it once, with every value in one list (like "
                         f"{option_string} {SWEEP_EXAMPLES.get(self.dest, '1,4,8')})")
        setattr(namespace, self.dest, values)


def add_model_arguments(parser: argparse.ArgumentParser, block_size_sweep: bool = False,
                        auto_block_size: bool = False) -> None:
    """`block_size_sweep`: --block-size takes a list (bench); `auto_block_size`: it takes 'auto', the default
    (generate); otherwise a number, default the drafter's own (serve: its adaptive block size is a flag)."""
    group = parser.add_argument_group("models (default: the embedded GSM8K pair)")
    group.add_argument("--target", help="target model: local directory or Hugging Face hub id")
    draft = group.add_mutually_exclusive_group()
    draft.add_argument("--draft", help="DFlash drafter: local directory or hub id; or a small causal LM with the "
                                       "target's tokenizer, for classic speculative decoding to compare with (a draft "
                                       "model's block size defaults to 5)")
    draft.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding (the baseline)")
    group.add_argument("--revision", help="branch, tag or commit of a hub id given as --target (default: main)")
    group.add_argument("--draft-revision", help="branch, tag or commit of a hub id given as --draft (default: main)")
    group.add_argument("--mask-token-id", type=int, help="mask token id for legacy drafters whose config lacks it")
    if block_size_sweep:
        group.add_argument("--block-size", type=block_size_list, action=SweepOnce,
                           help="block size(s) to measure, e.g. 16 or auto,4,8,16, one list given once (<= the "
                                "drafter's; default: its own; auto: chosen every step from timed step costs and the "
                                "acceptance seen, for one greedy or seeded row from that step's draft)")
    elif auto_block_size:
        group.add_argument("--block-size", type=block_size, default="auto",
                           help="tokens verified per step: the anchor + draft tokens, at most the drafter's block "
                                "size; 'auto' (default) chooses it every step from step costs timed at start-up and "
                                "the acceptance seen so far, for one greedy or seeded row after drafting, from how "
                                "sure the drafter is of each token")
    else:
        group.add_argument("--block-size", type=block_size,
                           help="the most tokens a step verifies: the anchor + draft tokens (<= the drafter's block "
                                "size; default and 'auto': the drafter's, with the adaptive block size choosing up to "
                                "it)")
    group.add_argument("--branch-length", type=int, default=0, metavar="N",
                       help="with each greedy or seeded step's block, also verify a branch of N tokens where the "
                            "draft's first "
                            "miss is likeliest: a higher acceptance length for N more tokens per target forward "
                            "(default 0: none; pays where a wider forward costs little, e.g. a GPU)")
    group.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto",
                       help="weights' dtype (default: auto, the checkpoint's own)")
    group.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda if a GPU is visible, else cpu)")
    add_trust_remote_code_argument(group)
    group.add_argument("--drafter-precision", choices=["auto", "float32", "bfloat16"], default="auto",
                       help="a float32 DFlash drafter's matrix products (only the drafts can change, never the "
                            "text): auto (default) times drafts both ways when the pipeline is built and keeps "
                            "bfloat16 where it drafts faster on this CPU")
    add_thinking_argument(group)


def add_trust_remote_code_argument(parser) -> None:
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="run the Python code a checkpoint ships for an architecture transformers lacks (its "
                             "config.json's auto_map); only for checkpoints whose source you trust")


def add_thinking_argument(parser) -> None:
    parser.add_argument("--enable-thinking", action=argparse.BooleanOptionalAction, default=None,
                        help="set the chat template's enable_thinking (Qwen3 and others: thinking on or off); "
                             "default: the template's own")
    parser.add_argument("--chat-template-kwargs", type=json_object, metavar="JSON",
                        help="other chat template variables, as a JSON object (e.g. '{\"reasoning_effort\": "
                             "\"low\"}' for gpt-oss); default: the template's own")


def json_object(text: str) -> dict:
    """A flag's JSON object (argparse reports the ValueError's message as the flag's error)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object; write it like '{{\"enable_thinking\": "
                                         "false}' (in single quotes in a shell)")
    return value


def chat_template_kwargs(args: argparse.Namespace) -> dict | None:
    """The chat template variables the flags ask for (None: the template's defaults)."""
    from dflash.chat import merged_template_kwargs

    return merged_template_kwargs(getattr(args, "chat_template_kwargs", None), getattr(args, "enable_thinking", None))


def check_draft_has_target(args: argparse.Namespace) -> None:
    if args.draft is not None and args.target is None:
        raise UserError("--draft needs --target (the drafter must be paired with the target it was trained for)")
    if getattr(args, "draft_revision", None) is not None and args.draft is None:
        raise UserError("--draft-revision picks a version of the hub id given as --draft: give --draft too")


def load_pipeline(args: argparse.Namespace, warn_unapplied: bool = True):
    from dflash.api import DFlash

    check_draft_has_target(args)
    if args.target is not None and args.draft is None and not args.no_draft:
        raise UserError("--target needs --draft, the DFlash drafter trained for it (or --no-draft to decode with "
                        "the target alone)")
    return DFlash.from_pretrained(
        args.target, args.draft, no_draft=args.no_draft, dtype=args.dtype, device=args.device,
        block_size=args.block_size, mask_token_id=args.mask_token_id, chat_template_kwargs=chat_template_kwargs(args),
        drafter_precision=args.drafter_precision, branch_length=args.branch_length,
        trust_remote_code=args.trust_remote_code, warn_unapplied=warn_unapplied, revision=args.revision,
        draft_revision=args.draft_revision,
    )
