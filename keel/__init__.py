"""keel: Keel (Post-LN with a Highway-style residual, arXiv 2601.19895) and its baselines."""

from keel.config import Config, DataConfig, ModelConfig, TrainConfig
from keel.errors import KeelError
from keel.model import Transformer

__version__ = "0.1.0"
__all__ = ["Config", "DataConfig", "ModelConfig", "TrainConfig", "KeelError", "Transformer", "__version__"]
