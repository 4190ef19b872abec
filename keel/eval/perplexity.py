"""Perplexity and bits per byte of a keel model on held-out text.

Definitions (N predicted tokens with next-token cross-entropy l_i in nats, B = UTF-8 bytes
of the text those N tokens decode to):

* loss = (1/N) * sum_i l_i (nats per token); perplexity = exp(loss);
* bits per byte = sum_i l_i / ln 2 / B  (as in Gao et al. 2020, The Pile, Sec. 3: it does
  not depend on the tokenizer, so models with different vocabularies compare).

Which bytes: the targets of the evaluated windows (every token but the first of each
window; windows overlap by one token, so the targets are one contiguous run of tokens) are
decoded in one piece with the tokenizer, special tokens (``<|endoftext|>``) skipped, and
the UTF-8 bytes of that text are counted. The end-of-text tokens' losses are counted in
the nats, their bytes are 0. For a text (a file), it is encoded with
:func:`keel.data.text.encode_text` -- as training encodes it: a literal ``<|endoftext|>``
in the text is text --, an end-of-text token is put in front as the first context token,
so every token of the text is predicted, and B is the text's own UTF-8 byte count.

Everything runs in fp32 (no autocast), in eval mode, under ``torch.no_grad``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from keel.data import check_tokenizer_matches, split_windows, validation_tokens
from keel.data.text import encode_text, utf8_bytes
from keel.errors import KeelError, plural
from keel.train.nll import summed_nll
from keel.train.trainer import perplexity as _perplexity


@dataclass
class PerplexityResult:
    """Held-out loss of one model on one text. ``nats`` is the summed cross-entropy of
    ``tokens`` predicted tokens; ``bytes`` the UTF-8 bytes of their text."""

    source: str
    tokens: int
    bytes: int
    nats: float
    seq_len: int

    @property
    def loss(self) -> float:
        """Mean next-token cross-entropy, nats per token."""
        return self.nats / self.tokens

    @property
    def perplexity(self) -> float:
        """exp(loss); inf beyond a loss of 50 nats (:func:`keel.train.trainer.perplexity`)."""
        return _perplexity(self.loss)

    @property
    def bits_per_byte(self) -> float:
        """nats / ln 2 / bytes (see :func:`bits_per_byte`)."""
        return bits_per_byte(self.nats, self.bytes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(loss=self.loss, perplexity=self.perplexity, bits_per_byte=self.bits_per_byte)
        return d


def bits_per_byte(total_nats: float, n_bytes: int) -> float:
    """Bits per UTF-8 byte: ``total_nats / ln(2) / n_bytes`` (The Pile, Gao et al. 2020, Sec. 3).

    Raises ValueError if ``n_bytes`` < 1.
    """
    if n_bytes < 1:
        raise ValueError(f"bits per byte needs at least one byte of text, got {n_bytes}")
    return total_nats / math.log(2) / n_bytes


def _decoded_bytes(tokenizer, ids: list[int]) -> int:
    return len(tokenizer.decode(ids, skip_special_tokens=True).encode("utf-8"))


def text_perplexity(model, tokenizer, text: str, seq_len: int, device, eos_id: int | None = None,
                    source: str = "text", batch_size: int = 8) -> PerplexityResult:
    """Perplexity and bits per byte of ``model`` on ``text`` (str).

    Args:
        tokenizer: ``tokenizers.Tokenizer`` of the model.
        seq_len: tokens of context per window (<= the model's max_seq_len).
        eos_id: if given, put in front of the text so that its first token is predicted too;
            then bits per byte divide by the UTF-8 bytes of ``text`` itself (else by those of
            the predicted tokens' text, decoded).
    Raises:
        KeelError: the text gives fewer than one predicted token.
    """
    ids = encode_text(tokenizer, text)
    if eos_id is not None:
        ids = [eos_id] + ids
    if len(ids) < 2:
        raise KeelError(f"{source}: empty, no text to evaluate" if not text else
                        f"{source}: too little text to evaluate ({plural(len(ids), 'token')}, at least 2 needed)")
    nats, n = summed_nll(model, split_windows(ids, seq_len, keep_tail=True), batch_size, device)
    n_bytes = utf8_bytes(text) if eos_id is not None else _decoded_bytes(tokenizer, ids[1:])
    return PerplexityResult(source, n, n_bytes, nats, seq_len)


def validation_perplexity(model, tokenizer, data_dir: str | Path, seq_len: int, max_tokens: int | None,
                          device, batch_size: int = 8) -> PerplexityResult:
    """Perplexity and bits per byte on the validation split of a prepared dataset.

    Uses :func:`keel.data.validation_tokens` (``data_dir``, ``seq_len``, ``max_tokens``): the
    same windows the trainer's ``val_loss`` is measured on when ``seq_len`` =
    ``train.seq_len`` and ``max_tokens`` = ``train.eval_tokens``.

    Raises:
        KeelError: not a prepared dataset, a dataset whose tokenizer's vocabulary differs from
            ``tokenizer``'s (its ids are other text to the model: e.g. ``keel prepare --out`` again with
            another tokenizer, or an export scored on another run's data), or a validation split
            shorter than one window.
    """
    check_tokenizer_matches(tokenizer, data_dir)
    windows = validation_tokens(data_dir, seq_len, max_tokens)
    nats, n = summed_nll(model, windows, batch_size, device)
    targets = windows[:, 1:].reshape(-1).tolist()  # contiguous: val[1 : N*seq_len + 1]
    return PerplexityResult(f"validation split of {data_dir}", n, _decoded_bytes(tokenizer, targets), nats, seq_len)
