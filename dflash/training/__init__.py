"""Training DFlash drafters: data generation with the target, the objective, the trainer and export."""

from dflash.training.config import TrainConfig, load_config
from dflash.training.trainer import Trainer

__all__ = ["TrainConfig", "Trainer", "load_config"]
