"""Hugging Face ``transformers`` integration: :class:`KeelConfig` and :class:`KeelForCausalLM`.

Importing this package registers ``model_type = "keel"`` with ``AutoConfig`` and
``AutoModelForCausalLM``, so that after ``import keel.hf``::

    AutoModelForCausalLM.from_pretrained(dir)   # a folder written by `keel export-hf`
    AutoTokenizer.from_pretrained(dir)          # works without importing keel

The exported folder carries no modeling code (no ``auto_map``, no ``trust_remote_code``):
keel's own package is the one copy of the architecture, so ``import keel.hf`` is required
before ``AutoModelForCausalLM.from_pretrained``. Conversions between run directories and
Hugging Face folders are in :mod:`keel.hf.convert` (``keel export-hf`` / ``keel import-hf``).
Needs ``pip install -e .[hf]`` (transformers).
"""

from transformers import AutoConfig, AutoModelForCausalLM

from keel.hf.configuration import KeelConfig
from keel.hf.modeling import KeelForCausalLM, KeelPreTrainedModel

AutoConfig.register(KeelConfig.model_type, KeelConfig, exist_ok=True)
AutoModelForCausalLM.register(KeelConfig, KeelForCausalLM, exist_ok=True)

__all__ = ["KeelConfig", "KeelForCausalLM", "KeelPreTrainedModel"]
