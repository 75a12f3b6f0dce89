"""Training for the project's models (ViT image classifiers, GPT-style byte LMs), outside the
library: the entry point ``scripts/train_vit.py`` parses flags and calls :func:`main.run`.

* :mod:`.config`: :class:`TrainConfig`, every option that changes the result;
* :mod:`.data`: the embedded digits, ``.npz`` images, byte-level text, the data order;
* :mod:`.trainer`: the model, optimizer and compiled steps of one run;
* :mod:`.loop`: :func:`train`, the loop (checkpoints, resume, stops);
* :mod:`.checkpoints`: orbax checkpoints, their checksums, the resume that verifies them;
* :mod:`.run_dir`: the run directory (lock, config, metrics log);
* :mod:`.errors`: what ends a run early and how it is said;
* :mod:`.distributed`, :mod:`.supervisor`: several processes;
* :mod:`.compare`: standard vs inverted from the same seed;
* :mod:`.main`: the command line's job (flags -> one exit code).
"""
from models.training.config import TrainConfig, validate
from models.training.errors import (ConfigError, Interrupted, RunDirectoryLost, StopRequested,
                                    TrainingDiverged, first_line, stop_on_signals)
from models.training.checkpoints import CheckpointWriteError
from models.training.loop import train
from models.training.run_dir import run_identity
from models.training.trainer import Trainer

__all__ = ["TrainConfig", "validate", "ConfigError", "Interrupted", "StopRequested",
           "TrainingDiverged", "RunDirectoryLost", "first_line", "stop_on_signals",
           "CheckpointWriteError", "train", "run_identity", "Trainer"]
