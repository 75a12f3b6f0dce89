"""Tests of the training job (models/training) and its command line."""
from models.training.config import TrainConfig

#: A short run: 12 steps, checkpoints at 5 and 10 (and the last), metrics every 2 steps.
SMALL = TrainConfig(steps=12, batch_size=32, checkpoint_every=5, log_every=2, warmup_steps=3)
