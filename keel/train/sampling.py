"""Text in, text out: sampling a continuation of a prompt from a model."""

from __future__ import annotations

import torch

from keel.data.prepare import EOS_TOKEN
from keel.data.text import encode_text


def sample_text(model: torch.nn.Module, tokenizer, prompt: str, max_new_tokens: int, device: torch.device,
                temperature: float = 0.8, top_k: int | None = 50, seed: int = 0) -> str:
    """Decode ``max_new_tokens`` sampled tokens after ``prompt``; returns prompt + continuation.

    Args:
        model: a :class:`keel.model.Transformer` on ``device``.
        tokenizer: its ``tokenizers.Tokenizer`` (the prompt is encoded by
            :func:`keel.data.text.encode_text`, as training text is).
        temperature: 0 = greedy (see :meth:`keel.model.Transformer.generate`; any positive
            temperature works, one too small to divide by is greedy too).
        top_k: keep the k most likely tokens (None = all).
        seed: seeds the sampling generator (same seed, same text).

    An empty ``prompt`` starts a new document: the model continues the end-of-text token
    (``<|endoftext|>``; id 0 for a tokenizer without one).
    """
    eos = tokenizer.token_to_id(EOS_TOKEN)
    ids = encode_text(tokenizer, prompt) or [eos if eos is not None else 0]
    gen = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    out = model.generate(torch.tensor([ids], device=device), max_new_tokens, temperature, top_k, generator=gen)
    model.train(was_training)
    return tokenizer.decode(out[0].tolist())
