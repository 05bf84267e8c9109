"""DFlash: lossless block-diffusion speculative decoding for Hugging Face causal LMs."""

__version__ = "0.1.0"

from dflash.api import DFlash
from dflash.decoding import GenerationConfig, GenerationOutput, SpeculativeEngine
from dflash.model import DFlashDraftModel, TargetModel, load_drafter

__all__ = ["DFlash", "DFlashDraftModel", "GenerationConfig", "GenerationOutput", "SpeculativeEngine",
           "TargetModel", "load_drafter"]
