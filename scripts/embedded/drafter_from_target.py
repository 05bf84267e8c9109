"""A fresh DFlash2 drafter for the embedded target whose layers start as the target's own first layers.

The 2-layer draft model grown from the target's first layers (`train_target.py --layers 2 --init-from ...`)
learnt to predict the target's tokens far faster than the DFlash drafter ever did. This writes a drafter of the
shipped drafter's shape (2 layers, DFlash2, block 16, target layers 1 and 5 as context) whose decoder layers are
copies of target layers `--layers` (attention, its norms, MLP), whose final norm is the target's, and whose
other parts (context projection, convolutions, selector) start fresh: a checkpoint for `dflash train
--init-from`. With `--random` the layers stay random too: the baseline to compare with.

    python scripts/embedded/drafter_from_target.py --out runs/embedded/drafter_from_target_init [--layers 0,1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dflash.model.config import DrafterConfig
from dflash.model.drafter import DFlashDraftModel
from dflash.model.loading import save_drafter
from dflash.model.target import TargetModel

ROOT = Path(__file__).resolve().parents[2]
SHAPE = ROOT / "dflash" / "assets" / "drafter" / "config.json"  # the shipped drafter's shape
TARGET = ROOT / "dflash" / "assets" / "target"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", default="0,1", help="target layers to copy into the drafter's layers")
    parser.add_argument("--random", action="store_true", help="keep random layers (the baseline)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    config = DrafterConfig.from_dict(json.loads(SHAPE.read_text()))
    drafter = DFlashDraftModel(config)
    drafter.init_weights()
    if not args.random:
        target = TargetModel.from_pretrained(str(TARGET))
        layers = [int(i) for i in args.layers.split(",")]
        if len(layers) != len(drafter.layers):
            raise SystemExit(f"--layers names {len(layers)} layers; the drafter has {len(drafter.layers)}")
        source = target.model.model
        with torch.no_grad():
            for mine, theirs in zip(drafter.layers, (source.layers[i] for i in layers)):
                own = mine.state_dict()
                copied = {k: v for k, v in theirs.state_dict().items() if k in own}
                mine.load_state_dict({**own, **copied})
            drafter.norm.weight.copy_(source.norm.weight)
    save_drafter(drafter, args.out)
    print(f"wrote {args.out} ({'random layers' if args.random else f'target layers {args.layers}'})")


if __name__ == "__main__":
    main()
