"""DFlash: lossless block-diffusion speculative decoding for Hugging Face causal LMs."""

__version__ = "0.1.0"

from dflash.api import DFlash
from dflash.decoding import GenerationConfig, GenerationError, GenerationOutput, SpeculativeEngine
from dflash.errors import UserError
from dflash.model import CheckpointError, DFlashDraftModel, TargetModel, load_drafter

__all__ = ["CheckpointError", "DFlash", "DFlashDraftModel", "GenerationConfig", "GenerationError", "GenerationOutput",
           "SpeculativeEngine", "TargetModel", "UserError", "load_drafter"]
