"""The chunked LM head + cross-entropy (keel.model.model.linear_cross_entropy) against the
unfused ``F.cross_entropy(F.linear(h, w).float(), t)``: loss and gradients, fp32 and bf16
autocast, ignored targets, chunks that do not divide the rows, tied embeddings."""

import math

import pytest
import torch
import torch.nn.functional as F

from keel import ModelConfig, Transformer
from keel.model.model import linear_cross_entropy


def cross_entropy_ref(h, w, t):
    """Mean over non-ignored rows of ``logsumexp(z) - z[t]``, z = h w^T (the definition)."""
    z = (h @ w.T).float()
    keep = t != -100
    nll = torch.logsumexp(z, -1) - z.gather(1, t.clamp_min(0)[:, None]).squeeze(1)
    return nll[keep].sum() / keep.sum()


def _case(n=37, d=16, v=50, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.5).requires_grad_()
    t = torch.randint(0, v, (n,), generator=g)
    if ignore:
        t[::5] = -100
    return h, w, t


def _loss_and_grads(fn, h, w, t):
    loss = fn(h, w, t)
    dh, dw = torch.autograd.grad(loss * 3.0, [h, w])  # an upstream gradient != 1
    return loss.detach(), dh, dw


@pytest.mark.parametrize("chunk_rows", [1, 8, 36, 37, 256])
def test_loss_matches_definition_and_gradients_match_autograd(chunk_rows):
    h, w, t = _case()
    fused = _loss_and_grads(lambda a, b, c: linear_cross_entropy(a, b, c, chunk_rows), h, w, t)
    ref = _loss_and_grads(lambda a, b, c: F.cross_entropy(F.linear(a, b).float(), c, ignore_index=-100), h, w, t)
    torch.testing.assert_close(fused[0], cross_entropy_ref(h, w, t).detach(), rtol=1e-6, atol=1e-6)
    for a, b in zip(fused, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_bf16_autocast_matches_autograd():
    h, w, t = _case(n=64, d=32, v=40, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = _loss_and_grads(lambda a, b, c: linear_cross_entropy(a, b, c, 16), h, w, t)
        ref = _loss_and_grads(lambda a, b, c: F.cross_entropy(F.linear(a, b).float(), c), h, w, t)
    assert fused[0].dtype == torch.float32 and fused[1].dtype == h.dtype and fused[2].dtype == w.dtype
    torch.testing.assert_close(fused[0], ref[0], rtol=1e-5, atol=1e-5)  # same bf16 logits, fp32 softmax
    for a, b in zip(fused[1:], ref[1:]):  # bf16 matmuls: dw is summed over chunks in fp32 here
        assert ((a - b).norm() / b.norm()).item() < 2 ** -7


def test_without_grad_and_all_ignored():
    h, w, t = _case(seed=2)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t, 8)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, cross_entropy_ref(h, w, t).detach(), rtol=1e-6, atol=1e-6)
    assert math.isnan(linear_cross_entropy(h.detach(), w.detach(), torch.full_like(t, -100)).item())


@pytest.mark.parametrize("tie", [False, True])
def test_model_loss_and_gradients_equal_unfused(tie):
    cfg = ModelConfig(vocab_size=300, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=96,
                      residual="keel", tie_embeddings=tie)
    torch.manual_seed(0)
    model = Transformer(cfg)
    ids = torch.randint(0, 300, (4, 96))
    targets = torch.roll(ids, -1, 1)
    targets[:, -1] = -100
    loss = model(ids, targets)  # 384 rows: two chunks of at most 256
    loss.backward()
    fused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = F.cross_entropy(model(ids).reshape(-1, 300), targets.reshape(-1), ignore_index=-100)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        torch.testing.assert_close(fused[n], p.grad, rtol=1e-4, atol=1e-6, msg=n)


@pytest.mark.parametrize("bad", [-5, -1, 50])
@pytest.mark.parametrize("grad", [False, True])
def test_a_target_outside_the_vocabulary_fails_as_in_torch(bad, grad):
    """Only -100 is ignored: any other target outside [0, V) fails, as F.cross_entropy fails. A negative one
    was clamped to 0 and scored as token 0 without a word (a fresh-user trial: targets of -5 gave the loss of
    all-zero targets)."""
    h, w, t = _case(ignore=False)
    t[3] = bad
    with pytest.raises((IndexError, RuntimeError)):
        F.cross_entropy(F.linear(h, w).float(), t)
    with torch.set_grad_enabled(grad), pytest.raises(RuntimeError, match="out of bounds"):
        linear_cross_entropy(h if grad else h.detach(), w if grad else w.detach(), t)
