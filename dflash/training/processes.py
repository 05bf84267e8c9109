"""This process's place among torchrun's processes, for training and datagen alike."""

from __future__ import annotations

import os


def process_device(name: str | None) -> str | None:
    """--device for this process: `cuda` without an index, or none given on a machine with GPUs, is this process's
    GPU (LOCAL_RANK under torchrun, else 0); anything else is returned as given (None or '': no GPU here)."""
    import torch

    if name in (None, "", "cuda") and torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return name
