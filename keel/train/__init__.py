"""Training: the loop, optimiser/schedule, checkpoints and plots."""

from keel.train.trainer import TrainResult, TrainingStopped, train

__all__ = ["TrainResult", "TrainingStopped", "train"]
