"""Atomic file output: write beside the target, then ``os.replace`` into place.

A reader (or a crash) never sees a half-written file: either the old content or the new.
Files get the usual permissions (0666 minus the umask), not ``mkstemp``'s 0600.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Iterator


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield a temporary path in ``path``'s folder; on success it replaces ``path``.

    On an exception the temporary file is removed and ``path`` is left as it was.
    ``suffix`` lets writers that infer the format from the name (matplotlib) see it.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def chmod_default(path: str | os.PathLike) -> None:
    """Give ``path`` the usual file permissions (0666 minus the umask): for files written by
    libraries that create them 0600 (safetensors' ``save_file``)."""
    os.chmod(path, 0o666 & ~_umask())


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def make_temp_dir(parent: str | os.PathLike, name: str) -> Path:
    """A fresh folder ``parent/.name.XXXX.tmp`` with normal permissions (0777 minus umask),
    to be filled and then renamed into place with ``os.replace``."""
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{name}.", suffix=".tmp"))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp
