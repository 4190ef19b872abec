"""Training: the loop, its callbacks, optimiser/schedule, checkpoints, metrics, parallelism.

Modules: ``trainer`` (the loop), ``callbacks`` (hooks for the layers above), ``evaluate``
(the one loss evaluator), ``metrics`` (metrics.jsonl), ``checkpoint``, ``optim``,
``device``, ``dist`` (process groups), ``parallelize`` (DDP/FSDP2/checkpointing/compile),
``state_dict`` (whole-model views of a sharded model), ``sampling``, ``plots``.
"""

from keel.train.callbacks import Callback, StepState
from keel.train.interrupt import TrainingInterrupted
from keel.train.trainer import TrainResult, TrainingStopped, train

__all__ = ["Callback", "StepState", "TrainResult", "TrainingInterrupted", "TrainingStopped", "train"]
