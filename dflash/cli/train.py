"""`dflash train`: train a DFlash drafter for a target. For several processes, run it under torchrun as a module
(`torchrun --nproc_per_node N -m dflash.cli.main train ...`) or with `torchrun --no-python ... dflash train ...`."""

from __future__ import annotations

import argparse

from dflash.cli.common import add_thinking_argument, int_list
from dflash.training.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_LENGTH,
    DEFAULT_SELECTOR_RANK,
    DEFAULT_SELECTOR_TOP_K,
    TrainConfig,
    load_config,
)
from dflash.training.reporting import REPORTERS

DEFAULTS = TrainConfig()  # the values a flag left out takes (the flags themselves default to None: "not given")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="YAML file of training options; flags override it")
    parser.add_argument("--target", help="target model: directory or hub id (default: the embedded target)")
    parser.add_argument("--data", help="JSONL written by `dflash datagen`")
    parser.add_argument("--extra-train-data", nargs="+", metavar="FILE",
                        help="more JSONL files used for training only; the held-out split still comes from --data")
    parser.add_argument("--output", help="output directory (public drafter format + checkpoints/)")
    add_thinking_argument(parser)  # for text records (datagen's records hold their ids): render them as served
    parser.add_argument("--draft-layers", type=int,
                        help="drafter layers (default 1); with --init-from, more than the drafter has adds layers "
                             "that start silent, so the drafter starts unchanged")
    parser.add_argument("--block-size", type=int,
                        help=f"tokens per block: the anchor + the draft tokens (default {DEFAULT_BLOCK_SIZE}; with "
                             "--init-from, the drafter's own)")
    parser.add_argument("--target-layer-ids", type=int_list, metavar="IDS",
                        help="comma-separated target layer ids, each in 0..(target layers - 1), e.g. 1,9,17 (default: "
                             "the published formula); a value that starts with '-' is written --target-layer-ids=-1,3")
    parser.add_argument("--mask-token-id", type=int,
                        help="the id blocks are filled with: one that never occurs in text, not pad or eos (default: "
                             "the tokenizer's mask token, <|mask|>, or the first unused embedding row)")
    parser.add_argument("--intermediate-size", type=int,
                        help="the drafter's MLP width (default: the target's); with --init-from, a larger value "
                             "widens the drafter's MLP (new units start silent, so the drafter starts unchanged)")
    parser.add_argument("--dflash2", action=argparse.BooleanOptionalAction, default=None,
                        help="train a DFlash2 drafter: an in-block convolution around every sublayer and a candidate "
                             "selector (architecture DFlash2DraftModel); with --init-from a DFlash drafter, both are "
                             "added in a form that starts by drafting as it did")
    parser.add_argument("--selector-rank", type=int,
                        help=f"DFlash2: width of the selector's codebooks (default {DEFAULT_SELECTOR_RANK}; with "
                             "--init-from a DFlash2 drafter, its own)")
    parser.add_argument("--selector-top-k", type=int,
                        help=f"DFlash2: candidates per draft position (default {DEFAULT_SELECTOR_TOP_K}; with "
                             "--init-from a DFlash2 drafter, its own)")
    parser.add_argument("--selector-loss-weight", type=float,
                        help="DFlash2: weight of the selector's cross-entropy next to the block loss (default "
                             f"{DEFAULTS.selector_loss_weight:g})")
    parser.add_argument("--anchors-per-sequence", type=int,
                        help=f"blocks trained per sequence per step (default {DEFAULTS.anchors_per_sequence})")
    parser.add_argument("--anchor-policy", choices=["uniform", "decoding"],
                        help="where blocks start: 'uniform' (default) draws anchors at random in each response; "
                             "'decoding' first replays greedy decoding with the current drafter (one extra no-grad "
                             "block per step of it) and trains at its anchors, where blocks follow a miss, then "
                             "fills up with random anchors")
    parser.add_argument("--loss-gamma", type=float,
                        help="decay of the loss weights along a block, exp(-(k-1)/gamma) at position k (default: 7 for "
                             "block size 16, 5 for 10, 4 for 8)")
    parser.add_argument("--max-length", type=int,
                        help=f"tokens of prompt + response per example; longer ones are cut (default "
                             f"{DEFAULT_MAX_LENGTH}, or the target's context when shorter)")
    parser.add_argument("--distill-weight", type=float,
                        help="weight w of the soft labels: each position's loss is (1 - w) * cross-entropy on the "
                             f"target's token + w * KL(target's distribution || drafter's); default "
                             f"{DEFAULTS.distill_weight:g} (hard labels)")
    parser.add_argument("--epochs", type=float,
                        help=f"passes over --data (default {DEFAULTS.epochs:g}); --max-steps, when set, decides "
                             "instead (and an --epochs flag drops a --config file's max_steps)")
    parser.add_argument("--max-steps", type=int, help="optimizer steps to train; overrides --epochs")
    parser.add_argument("--batch-size", type=int,
                        help=f"sequences per process per forward (default {DEFAULTS.batch_size})")
    parser.add_argument("--grad-accum", type=int,
                        help=f"forwards whose gradients add up before each optimizer step (default "
                             f"{DEFAULTS.grad_accum}): a step then trains --batch-size x --grad-accum x processes "
                             "sequences, with the memory of one forward")
    parser.add_argument("--lr", type=float, help=f"peak learning rate of AdamW (default {DEFAULTS.lr:g})")
    parser.add_argument("--weight-decay", type=float, help=f"AdamW's weight decay (default {DEFAULTS.weight_decay:g})")
    parser.add_argument("--warmup-ratio", type=float,
                        help="share of the steps spent warming the learning rate up, before its cosine decay "
                             f"(default {DEFAULTS.warmup_ratio:g})")
    parser.add_argument("--grad-clip", type=float,
                        help=f"largest gradient norm kept (default {DEFAULTS.grad_clip}; 0: no clipping)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"],
                        help=f"precision of the drafter's forward: bfloat16 autocasts, the weights stay float32 "
                             f"(default {DEFAULTS.dtype})")
    parser.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                        help="on a CUDA GPU, float32 matrix products run on TF32 tensor cores: several times faster "
                             "(Ampere and later), with float32 sums of products rounded to 10-bit mantissas; "
                             "--no-tf32 for full float32 (default: on; no effect on a CPU or with --dtype bfloat16)")
    parser.add_argument("--seed", type=int,
                        help=f"seed of the drafter's initial weights, the held-out split, the data order and the "
                             f"anchors (default {DEFAULTS.seed})")
    parser.add_argument("--eval-fraction", type=float,
                        help=f"share of --data held out for evaluation (default {DEFAULTS.eval_fraction:g}; 0: none)")
    parser.add_argument("--eval-every", type=int,
                        help=f"evaluate every N steps (default {DEFAULTS.eval_every}; 0: only at the end)")
    parser.add_argument("--eval-decoding-examples", type=int,
                        help="held-out responses replayed to measure eval_tau_decoding, the acceptance length "
                             f"greedy decoding would get (default {DEFAULTS.eval_decoding_examples}; 0 skips it)")
    parser.add_argument("--log-every", type=int, help=f"log every N steps (default {DEFAULTS.log_every})")
    parser.add_argument("--report-to", choices=REPORTERS,
                        help="tensorboard: the log's numbers as TensorBoard scalars in OUTPUT/tensorboard too (pip "
                             "install 'dflash[tensorboard]'; W&B reads the directory with wandb sync "
                             "--sync-tensorboard); default none")
    parser.add_argument("--checkpoint-every", type=int,
                        help=f"save a checkpoint every N steps (default {DEFAULTS.checkpoint_every}; 0: only at the "
                             "end); the last step is always saved")
    parser.add_argument("--keep-checkpoints", type=int,
                        help=f"the newest checkpoints kept in OUTPUT/checkpoints, older ones deleted (default "
                             f"{DEFAULTS.keep_checkpoints})")
    parser.add_argument("--feature-cache",
                        help="'memory' or a directory: reuse target features across epochs (a directory keeps a "
                             "manifest of the target, examples and feature layers, and refuses a run with others)")
    parser.add_argument("--resume", action=argparse.BooleanOptionalAction, default=None,
                        help="continue from the newest checkpoint in OUTPUT/checkpoints (same data and global batch, "
                             "--batch-size x --grad-accum x processes, which may be split differently; changed "
                             "settings such as --lr are named and take effect); a checkpoint at the last step is "
                             "evaluated and exported")
    parser.add_argument("--overwrite", action="store_true", default=None,
                        help="start afresh in an --output that holds an earlier run's checkpoints or a model: once "
                             "the run has set up, delete the checkpoints, train_log.jsonl and the model "
                             "(config.json, weights, training_config.yaml), then train (without it such a run is "
                             "refused)")
    parser.add_argument("--init-from", help="start from this drafter (directory or hub id) instead of random weights; "
                                            "its shape and mask token are kept; --target-layer-ids may add layers "
                                            "(their fc columns start at zero, so the drafter starts unchanged), "
                                            "--intermediate-size widen its MLP and --draft-layers add layers")
    parser.add_argument("--device", help="cpu, cuda or cuda:N (default: this process's GPU when there is one)")
    parser.add_argument("--trust-remote-code", action=argparse.BooleanOptionalAction, default=None,
                        help="run the Python code the target ships for an architecture transformers lacks (its "
                             "config.json's auto_map); only for checkpoints whose source you trust")


def run(args: argparse.Namespace) -> int:
    from dflash.training.trainer import Trainer

    overrides = {k: v for k, v in vars(args).items() if k not in ("config", "command", "module")}
    trainer = Trainer(load_config(args.config, overrides))
    try:
        trainer.setup().train()
    finally:  # after a refusal in setup too: DDP and the process group are torn down before the interpreter exits
        trainer.cleanup()
    return 0
