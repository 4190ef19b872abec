"""keel: Keel (Post-LN with a Highway-style residual, arXiv 2601.19895) and its baselines.

``from keel import ModelConfig, Transformer``, ``keel.load_run(path)`` and
``keel.train_run(config, run_dir)`` (train as ``keel train`` does) are the public entry
points. Names are loaded
lazily, so that ``import keel`` (and ``keel --help``) does not import torch.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "keel.config",
    "DataConfig": "keel.config",
    "ModelConfig": "keel.config",
    "TrainConfig": "keel.config",
    "KeelError": "keel.errors",
    "Transformer": "keel.model",
    "Run": "keel.run",
    "load_run": "keel.run",
    "train_run": "keel.experiments.training",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'keel' has no attribute {name!r}")
