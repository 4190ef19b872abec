"""The model zoo: one Llama-style LM, the residual scheme is one switch (``model.residual``)."""

from keel.model.model import (Attention, Block, CacheSlot, FeedForward, KVCache, Transformer, apply_rope,
                              count_parameters, flops_per_token, largest_loop_count, loop_count, rope_tables)
from keel.model.norm import RMSNorm
from keel.model.residual import SCHEMES, Residual, check_model_config, get_scheme, ignored_keys

__all__ = ["Attention", "Block", "CacheSlot", "FeedForward", "KVCache", "Transformer", "apply_rope",
           "count_parameters", "flops_per_token", "largest_loop_count", "loop_count", "rope_tables", "SCHEMES",
           "RMSNorm", "Residual", "check_model_config", "get_scheme", "ignored_keys"]
