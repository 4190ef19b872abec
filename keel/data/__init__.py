"""Data pipeline: sources -> tokenizer + token shards (``keel prepare``) -> training batches.

* :func:`prepare_dataset` builds a dataset directory (``tokenizer.json``, ``train.bin``,
  ``val.bin``, ``meta.json``) from a source string, with caching.
* :func:`resolve_data` finds (or prepares) the dataset a config's ``[data]`` names;
  :func:`find_data` only finds it, :func:`check_data` only checks what it names;
  :func:`absolute_data_paths` anchors its local paths (what a run stores); :func:`prepared_from`
  reads how a given dataset was made.
* :class:`TokenLoader` and :func:`validation_tokens` read it back as ``int64`` tensors;
  :func:`split_windows` is the one rule that cuts token sequences into windows.
* :func:`iter_documents`, :func:`write_shard`/:func:`read_shard`, :func:`load_tokenizer` and
  :func:`read_meta` are the building blocks.
"""

from keel.data.loader import (
    TokenLoader,
    absolute_data_paths,
    check_data,
    check_given_dataset,
    check_tokenizer_matches,
    find_data,
    load_tokenizer,
    prepared_from,
    read_meta,
    resolve_data,
    split_windows,
    validation_tokens,
)
from keel.data.prepare import prepare_dataset
from keel.data.shards import read_shard, write_shard
from keel.data.sources import iter_documents

__all__ = [
    "prepare_dataset",
    "resolve_data",
    "absolute_data_paths",
    "prepared_from",
    "check_given_dataset",
    "check_tokenizer_matches",
    "check_data",
    "find_data",
    "split_windows",
    "TokenLoader",
    "validation_tokens",
    "load_tokenizer",
    "read_meta",
    "write_shard",
    "read_shard",
    "iter_documents",
]
