"""Model code: the DFlash drafter modules, its config and checkpoint format, and the target adapter."""

from dflash.model.config import DrafterConfig, DrafterConfigError, default_target_layer_ids
from dflash.model.drafter import DFlashDraftModel, DrafterCache
from dflash.model.loading import CheckpointError, load_drafter, save_drafter
from dflash.model.target import IncompatibleDrafterError, TargetModel, check_compatible

__all__ = [
    "CheckpointError", "DFlashDraftModel", "DrafterCache", "DrafterConfig", "DrafterConfigError",
    "IncompatibleDrafterError", "TargetModel", "check_compatible", "default_target_layer_ids",
    "load_drafter", "save_drafter",
]
