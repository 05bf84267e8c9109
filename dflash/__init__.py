"""DFlash: lossless block-diffusion speculative decoding for Hugging Face causal LMs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The public names, imported on first use: `import dflash` (as every `dflash` command does first) stays light, so a
# Ctrl-C while torch and transformers load reaches the command's own handler instead of ending in a traceback.
_EXPORTS = {
    "DFlash": "dflash.api",
    "GenerationConfig": "dflash.decoding",
    "GenerationError": "dflash.decoding",
    "GenerationOutput": "dflash.decoding",
    "NoTokenError": "dflash.errors",
    "SpeculativeEngine": "dflash.decoding",
    "UserError": "dflash.errors",
    "CheckpointError": "dflash.model",
    "DFlashDraftModel": "dflash.model",
    "TargetModel": "dflash.model",
    "load_drafter": "dflash.model",
}

__all__ = ["CheckpointError", "DFlash", "DFlashDraftModel", "GenerationConfig", "GenerationError", "GenerationOutput",
           "NoTokenError", "SpeculativeEngine", "TargetModel", "UserError", "load_drafter"]

if TYPE_CHECKING:
    from dflash.api import DFlash
    from dflash.decoding import GenerationConfig, GenerationError, GenerationOutput, SpeculativeEngine
    from dflash.errors import NoTokenError, UserError
    from dflash.model import CheckpointError, DFlashDraftModel, TargetModel, load_drafter


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'dflash' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # once: the next lookup finds it here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
