"""Text in, text out: sampling a continuation of a prompt from a model."""

from __future__ import annotations

from collections.abc import Callable

import torch

from keel.data.prepare import EOS_TOKEN
from keel.data.text import encode_text


class TextStream:
    """Hands on the text of a growing sequence of token ids in pieces, as the ids come
    (``write(piece)``): each piece is the decoded text of the new ids, decoded after the last few
    ids already written (so a tokenizer whose decoder treats a sequence's first token apart, e.g.
    one that drops a leading space, joins up as the whole decodes). Ids that end in the middle of
    a character's bytes (U+FFFD at the end) wait for the next ones (up to 16 of them); :meth:`close`
    writes the rest."""

    CONTEXT = 8  # ids already written that each new piece is decoded after

    def __init__(self, tokenizer, write: Callable[[str], None]):
        self.tokenizer, self.write = tokenizer, write
        self.done: list[int] = []
        self.pending: list[int] = []

    def add(self, ids: list[int], final: bool = False) -> None:
        self.pending += ids
        context = self.done[-self.CONTEXT:]
        before = self.tokenizer.decode(context) if context else ""
        text = self.tokenizer.decode(context + self.pending)
        if text.endswith("\ufffd") and not final and len(self.pending) < 16:  # not for ever: invalid bytes stay
            return
        piece = text[len(before):] if text.startswith(before) else self.tokenizer.decode(self.pending)
        if piece:
            self.write(piece)
        self.done += self.pending
        self.pending = []

    def close(self) -> None:
        if self.pending:
            self.add([], final=True)


def sample_text(model: torch.nn.Module, tokenizer, prompt: str, max_new_tokens: int, device: torch.device,
                temperature: float = 0.8, top_k: int | None = 50, seed: int = 0,
                stream: Callable[[str], None] | None = None) -> str:
    """Decode ``max_new_tokens`` sampled tokens after ``prompt``; returns prompt + continuation.

    Args:
        model: a :class:`keel.model.Transformer` on ``device``.
        tokenizer: its ``tokenizers.Tokenizer`` (the prompt is encoded by
            :func:`keel.data.text.encode_text`, as training text is).
        temperature: 0 = greedy (see :meth:`keel.model.Transformer.generate`; any positive
            temperature works, one too small to divide by is greedy too).
        top_k: keep the k most likely tokens (None = all).
        seed: seeds the sampling generator (same seed, same text).
        stream: if given, called with the text in pieces as it is generated, the prompt's first
            (:class:`TextStream`): a long sample shows from its first token, not after minutes.

    An empty ``prompt`` starts a new document: the model continues the end-of-text token
    (``<|endoftext|>``; id 0 for a tokenizer without one).
    """
    eos = tokenizer.token_to_id(EOS_TOKEN)
    ids = encode_text(tokenizer, prompt) or [eos if eos is not None else 0]
    gen = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    shown = None
    if stream is not None:
        shown = TextStream(tokenizer, stream)
        shown.add(ids)
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens, temperature, top_k, generator=gen,
                         on_token=None if shown is None else lambda nxt: shown.add(nxt[0].tolist()))
    if shown is not None:
        shown.close()
    model.train(was_training)
    return tokenizer.decode(out[0].tolist())
