"""Corpus statistics of a prepared dataset: the unigram entropy of its training tokens.

The unigram entropy ``H1 = -sum_v p(v) log p(v)`` (nats), with ``p(v)`` the frequency of
token ``v`` in ``train.bin``, is the loss of the best model that ignores context: a
language model whose loss sits at ``H1`` has learnt token frequencies and nothing else
(the "unigram plateau" that tiny models stall on). ``keel prepare`` stores it in
``meta.json`` as ``unigram_entropy``; :func:`dataset_unigram_entropy` computes and stores
it for datasets prepared before that key existed.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

from keel.data.shards import read_shard
from keel.errors import KeelError
from keel.io import atomic_write_text

log = logging.getLogger(__name__)

META_KEY = "unigram_entropy"
_CHUNK = 1 << 24  # tokens counted per bincount call (bounded memory on large shards)


def unigram_entropy(tokens: np.ndarray, vocab_size: int | None = None) -> float:
    """Entropy (nats) of the empirical unigram distribution of ``tokens``.

    ``H1 = -sum_v c_v/N * log(c_v/N)`` over the token ids ``v`` with count ``c_v > 0``,
    ``N = len(tokens)`` (Shannon 1948; the cross-entropy floor of a context-free model).

    Args:
        tokens: 1-D integer array (any int dtype, e.g. a ``uint16`` memmap of a shard).
        vocab_size: optional size of the count table (ids must be below it).
    Returns:
        ``H1`` in nats (0.0 for a single distinct token).
    Raises:
        KeelError: empty ``tokens``, or an id >= ``vocab_size``.
    """
    n = int(tokens.shape[0])
    if n == 0:
        raise KeelError("cannot measure the unigram entropy of an empty token shard")
    counts = np.zeros(int(vocab_size or 0), dtype=np.int64)
    for start in range(0, n, _CHUNK):
        c = np.bincount(np.asarray(tokens[start:start + _CHUNK], dtype=np.int64))
        if vocab_size is not None and c.size > vocab_size:
            raise KeelError(f"token id {c.size - 1} is outside the vocabulary of {vocab_size}")
        if c.size > counts.size:
            counts = np.pad(counts, (0, c.size - counts.size))
        counts[: c.size] += c
    p = counts[counts > 0] / n
    return float(-(p * np.log(p)).sum())


def dataset_unigram_entropy(data_dir: str | os.PathLike) -> float:
    """The ``unigram_entropy`` (nats) of a prepared dataset's ``train.bin``.

    Read from ``meta.json``; if absent (a dataset prepared before the key existed) it is
    computed with :func:`unigram_entropy` and written back into ``meta.json`` atomically.

    Raises:
        KeelError: not a prepared dataset, or a missing/corrupt ``train.bin``.
    """
    path = Path(data_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except (OSError, ValueError):
        raise KeelError(f"not a prepared dataset: {data_dir} (run `keel prepare` first)") from None
    if isinstance(meta.get(META_KEY), (int, float)):
        return float(meta[META_KEY])
    h = unigram_entropy(read_shard(Path(data_dir) / "train.bin"), meta.get("vocab_size"))
    meta[META_KEY] = h
    try:
        atomic_write_text(path, json.dumps(meta, indent=2) + "\n")
    except OSError as e:  # a read-only dataset still gets its number
        log.warning("could not store %s in %s: %s", META_KEY, path, e)
    return h
