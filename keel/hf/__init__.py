"""Hugging Face ``transformers`` integration: :class:`KeelConfig` and :class:`KeelForCausalLM`.

Importing this package registers ``model_type = "keel"`` with ``AutoConfig`` and
``AutoModelForCausalLM``, so that after ``import keel.hf``::

    AutoModelForCausalLM.from_pretrained(dir)   # a folder written by `keel export-hf`
    AutoTokenizer.from_pretrained(dir)          # works without importing keel

That loads a folder with keel's installed code. The folder also carries modeling code
generated from keel's own source (:mod:`keel.hf.remote`, pointed at by ``auto_map``), so
``AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)`` works where keel is
not installed; a ``pre_ln`` export is a stock ``LlamaForCausalLM`` instead, with no custom
code (:mod:`keel.hf.llama`). Conversions between run directories and Hugging Face folders
are in :mod:`keel.hf.convert` (``keel export-hf`` / ``keel import-hf``). Needs
``pip install -e .[hf]`` (transformers).
"""

from transformers import AutoConfig, AutoModelForCausalLM

from keel.hf.configuration import KeelConfig
from keel.hf.modeling import KeelForCausalLM, KeelPreTrainedModel

AutoConfig.register(KeelConfig.model_type, KeelConfig, exist_ok=True)
AutoModelForCausalLM.register(KeelConfig, KeelForCausalLM, exist_ok=True)

__all__ = ["KeelConfig", "KeelForCausalLM", "KeelPreTrainedModel"]
