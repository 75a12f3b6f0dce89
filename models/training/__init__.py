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
import importlib

#: The package's names and the modules that define them, imported when first used (so that a
#: multi-process run's supervisor, :mod:`.supervisor`, starts with the standard library only).
_EXPORTS = {
    "TrainConfig": "config", "validate": "config",
    "ConfigError": "errors", "DataError": "errors", "Interrupted": "errors", "RunDirectoryLost": "errors",
    "StopRequested": "errors", "TrainingDiverged": "errors", "first_line": "errors",
    "stop_on_signals": "errors", "CheckpointWriteError": "checkpoints", "train": "loop",
    "run_identity": "run_dir", "Trainer": "trainer",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
