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

import pytest
import torch

from keel import ModelConfig, Transformer
from keel.model import SCHEMES
from keel.model.residual import add_to_stream

ALL = sorted(SCHEMES)
B16, F16, F32 = torch.bfloat16, torch.float16, torch.float32

# name: (model dtype, autocast dtype, tolerance on the loss, on the logits, on every gradient).
# Worst errors measured over the 6 schemes (loss / logits / gradient): fp32 0 / 2.9e-7 / 9.3e-7
# (HC's static_alpha: 1.2e-5, the one fp32 gradient above 1e-6 -- a sum over every token, channel
# and stream whose terms cancel to 1e-3 of the model's largest gradient, fp32 rounding (6e-8) of
# terms ~200x larger than their sum; the fp32 tolerance 2e-5 is that bound);
# bf16-autocast 3.4e-5 / 6.5e-3 / 2.2e-2; bf16 2.3e-5 / 9.0e-3 / 2.1e-2; fp16 1.4e-6 / 1.1e-3 /
# 4.1e-3; bf16-model/fp16-autocast 4.1e-5 / 9.7e-3 / 2.6e-2; fp16-model/bf16-autocast 3.0e-5 /
# 6.0e-3 / 2.0e-2 (tests/test_precision.py::precision_errors).
PATHS = {
    "fp32": (F32, None, 1e-6, 2e-6, 2e-5),
    "bf16-autocast": (F32, B16, 2e-4, 3e-2, 8e-2),
    "bf16": (B16, None, 2e-4, 3e-2, 8e-2),
    "fp16": (F16, None, 1e-5, 4e-3, 1.6e-2),
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


# Open findings (marked xfail, not strict, so that the matrix keeps running them and a fix shows
# as XPASS). Fixed in v4: AttnRes in fp16 (its depth-attention RMS and softmax now run in fp32) and
# under a mixed fp16/bf16 pair (the stream's cat runs outside autocast); mHC's "3e10" was the
# relative error of gradients that are 0 up to rounding (:func:`grad_floor`).
OPEN = {("hyper_connections", p, "exported"): "HC exported: the static maps' gradients (near-cancelling sums "
        "over every token and channel) measure 0.04-0.26 relative error under HF's low-precision loss since HC's "
        "output projections start / sqrt(n) (native keel: within tolerance); open, issue 31"
        for p in ("bf16-autocast", "bf16", "fp16", "bf16-model/fp16-autocast", "fp16-model/bf16-autocast")}
OPEN[("mhc", None)] = ("mHC: phi's gradients at init (the n streams are equal copies, so they nearly cancel) measure "
                       "3.5e-4 relative error in fp32 and up to 5 in bf16 against the fp64 model, with every other "
                       "gradient in tolerance; open, issue 31")


def mark_open(request, scheme, path, *extra):
    """xfail (not strict) the (scheme, path) pairs listed in :data:`OPEN`."""
    reason = OPEN.get((scheme, None)) or OPEN.get((scheme, path)) or OPEN.get((scheme, path, *extra))
    if reason:
        request.applymarker(pytest.mark.xfail(reason=reason, strict=False))


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


def _errors(scheme, path):
    """(loss error, logits error, {parameter: gradient error}) of ``path`` against fp64."""
    dtype, autocast = PATHS[path][:2]
    torch.manual_seed(0)
    ref_model = Transformer(tiny(scheme)).double()
    with torch.no_grad():  # non-trivial gains
        for p in ref_model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model = Transformer(tiny(scheme)).to(dtype)
    model.load_state_dict(ref_model.state_dict())
    ids, targets = _batch()
    ref = _run(ref_model, None, ids, targets)
    got = _run(model, autocast, ids, targets, FP16_LOSS_SCALE if F16 in (dtype, autocast) else 1.0)
    assert got[0].isfinite() and all(g.isfinite().all() for g in got[2].values())
    floor = grad_floor(ref[2])
    return rel_err(got[0], ref[0]), rel_err(got[1], ref[1]), {n: rel_err(got[2][n], ref[2][n], floor) for n in ref[2]}


@functools.lru_cache(maxsize=None)
def gradient_conditions(scheme) -> dict[str, float]:
    """Each gradient's condition, measured: its fp32 relative error over fp32's unit roundoff,
    at least 1. A gradient that is a sum of terms cancelling to a small total (HC's static maps:
    ~200) has a rounding error of about (unit roundoff) x (condition) in any precision."""
    return {n: max(1.0, e / ROUNDOFF[F32]) for n, e in _errors(scheme, "fp32")[2].items()}


def precision_errors(scheme, path):
    """(loss error, logits error, worst gradient error over its allowance x the path's gradient
    tolerance). A gradient's allowance is the path's tolerance or, in bf16/fp16, the bound
    (unit roundoff of the lowest precision) x (its measured condition), whichever is larger."""
    loss, logits, grads = _errors(scheme, path)
    tol = PATHS[path][4]
    low = [d for d in (B16, F16) if d in PATHS[path][:2]]
    cond = gradient_conditions(scheme) if low else {}
    allowed = {n: max(tol, max(ROUNDOFF[d] for d in low) * cond[n]) if low else tol for n in grads}
    return loss, logits, tol * max(e / allowed[n] for n, e in grads.items())


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("scheme", ALL)
def test_forward_backward_against_fp64(scheme, path, request):
    """Loss, logits and every gradient of a 2-block model within the path's tolerance of fp64
    (in bf16/fp16 a gradient may also reach its measured condition's bound, see precision_errors)."""
    mark_open(request, scheme, path)
    errors = precision_errors(scheme, path)
    assert all(e <= tol for e, tol in zip(errors, PATHS[path][2:])), (errors, PATHS[path][2:])


@pytest.mark.parametrize("dtype", [B16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("scheme", ALL)
def test_pure_low_precision_trains_and_generates(scheme, dtype, request):
    """A model cast to bf16/fp16 takes AdamW steps (the loss falls) and generates with its KV cache
    exactly what it generates without one."""
    mark_open(request, scheme, {B16: "bf16", F16: "fp16"}[dtype])
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
    assert losses[-1] < losses[0] - 0.05, losses
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
def test_exported_code_every_precision_path(exported_class, scheme, path, tmp_path, request):
    """The exported modeling code, loaded by transformers in bf16/fp16 (``dtype=``) and run under
    each autocast: HF loss and gradients within the path's tolerance of the fp64 native model,
    and greedy ``generate`` with the cache equal to generation without it."""
    mark_open(request, scheme, path, "exported")
    dtype, autocast, tol_loss, _, tol_grad = PATHS[path]
    torch.manual_seed(0)
    ref = Transformer(tiny(scheme)).double()
    ids, _ = _batch()
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
        assert rel_err(p.grad.double() / scale, q.grad, floor) <= tol_grad, name
    assert torch.equal(cached, plain)
