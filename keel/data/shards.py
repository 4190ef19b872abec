"""Binary token shards: one flat array of token ids per file.

Byte layout (all integers little-endian)::

    offset  size  field
    0       8     magic        b"KEELTOK\\0"
    8       4     version      uint32, currently 1
    12      4     dtype code   uint32, bytes per token: 2 (uint16) or 4 (uint32)
    16      8     n_tokens     uint64, number of tokens that follow
    24      ...   tokens       n_tokens * dtype-code bytes, little-endian unsigned ints

The file size is therefore exactly ``24 + n_tokens * dtype_code`` bytes; anything else is
reported as a corrupt or truncated shard. Token ids are stored as ``uint16`` when the
vocabulary has at most 65535 entries, else as ``uint32``.
"""

from __future__ import annotations

import contextlib
import os
import struct
from pathlib import Path

import numpy as np

from keel.errors import KeelError
from keel.io import atomic_path

MAGIC = b"KEELTOK\0"
VERSION = 1
HEADER = struct.Struct("<8sIIQ")  # magic, version, dtype code, n_tokens -> 24 bytes
DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The on-disk dtype for ids in ``[0, vocab_size)``: ``<u2`` if ``vocab_size <= 65535``, else ``<u4``.

    Raises :class:`KeelError` if ``vocab_size`` is not in ``[1, 2**32]``.
    """
    if not 1 <= int(vocab_size) <= 2**32:
        raise KeelError(f"vocab_size must be between 1 and 2**32, got {vocab_size}")
    return DTYPES[2] if vocab_size <= 65535 else DTYPES[4]


class ShardWriter:
    """Write a shard incrementally; the file appears at ``path`` only on a clean :meth:`close`.

    Tokens go to a temporary file beside ``path``; ``close()`` fills in the token count and
    renames it into place (:func:`keel.io.atomic_path`). Used as a context manager, an exception
    inside the ``with`` block removes the temporary file and leaves ``path`` untouched.
    Every chunk is range-checked against ``vocab_size`` (ids are never silently wrapped).
    """

    def __init__(self, path: str | os.PathLike, vocab_size: int):
        self.path = Path(path)
        self.vocab_size = int(vocab_size)
        self.dtype = dtype_for_vocab(self.vocab_size)
        self.n_tokens = 0
        with contextlib.ExitStack() as stack:  # a failure here closes the file and removes it
            self._tmp = stack.enter_context(atomic_path(self.path))
            self._file = stack.enter_context(open(self._tmp, "wb"))
            self._file.write(HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, 0))
            self._open = stack.pop_all()  # closed by close() / abort(): file, then the temporary path

    def write(self, tokens) -> None:
        """Append ``tokens`` (a 1-D array or list of ints in ``[0, vocab_size)``).

        Raises :class:`KeelError` for non-integer input or any id outside the vocabulary.
        """
        arr = np.asarray(tokens)
        if arr.size == 0:
            return
        if arr.dtype.kind not in "iu":
            raise KeelError(f"token ids must be integers, got dtype {arr.dtype}")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise KeelError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size}) of shard {self.path}")
        self._file.write(arr.reshape(-1).astype(self.dtype, copy=False).tobytes())
        self.n_tokens += arr.size

    def close(self) -> Path:
        """Finish the header and move the file into place; returns the final path."""
        self._file.seek(0)
        self._file.write(HEADER.pack(MAGIC, VERSION, self.dtype.itemsize, self.n_tokens))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._open.close()  # closes the file, then renames the temporary file into place
        return self.path

    def abort(self) -> None:
        """Discard everything written so far."""
        self._open.__exit__(KeelError, KeelError("aborted"), None)  # closes the file and removes it

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_shard(path: str | os.PathLike, tokens, vocab_size: int) -> Path:
    """Write ``tokens`` (1-D ``np.ndarray`` of ints or ``list[int]``) to ``path`` atomically.

    The dtype is ``uint16`` if ``vocab_size <= 65535`` else ``uint32`` (see module docstring
    for the byte layout). Raises :class:`KeelError` if any id is ``< 0`` or ``>= vocab_size``
    or the ids are not integers; in that case ``path`` is not created or modified.
    Returns ``Path(path)``.
    """
    with ShardWriter(path, vocab_size) as writer:
        writer.write(tokens)
    return writer.path


def read_shard(path: str | os.PathLike) -> np.ndarray:
    """Memory-map a shard written by :func:`write_shard`.

    Returns a read-only 1-D ``np.memmap`` of dtype ``uint16`` or ``uint32`` with one entry
    per token (an empty ``np.ndarray`` for a shard with 0 tokens). Raises
    :class:`KeelError` if the file is missing, has the wrong magic or version, an unknown
    dtype code, or a size that does not match its header (truncated or corrupt).
    """
    path = Path(path)
    if not path.is_file():
        raise KeelError(f"no such token shard: {path}")
    size = path.stat().st_size
    if size < HEADER.size:
        raise KeelError(f"corrupt token shard {path}: {size} bytes is shorter than the {HEADER.size}-byte header")
    with open(path, "rb") as f:
        magic, version, code, n_tokens = HEADER.unpack(f.read(HEADER.size))
    if magic != MAGIC:
        raise KeelError(f"not a keel token shard: {path} (bad magic {magic!r})")
    if version != VERSION:
        raise KeelError(f"unsupported token shard version {version} in {path} (expected {VERSION})")
    if code not in DTYPES:
        raise KeelError(f"corrupt token shard {path}: unknown dtype code {code}")
    expected = HEADER.size + n_tokens * code
    if size != expected:
        raise KeelError(
            f"corrupt or truncated token shard {path}: {size} bytes, header says {n_tokens} tokens ({expected} bytes)"
        )
    if n_tokens == 0:
        return np.zeros(0, dtype=DTYPES[code])
    return np.memmap(path, dtype=DTYPES[code], mode="r", offset=HEADER.size, shape=(n_tokens,))
