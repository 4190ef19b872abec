"""Text in, token ids out: the one way keel turns text into tokens, and reads text files.

* :func:`read_text_file` -- the bytes of a file as text, exactly as ``keel prepare`` reads
  them: UTF-8, invalid bytes become U+FFFD (``keel eval --text`` reads files the same way).
* :func:`encode_text` / :func:`encode_batch` -- token ids of text. Special-token strings
  inside the text (a literal ``<|endoftext|>``) are plain text, never the special token,
  and no special tokens are added: the ids are the same whether the text is prepared for
  training, scored by ``keel eval``, used as a ``keel generate`` prompt or passed through
  the lm-evaluation-harness wrapper.
* :func:`looks_binary` -- the rule that skips documents that are not text (NUL bytes,
  mostly control characters).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence

from tokenizers import Tokenizer

from keel.errors import KeelError
from keel.io import check_regular_file

# A document whose characters are more than this fraction control characters (other than
# tab, newline, carriage return, form feed, vertical tab) is not text: it is skipped.
MAX_CONTROL_FRACTION = 0.1
_TEXT_CONTROLS = {"\t", "\n", "\r", "\f", "\v"}
_CONTROLS = "".join(chr(c) for c in (*range(0x20), 0x7F) if chr(c) not in _TEXT_CONTROLS)
_DROP_CONTROLS = str.maketrans("", "", _CONTROLS)


def decode_utf8(data: bytes) -> tuple[str, bool]:
    """UTF-8 decode; invalid bytes become U+FFFD. Returns ``(text, had_invalid_bytes)``."""
    try:
        return data.decode("utf-8"), False
    except UnicodeDecodeError:
        return data.decode("utf-8", errors="replace"), True


def read_text_file(path: str | os.PathLike, flag: str = "--text") -> tuple[str, bool]:
    """The text of a file as ``keel prepare`` reads it: ``(text, had_invalid_utf8)``.

    Raises:
        KeelError: ``path`` is a folder, not a regular file (a FIFO, ``/dev/zero``: it was read for
            ever) or does not exist (naming ``flag``, the option that gave it).
    """
    check_regular_file(path, flag)
    if not os.path.isfile(path):
        raise KeelError(f"{flag} {path} is a folder, not a text file" if os.path.isdir(path)
                        else f"{flag} file not found: {path}")
    with open(path, "rb") as f:
        return decode_utf8(f.read())


def looks_binary(text: str) -> bool:
    """True when more than :data:`MAX_CONTROL_FRACTION` of ``text``'s characters are ASCII
    control characters other than whitespace (a file of NUL bytes, a binary blob)."""
    if not text:
        return False
    n_controls = len(text) - len(text.translate(_DROP_CONTROLS))
    return n_controls > MAX_CONTROL_FRACTION * len(text)


@contextlib.contextmanager
def _specials_as_text(tokenizer: Tokenizer) -> Iterator[Tokenizer]:
    previous = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        yield tokenizer
    finally:
        tokenizer.encode_special_tokens = previous


def encode_text(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` (special-token strings in it are text; none are added).

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (a run's or a prepared dataset's ``tokenizer.json``).
    Returns:
        a list of int ids, in ``[0, tokenizer.get_vocab_size())``.
    """
    with _specials_as_text(tokenizer) as tok:
        return tok.encode(text, add_special_tokens=False).ids


def encode_batch(tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """:func:`encode_text` of each of ``texts`` (in parallel in the tokenizer's Rust code)."""
    with _specials_as_text(tokenizer) as tok:
        fast = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast: no offsets (tokenizers >= 0.21)
        return [e.ids for e in fast(list(texts), add_special_tokens=False)]


def utf8_bytes(text: str) -> int:
    """The number of UTF-8 bytes of ``text`` (the denominator of bits per byte)."""
    return len(text.encode("utf-8"))
