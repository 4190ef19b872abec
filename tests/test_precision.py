"""Every precision path, every residual scheme, on CPU: forward + backward against an fp64
reference, and generation in the pure low-precision models.

Paths (model dtype, autocast dtype or None):

* ``fp32``: fp32 weights, no autocast;
* ``bf16-autocast``: fp32 weights, bf16 autocast (the CUDA default);
* ``bf16`` / ``fp16``: the whole model cast (``model.to(dtype)``), no autocast;
* ``bf16-model/fp16-autocast`` and ``fp16-model/bf16-autocast``: the mixed pairs (a bf16 stream
  receiving an fp16 sub-layer output and the reverse).

The reference is the same weights in fp64 (the chunked loss still forms fp32 logits, so
the reference is fp32-accurate there, far below any tolerance below). The error of a
tensor is ``max|got - ref| / max|ref|``; the tolerance per path is 3-4x the worst error
measured over the schemes on this CPU (bf16: 8 significant bits, fp16: 11), so a wrong
cast (a gradient lost, a low-precision stream where fp32 is expected) fails.
"""

import functools
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from keel import ModelConfig, Transformer
from keel.model import SCHEMES
from keel.model.residual.base import add_to_stream

ALL = sorted(SCHEMES)
B16, F16, F32 = torch.bfloat16, torch.float16, torch.float32

# name: (model dtype, autocast dtype, tolerance on the loss, on the logits, on every gradient).
# A gradient may also reach its rounding allowance (see allowances: a sum of cancelling terms is
# off by about u x its condition in any precision). Worst errors measured over the ten schemes
# (loss / logits / well-conditioned gradient), `python tests/test_precision.py`:
# fp32 0 / 2.9e-7 / 9.3e-7; bf16-autocast 5.1e-5 / 6.6e-3 / 2.2e-2; bf16 4.6e-5 / 9.2e-3 / 2.7e-2;
# fp16 9.0e-6 / 1.1e-3 / 4.1e-3; bf16-model/fp16-autocast 6.0e-5 / 9.7e-3 / 3.4e-2;
# fp16-model/bf16-autocast 3.0e-5 / 6.6e-3 / 2.0e-2. Each tolerance is ~2-4x its worst.
PATHS = {
    "fp32": (F32, None, 1e-6, 1e-6, 4e-6),
    "bf16-autocast": (F32, B16, 2e-4, 3e-2, 8e-2),
    "bf16": (B16, None, 2e-4, 3e-2, 8e-2),
    "fp16": (F16, None, 2e-5, 4e-3, 1.6e-2),
    "bf16-model/fp16-autocast": (B16, F16, 2e-4, 3e-2, 8e-2),
    "fp16-model/bf16-autocast": (F16, B16, 2e-4, 3e-2, 8e-2),
}


# Paths with fp16 backpropagate a scaled loss, as ``torch.amp.GradScaler`` does: unscaled, the
# smallest gradients here (~4e-9, the first block's q/k under a near-uniform attention) are
# below fp16's smallest subnormal (6e-8) and flush to 0 -- fp16's range, not a keel bug.
FP16_LOSS_SCALE = 2.0 ** 14


@pytest.fixture(autouse=True)
def _threads(one_thread):
    yield


def tiny(scheme):
    return ModelConfig(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, max_seq_len=16,
                       residual=scheme)


def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 61, (2, 12), generator=g), torch.randint(0, 61, (2, 12), generator=g)


def _run(model, autocast, ids, targets, loss_scale=1.0):
    """Loss, logits and the gradient of every parameter (fp64 copies, divided by ``loss_scale``)."""
    ctx = torch.autocast("cpu", dtype=autocast) if autocast is not None else torch.autocast("cpu", enabled=False)
    with ctx:
        loss = model(ids, targets)
    (loss * loss_scale).backward()
    with torch.no_grad(), ctx:
        logits = model(ids)
    grads = {n: p.grad.double() / loss_scale for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach().double(), logits.double(), grads


def rel_err(got, ref, floor=1e-30):
    """``max|got - ref| / max|ref|``, the denominator at least ``floor``."""
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(floor))


def grad_floor(grads):
    """The smallest gradient scale a relative error is taken against: 1e-6 of the largest
    gradient of the model. A tensor whose fp64 gradient is smaller (mHC's static maps at init:
    |grad| <= 1e-22, an exact 0 up to rounding, since the n equal streams cancel) is compared
    absolutely, relative to that scale: its "relative error" of 3e10 measured rounding of 0."""
    return 1e-6 * max(float(g.abs().max()) for g in grads.values())


# Unit roundoff (half the gap between 1 and the next number) of each dtype.
ROUNDOFF = {F32: 2.0 ** -24, B16: 2.0 ** -8, F16: 2.0 ** -11}


def _reference(scheme):
    """The fp64 model the paths are compared against: seed 0, every gain, bias and scalar gate moved by
    N(0, 0.1^2) so that no gain is exactly 1 (and a gate that starts at 0, ReZero-style, does not zero
    every gradient of the sub-layers behind it: a new scheme's trial found the test then vacuous)."""
    torch.manual_seed(0)
    model = Transformer(tiny(scheme)).double()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() <= 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


class RoundingNoise(TorchDispatchMode):
    """Monte Carlo arithmetic (Parker 1997; Stott Parker, Pierce & Eggert 2000): every fp64 result
    of every operation, forward and backward, multiplied by ``1 + u * U(-1, 1)`` -- a simulation
    of rounding at unit roundoff ``u`` that does not use the low-precision code under test."""

    def __init__(self, u: float, seed: int):
        super().__init__()
        self.u, self.gen = u, torch.Generator().manual_seed(seed)

    def _perturb(self, t):
        if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
            return t * (1 + self.u * (2 * torch.rand(t.shape, generator=self.gen, dtype=t.dtype) - 1))
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return tree_map(self._perturb, func(*args, **(kwargs or {})))


def rounding_conditions(model, ids, targets, samples=3) -> dict[str, float]:
    """Each gradient's condition, measured in fp64: the largest relative change of the gradient
    (against :func:`grad_floor`) over ``samples`` runs under :class:`RoundingNoise` at fp32's unit
    roundoff, divided by that roundoff, at least 1. A gradient that is a sum of terms cancelling to
    a small total has a large condition: HC's static maps (~200: sums over every token, channel and
    stream); mHC's b_res (~2e4: at init the n streams are equal copies, so dL/dH_res has equal
    columns, which the Sinkhorn's Jacobian maps to ~0) and b_pre / phi_res (~1e3-5e3). Any
    arithmetic that rounds at u is expected to be off by about u x condition."""
    u = ROUNDOFF[F32]
    ref = _run(model, None, ids, targets)[2]
    floor = grad_floor(ref)
    worst = dict.fromkeys(ref, 1.0)
    for seed in range(samples):
        with RoundingNoise(u, seed):
            got = _run(model, None, ids, targets)[2]
        worst = {n: max(worst[n], rel_err(got[n], ref[n], floor) / u) for n in ref}
    return worst


# An allowance is SAFETY x (unit roundoff) x (condition): the Monte Carlo samples estimate a typical
# error, the largest measured error of a real path over that estimate is 2.1 (pre_ln's norm gains, fp32).
SAFETY = 4.0


def allowances(path, conditions) -> dict[str, float]:
    """Each gradient's tolerance on ``path``: the path's tolerance or SAFETY x (unit roundoff of the
    path's lowest precision) x (the gradient's measured condition), whichever is larger."""
    u = max(ROUNDOFF[d] for d in PATHS[path][:2] if d is not None)
    return {n: max(PATHS[path][4], SAFETY * u * c) for n, c in conditions.items()}


@functools.lru_cache(maxsize=None)
def reference_conditions(scheme) -> dict[str, float]:
    return rounding_conditions(_reference(scheme), *_batch())


def _errors(scheme, path):
    """(loss error, logits error, {parameter: gradient error}) of ``path`` against fp64."""
    dtype, autocast = PATHS[path][:2]
    ref_model = _reference(scheme)
    model = Transformer(tiny(scheme)).to(dtype)
    model.load_state_dict(ref_model.state_dict())
    ids, targets = _batch()
    ref = _run(ref_model, None, ids, targets)
    got = _run(model, autocast, ids, targets, FP16_LOSS_SCALE if F16 in (dtype, autocast) else 1.0)
    assert got[0].isfinite() and all(g.isfinite().all() for g in got[2].values())
    floor = grad_floor(ref[2])
    return rel_err(got[0], ref[0]), rel_err(got[1], ref[1]), {n: rel_err(got[2][n], ref[2][n], floor) for n in ref[2]}


def precision_errors(scheme, path):
    """(loss error, logits error, worst gradient error over its allowance x the path's gradient
    tolerance), see :func:`allowances`."""
    loss, logits, grads = _errors(scheme, path)
    allowed = allowances(path, reference_conditions(scheme))
    return loss, logits, PATHS[path][4] * max(e / allowed[n] for n, e in grads.items())


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("scheme", ALL)
def test_forward_backward_against_fp64(scheme, path):
    """Loss, logits and every gradient of a 2-block model within the path's tolerance of fp64
    (in bf16/fp16 a gradient may also reach its measured condition's bound, see precision_errors)."""
    errors = precision_errors(scheme, path)
    assert all(e <= tol for e, tol in zip(errors, PATHS[path][2:])), (errors, PATHS[path][2:])


@pytest.mark.parametrize("dtype", [B16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scheme", ALL)
def test_pure_low_precision_trains_and_generates(scheme, dtype):
    """A model cast to bf16/fp16 takes AdamW steps (the loss falls) and generates with its KV cache
    exactly what it generates without one."""
    torch.manual_seed(0)
    model = Transformer(tiny(scheme)).to(dtype)
    ids, targets = _batch()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    losses = []
    for _ in range(5):
        loss = model(ids, ids.roll(-1, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    # in pure fp16 AdamW's second moment underflows (g^2 < 6e-8 is 0), so its steps are about lr * sign(g) and the
    # loss may bounce back up at one step (post_ln at step 5 on one CPU, not on another): the best of steps 3-5 counts
    assert all(math.isfinite(x) for x in losses) and min(losses[2:]) < losses[0] - 0.5, losses
    model.eval()
    cached = model.generate(ids[:, :4], 6, temperature=0)
    plain = model.generate(ids[:, :4], 6, temperature=0, use_cache=False)
    assert cached.shape == (2, 10) and torch.equal(cached, plain)


@pytest.mark.parametrize("x_dtype,h_dtype", [(B16, F16), (F16, B16), (F32, B16), (B16, F32)])
def test_add_to_stream_every_dtype_pair(x_dtype, h_dtype):
    """The stream keeps its dtype for every pair (the bf16 + fp16 pair recursed forever before)."""
    x = torch.randn(2, 3, 4).to(x_dtype)
    h = torch.randn(2, 3, 4).to(h_dtype)
    out = add_to_stream(x, h)
    assert out.dtype == x_dtype
    torch.testing.assert_close(out.double(), (x.double() + h.to(x_dtype).double()), rtol=0, atol=0.02)


@pytest.fixture(scope="module")
def exported_class(tmp_path_factory):
    """The ``KeelForCausalLM`` class of a generated ``modeling_keel.py`` (transformers' remote-code loader)."""
    pytest.importorskip("transformers")
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    from keel.hf import KeelConfig, KeelForCausalLM
    from keel.hf.remote import write_remote_code

    folder = tmp_path_factory.mktemp("remote")
    KeelForCausalLM(KeelConfig.from_model_config(tiny("keel"))).save_pretrained(folder)
    auto_map = write_remote_code(folder)
    cls = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], str(folder))
    assert cls.__module__.startswith("transformers_modules.") and cls is not KeelForCausalLM
    return cls


@pytest.mark.parametrize("path", [p for p in PATHS if p != "fp32"])
@pytest.mark.parametrize("scheme", ALL)
def test_exported_code_every_precision_path(exported_class, scheme, path, tmp_path):
    """The exported modeling code, loaded by transformers in bf16/fp16 (``dtype=``) and run under
    each autocast: HF loss and gradients within the path's tolerance of the fp64 native model
    (a gradient within its :func:`allowances`),
    and greedy ``generate`` with the cache equal to generation without it."""
    dtype, autocast, tol_loss = PATHS[path][:3]
    ref = _reference(scheme)
    ids, _ = _batch()
    allowed = allowances(path, rounding_conditions(ref, ids[:, :-1], ids[:, 1:]))
    ref_loss = ref(ids[:, :-1], ids[:, 1:])
    ref_loss.backward()
    config = exported_class.config_class.from_model_config(tiny(scheme))
    hf = exported_class(config).to(dtype)
    hf.model.load_state_dict(ref.state_dict())
    scale = FP16_LOSS_SCALE if F16 in (dtype, autocast) else 1.0
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        loss = hf(ids, labels=ids).loss
        (loss * scale).backward()
        hf.eval()
        with torch.no_grad():
            cached = hf.generate(ids[:, :4], max_new_tokens=5, do_sample=False, use_cache=True)
            plain = hf.generate(ids[:, :4], max_new_tokens=5, do_sample=False, use_cache=False)
    assert rel_err(loss.detach().double(), ref_loss.detach()) <= tol_loss
    floor = grad_floor({n: q.grad for n, q in ref.named_parameters()})
    for (name, p), (_, q) in zip(hf.model.named_parameters(), ref.named_parameters()):
        assert rel_err(p.grad.double() / scale, q.grad, floor) <= allowed[name], name
    assert torch.equal(cached, plain)


if __name__ == "__main__":  # the measured worst errors quoted above PATHS
    torch.set_num_threads(1)
    for name in ALL:
        cells = []
        for p in PATHS:
            loss_err, logits_err, grad_errs = _errors(name, p)
            allowed = allowances(p, reference_conditions(name))
            ratio = max(grad_errs[n] / allowed[n] for n in grad_errs)
            cells.append(f"{p} {loss_err:.1e}/{logits_err:.1e} worst/allowed {ratio:.2f}")
        print(name, " | ".join(cells), flush=True)
