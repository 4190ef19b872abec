"""Gradient-flow profile: per-sub-layer gradient norms and the residual-path Jacobian J*.

``keel gradflow`` builds each requested model (at initialisation, or from a trained run with
``--run``), runs one batch of real validation tokens forward and backward, and measures for
every sub-layer i = 0 .. L-1 (sub-layer 2b is block b's attention, 2b + 1 its FFN; L = 2 *
n_layers):

* ``param_grad_norm[i]``: the L2 norm of the gradient of the loss w.r.t. all parameters of
  sub-layer i -- the sub-layer F itself plus its residual unit's norms (for attention, its
  QKV norms too). This is :func:`sublayer_grad_norms`, which the trainer also logs every
  ``train.gradflow_every`` steps as ``sublayer_grad_norm`` in ``metrics.jsonl``.
* ``stream_grad_norm[i]``: the L2 norm (over the whole [B, T, d] tensor) of the gradient of
  the loss w.r.t. the residual stream right after sub-layer i.
* ``jacobian_star[i]``: the spectral norm J*_i of the residual-path ("shortcut") Jacobian of
  sub-layer i, as the Keel paper's Sec. 3 analysis defines it (Chen & Wei 2026, arXiv
  2601.19895): the derivative of the unit's output w.r.t. its input stream x *with the
  branch F's output held fixed* at its actual value. For ``x <- Norm(a * x + F)`` that is
  ``a * J_Norm(a * x + F)``; for Pre-LN's ``x <- x + F(Norm(x))`` it is the identity (J* = 1).
  Every residual unit here acts on each token separately once F is fixed, so the Jacobian
  is block-diagonal over tokens (for a multi-stream scheme, HC/mHC/AttnRes, a token's
  block is its m x d entries of the [m, B, T, d] stream: J* is then over all streams);
  J*_i is computed per token by the Lanczos method on
  ``J^T J`` (``torch.func.jvp`` and ``torch.func.vjp``, float64; see
  :func:`jacobian_spectral_norms`) and summarised over the B*T tokens by the geometric
  mean. The paper predicts J* ~ gamma_l / (sqrt(2) * gamma_{l-1}) for Post-LN (so the
  product over L sub-layers decays like 2^(-L/2)) and
  ``alpha * gamma / sqrt(alpha^2 gamma^2 + gamma_F^2)`` for Keel (product -> 1 with
  alpha = L). Block 0 reads the raw embedding (RMS ~ init_std), so its norms have
  J* ~ 1/init_std at any depth; ``log10_jacobian_product_from_block1`` leaves it out.
* ``jacobian_product``: ``prod_i J*_i`` = ``exp(sum_i mean_tokens log J*_i(token))``,
  accumulated in log space (``log10_jacobian_product`` holds the exact value; the plain
  product is clamped to [0, max float] so that 1024 sub-layers never make JSON invalid).
* ``stream_ratio_first_last`` / ``stream_ratio_block1_last``: the stream gradient norm
  after sub-layer 0 (resp. 2) divided by that after sub-layer L-1 (``stream_ratio_block1_last``
  is None for one block, which has no sub-layer 2).
* with ``--full-jacobian``: also the spectral norm of each sub-layer's *full* Jacobian
  (branch included; attention couples the tokens of a sequence, so per sequence), and its
  product in log space (``log10_full_jacobian_product``).

Usage::

    keel gradflow --residual pre_ln,post_ln,keel --sublayers 16,64,256,1024 [--d-model 64]
                  [--batch-size 4] [--seq-len 64] [--seed 0] [--json] [--plot FILE]
    keel gradflow --residual keel,pre_ln --loop 1,8,1 --sublayers 64,256,1024   # looped, effective depths
    keel gradflow --run runs/a --run runs/b [--loops R] [--json] [--plot FILE]

A looped model (prelude, core x R, coda: ``model.loop_*``) is profiled per *applied* sub-layer: i runs
over the L = 2 (P + R C + Q) sub-layers one pass applies, each application of a core sub-layer with its own
input, stream gradient and J*, and as ``param_grad_norm[i]`` its own part of the shared weights' gradient
(which is the sum of those parts): :func:`profile_model` profiles
:meth:`keel.model.Transformer.unrolled` (copies of the shared blocks, ``share_weights=False``), whose
logits equal the looped model's. ``keel gradflow --loop P,C,Q`` profiles fresh looped models whose
``--sublayers`` are these effective depths (R = (L/2 - P - Q) / C); ``--run`` profiles a looped run at its
``model.loop_repeats``, or at ``--loops R``.

A summary table (one line per profile, as it finishes) is logged on stderr; ``--json``
prints the full results on stdout.

The command itself is in :mod:`keel.cli.commands.science`; :func:`profile_runs` and
:func:`profile_schemes` are what it calls. Heavy modules (torch, matplotlib) are imported
inside the functions.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import matplotlib
import matplotlib.pyplot as plt
import torch
from torch.func import jvp, vjp
from torch.nn.attention import SDPBackend, sdpa_kernel

from keel.config import ModelConfig, TrainConfig, resolve_vocab_size
from keel.data import read_meta, resolve_data, validation_tokens
from keel.errors import KeelError, plural
from keel.model import SCHEMES, Transformer, check_model_config, count_parameters
from keel.run import Run
from keel.train.device import activation_floor_bytes, host_memory_bytes
from keel.train.parallelize import unwrap
from keel.train.plots import save_figure
from keel.train.progress import heartbeat, interactive

_log = logging.getLogger(__name__)  # the summary table, one line per finished profile

DEFAULT_LAYERS = "16,64"
DEFAULT_WIDTH = DEFAULT_SEQ_LEN = 64  # --d-model of the init-mode models; --seq-len (a run: at most its max)
# The head width of the init-mode models (``--d-model``): a multiple of it, or one head below it.
HEAD_DIM = 32
# From this depth on a profile takes minutes or more on a CPU: say what is running before it starts.
LONG_SUBLAYERS = 1024
HEARTBEAT_S = 15.0  # at LONG_SUBLAYERS and deeper: a "still working" line this often while a model is built or run


# ---- the model's sub-layers ------------------------------------------------------------

def _plain(model):
    """The plain :class:`keel.model.Transformer` inside DDP or ``torch.compile`` wrappers."""
    plain = unwrap(model)
    if not isinstance(plain, Transformer):
        raise KeelError("gradflow expects a keel Transformer")
    return plain


def sublayer_modules(model) -> list[tuple[Any, Any]]:
    """``[(F, unit), ...]`` for sub-layers 0 .. L-1 in the paper's order
    (:meth:`keel.model.Transformer.sublayers`)."""
    return [(f, unit) for _, unit, f in _plain(model).sublayers()]


def sublayer_grad_norms(model) -> list[float]:
    """Per-sub-layer parameter gradient norm, after a backward pass.

    Entry i (0 .. L-1, L = 2 * n_layers; 2b = block b's attention, 2b + 1 its FFN) is
    ``sqrt(sum ||p.grad||^2)`` over the parameters of sub-layer i's F and of its residual
    unit (the unit's RMSNorm gains; for attention also the QKV-norm gains), in float64,
    returned as Python floats. Parameters without a gradient count as 0. Read from
    ``p.grad`` as it is, i.e. before any clipping if called before the clip. Under FSDP2 the
    gradient shards are gathered (``DTensor.full_tensor``), so every rank must call it.

    Raises:
        KeelError: ``model`` is not a keel Transformer.
    """
    norms = []
    for modules in sublayer_modules(model):
        total = torch.zeros((), dtype=torch.float64)
        for module in modules:
            for p in module.parameters():
                if p.grad is not None:
                    g = p.grad.detach()
                    if hasattr(g, "full_tensor"):  # FSDP2 DTensor shard -> the full gradient
                        g = g.full_tensor()
                    total = total + g.double().pow(2).sum().cpu()
        norms.append(math.sqrt(float(total)))
    return norms


# ---- Jacobian spectral norms ------------------------------------------------------------

def jacobian_spectral_norms(fn, x, group_dims: int = 1, iters: int = 32, seed: int = 0):
    """Largest singular value of the Jacobian J of ``fn`` at ``x``, per group, by the
    Lanczos method with full re-orthogonalisation on ``J^T J`` (Rayleigh-Ritz on the Krylov
    subspace ``span{v, J^T J v, ...}``), with ``torch.func.jvp`` (J v) and
    ``torch.func.vjp`` (J^T u) -- no Jacobian is ever formed.

    Args:
        fn: a map from tensors of ``x``'s shape to tensors of the same shape that acts on
            each group independently (its Jacobian is block-diagonal over groups).
        x: the point, e.g. [B, T, d] (its dtype is used; pass float64 for accuracy).
        group_dims: how many trailing dims form one group: 1 = per token (vector of d),
            2 = per sequence ([T, d]).
        iters: Krylov dimension (at most; capped at the group size, where the answer is
            exact). It stops early once the subspace is invariant in every group (e.g. J = I).
        seed: seed of the random start vector.
    Returns:
        sigma_max per group, shape ``x.shape[:-group_dims]``, float64. A Ritz value: a lower
        bound that converges to ||J||_2 much faster than power iteration when the top
        singular values are close.
    """
    x = x.contiguous()  # an expanded input (HC/mHC's n copies of the embedding, stride 0) cannot carry a tangent
    gshape = x.shape[:x.dim() - group_dims]
    n = math.prod(x.shape[x.dim() - group_dims:])
    m = max(1, min(iters, n))
    gen = torch.Generator(device="cpu").manual_seed(seed)
    v = torch.randn(x.shape, generator=gen, dtype=x.dtype).to(x.device).reshape(*gshape, n)
    v = v / v.norm(dim=-1, keepdim=True)
    tiny = torch.finfo(x.dtype).tiny
    basis, images = [], []
    with torch.enable_grad():
        _, vjp_fn = vjp(fn, x)
        for _ in range(m):
            _, jv = jvp(fn, (x,), (v.reshape(x.shape),))
            av = vjp_fn(jv.detach())[0].detach().reshape(*gshape, n)  # J^T J v
            basis.append(v)
            images.append(av)
            Q = torch.stack(basis, -1)  # [*, n, j], orthonormal columns
            w = av
            for _ in range(2):  # full re-orthogonalisation, twice
                w = w - (Q @ (Q.transpose(-1, -2) @ w.unsqueeze(-1))).squeeze(-1)
            norm = w.norm(dim=-1, keepdim=True)
            alive = norm > 1e-9 * av.norm(dim=-1, keepdim=True) + tiny
            if not bool(alive.any()):
                break
            v = torch.where(alive, w / norm.clamp_min(tiny), torch.zeros_like(w))
    Q, AQ = torch.stack(basis, -1).double(), torch.stack(images, -1).double()
    H = Q.transpose(-1, -2) @ AQ
    H = (H + H.transpose(-1, -2)) / 2
    return torch.linalg.eigvalsh(H)[..., -1].clamp_min(0).sqrt()


class _Recorder:
    """Hooks on every residual unit for one forward/backward: records each unit's input
    stream x, its branch output F(...) (detached), the branch callable, and the gradient
    norm w.r.t. its output stream."""

    def __init__(self, model):
        self.pairs = sublayer_modules(model)
        L = len(self.pairs)
        self.inputs: list = [None] * L
        self.branch_out: list = [None] * L
        self.branch_fn: list = [None] * L
        self.stream_grad: list = [None] * L
        self.handles = []

    def __enter__(self):
        for i, (_, unit) in enumerate(self.pairs):
            self.handles.append(unit.register_forward_pre_hook(self._pre_hook(i)))
            self.handles.append(unit.register_forward_hook(self._post_hook(i)))
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        self.handles = []

    def _pre_hook(self, i):
        def hook(module, args):
            x, f = args
            self.inputs[i] = tuple(t.detach() for t in x) if isinstance(x, tuple) else x.detach()
            self.branch_fn[i] = f

            def recorded(h):
                out = f(h)
                self.branch_out[i] = out.detach()
                return out
            return (x, recorded)
        return hook

    def _post_hook(self, i):
        def hook(module, args, output):
            if isinstance(output, tuple):  # AttnRes' sources: the norm over all of them, each source's
                # gradient through this output only (aliases: a source is also read by the sub-layers before it)
                output = tuple(t.view_as(t) for t in output)
                for t in output:
                    if t.requires_grad:
                        t.register_hook(lambda g: self._add_stream_grad(i, g))
                return output
            if output.requires_grad:
                def grad_hook(g):
                    self.stream_grad[i] = float(g.detach().double().norm())
                output.register_hook(grad_hook)
            return None
        return hook

    def _add_stream_grad(self, i: int, g: torch.Tensor) -> None:
        self.stream_grad[i] = math.hypot(self.stream_grad[i] or 0.0, float(g.detach().double().norm()))


def _streams(x) -> int:
    """1 for a multi-stream input ([m, B, T, d]: HC, mHC; a tuple of m [B, T, d] sources: AttnRes),
    0 for [B, T, d]."""
    return int(isinstance(x, tuple) or x.dim() == 4)


def _cast(x, dtype: torch.dtype):
    """A unit's recorded input (a tensor, or AttnRes' tuple of sources) in ``dtype``."""
    return tuple(t.to(dtype) for t in x) if isinstance(x, tuple) else x.to(dtype)


def _per_token(unit, x, f):
    """``(fn, z)`` for :func:`jacobian_spectral_norms`: the unit as a map of z, its input
    with the token axes first. A multi-stream input [m, B, T, d] becomes [B, T, m, d] (one
    token's group is its m x d stream entries, which the unit mixes), and the output goes
    back the same way (AttnRes' output may have more streams than its input: only J^T J,
    input-shaped, is used); AttnRes' tuple of m sources is stacked so, and unstacked for the unit."""
    if isinstance(x, tuple):
        return ((lambda z: torch.stack(unit(tuple(z.movedim(-2, 0).unbind(0)), f)).movedim(0, -2)),
                torch.stack(x).movedim(0, -2))
    if not _streams(x):
        return (lambda z: unit(z, f)), x
    return (lambda z: unit(z.movedim(-2, 0), f).movedim(0, -2)), x.movedim(0, -2)


class _Eta:
    """Progress of a deep profile's per-sub-layer Jacobians: a log line at every tenth of the
    sub-layers with the time left, extrapolated from the time per sub-layer so far."""

    def __init__(self, total: int):
        self.total, self.t0, self.every = total, time.perf_counter(), max(1, total // 10)

    def step(self, i: int) -> None:
        if i and i % self.every == 0:
            left = (time.perf_counter() - self.t0) / i * (self.total - i)
            _log.info("gradflow: Jacobians of sub-layer %s of %s, about %.0f s left", f"{i:,}", f"{self.total:,}",
                      left)


def _beating(long: bool, what: str):
    """:func:`keel.train.progress.heartbeat` every :data:`HEARTBEAT_S` for a deep model's long
    silent steps (``long``), else nothing."""
    return heartbeat(_log, what, HEARTBEAT_S) if long else contextlib.nullcontext()


def _log10_product(logs_e: list[float]) -> float:
    return sum(logs_e) / math.log(10)


def _clamped_pow10(log10: float) -> float:
    if log10 < -307:
        return 0.0
    if log10 > 308:
        return sys.float_info.max
    return 10.0 ** log10


def profile_model(model, batch, jacobian_iters: int = 32, full_jacobian: bool = False, seed: int = 0) -> dict:
    """The gradient-flow profile of ``model`` on one batch (see the module docstring).

    Args:
        model: a keel Transformer (its current weights; its gradients are overwritten).
        batch: LongTensor [B, T + 1] of token ids; inputs ``batch[:, :-1]``, targets
            ``batch[:, 1:]``.
        jacobian_iters: Krylov dimension of the Lanczos estimate per sub-layer (at most).
        full_jacobian: also estimate each sub-layer's full Jacobian spectral norm (per
            sequence, fp32; costs about ``2 * jacobian_iters`` extra sub-layer passes).
    Returns:
        dict with ``loss`` (nats/token), ``param_grad_norm``, ``stream_grad_norm``,
        ``jacobian_star`` (lists of L floats), ``jacobian_product``,
        ``log10_jacobian_product``, ``log10_jacobian_product_from_block1`` (sub-layers
        2 .. L-1 only), ``stream_ratio_first_last`` (stream grad norm after sub-layer 0 over
        that after sub-layer L-1), ``stream_ratio_block1_last`` (after sub-layer 2 over
        after L-1) and, with ``full_jacobian``, ``full_jacobian``,
        ``log10_full_jacobian_product``. A looped model (at its ``loops``): per applied sub-layer
        (module docstring), plus ``loop`` and ``weight_sublayer`` (each one's sub-layer of weights).
    """
    plain = _plain(model)
    if plain.cfg.loop_core:  # its own copy of each application (model's gradients stay as they were)
        out = profile_model(plain.unrolled(share_weights=False), batch, jacobian_iters, full_jacobian, seed)
        return {**out, **loop_layout(plain)}
    plain.zero_grad(set_to_none=True)
    depth = getattr(getattr(plain, "cfg", None), "n_sublayers", 0)
    with _beating(depth >= LONG_SUBLAYERS, f"gradflow: forward and backward pass through {depth:,} sub-layers"):
        with _Recorder(plain) as rec:
            loss = plain(batch[:, :-1], batch[:, 1:])
        loss.backward()
    out: dict[str, Any] = {"loss": float(loss.detach())}
    out["param_grad_norm"] = sublayer_grad_norms(plain)
    out["stream_grad_norm"] = [g if g is not None else 0.0 for g in rec.stream_grad]

    log_js, log_full = [], []
    eta = _Eta(len(rec.pairs)) if len(rec.pairs) >= LONG_SUBLAYERS else None
    for i, (_, unit) in enumerate(rec.pairs):
        if eta is not None:
            eta.step(i)
        f_fixed = rec.branch_out[i].double()
        sigma = jacobian_spectral_norms(*_per_token(unit, _cast(rec.inputs[i], torch.float64), lambda _h, f=f_fixed: f),
                                        group_dims=_streams(rec.inputs[i]) + 1, iters=jacobian_iters, seed=seed + i)
        log_js.append(float(sigma.clamp_min(torch.finfo(sigma.dtype).tiny).log().mean()))
        if full_jacobian:
            # the math SDPA kernel is composite, so forward-mode AD (jvp) runs through it
            with sdpa_kernel(SDPBackend.MATH):
                s_full = jacobian_spectral_norms(*_per_token(unit, _cast(rec.inputs[i], torch.float32), rec.branch_fn[i]),
                                                 group_dims=_streams(rec.inputs[i]) + 2, iters=jacobian_iters,
                                                 seed=seed + i)
            log_full.append(float(s_full.double().clamp_min(1e-300).log().mean()))
    out["jacobian_star"] = [math.exp(v) for v in log_js]
    out["log10_jacobian_product"] = _log10_product(log_js)
    out["jacobian_product"] = _clamped_pow10(out["log10_jacobian_product"])
    # Block 0 sees the raw embedding (RMS ~ init_std), so its norms have J* ~ 1/init_std
    # whatever the depth; the product over blocks 1 .. n-1 is the depth-dependent part.
    out["log10_jacobian_product_from_block1"] = _log10_product(log_js[2:])
    s = out["stream_grad_norm"]
    out["stream_ratio_first_last"] = s[0] / s[-1] if s[-1] > 0 else None  # None: no gradient at the top
    # None also for one block: it has no sub-layer 2 (s[1] / s[1] = 1 was shown as a ratio)
    out["stream_ratio_block1_last"] = s[2] / s[-1] if len(s) > 2 and s[-1] > 0 else None
    if full_jacobian:
        out["full_jacobian"] = [math.exp(v) for v in log_full]
        out["log10_full_jacobian_product"] = _log10_product(log_full)
    return out


# ---- profiles of runs and of fresh models -----------------------------------------------

def loop_layout(model) -> dict:
    """A looped ``model``'s shape at its current count: ``{"loop": {prelude, core, coda, repeats,
    trained_repeats} (blocks), "weight_sublayer": [the sub-layer of weights of each applied sub-layer]}``."""
    return {"loop": model.loop_shape(),
            "weight_sublayer": [2 * b + k for b in model.depth_order() for k in (0, 1)]}


def loop_repeats_for(sublayers: int, loop: tuple[int, int, int]) -> int:
    """R such that a loop of P prelude, C core and Q coda blocks (``loop``) applies ``sublayers`` =
    2 (P + R C + Q) sub-layers. Raises KeelError (naming ``--loop``) when no integer R >= 1 does."""
    P, C, Q = loop
    R, rest = divmod(sublayers // 2 - P - Q, C)
    if R < 1 or rest or sublayers % 2:
        raise KeelError(f"--loop {P},{C},{Q}: {sublayers} sub-layers is not 2 (P + R C + Q) = 2 ({P} + R x {C} + {Q}) "
                        f"for an integer R >= 1 (e.g. {2 * (P + C + Q)}, {2 * (P + 2 * C + Q)})")
    return R


_NO_LOOP_MODEL = ModelConfig()  # the loop keys' defaults: no loop


def _check_config_loop(m, depths: Sequence[int], loop: tuple[int, int, int] | None) -> None:
    """The init-mode profile's depths are ``depths`` (sub-layers) as named: the base config's own loop keys
    (``m``, a ModelConfig: ``loop_prelude``, ``loop_core``, ``loop_repeats``) may neither be replaced by
    ``loop`` (``--loop P,C,Q``) nor, without one, make a model of L sub-layers apply more than L.

    Raises:
        KeelError: one line naming the config's loop keys and what they would do.
    """
    own = [k for k in ("loop_prelude", "loop_core", "loop_repeats") if getattr(m, k) != getattr(_NO_LOOP_MODEL, k)]
    if not own:
        return
    listed = ", ".join(f"model.{k} = {getattr(m, k)}" for k in own)
    if loop is not None:
        raise KeelError(f"--loop {','.join(map(str, loop))} sets every profile's loop; the config's {listed} would be "
                        "ignored: drop it")
    P, C, R = m.loop_prelude, m.loop_core, m.loop_repeats
    for L in depths:
        if P + C <= L // 2 and (applied := L + 2 * (R - 1) * C) != L:  # P + C > L / 2: refused by the shape check
            raise KeelError(f"the config's {listed} make a model of {L} sub-layers apply {applied} (2 (P + R C + Q) = "
                            f"2 ({P} + {R} x {C} + {L // 2 - P - C})); to profile looped models at init, give --loop P,C,Q "
                            "and the effective depths as --sublayers")


def _init_config(base, scheme: str, sublayers: int, d_model: int, seq_len: int, vocab: int,
                 loop: tuple[int, int, int] | None = None):
    """The model config for the init-mode profile: the base config's model section with the
    residual scheme, n_layers = sublayers / 2, width d_model, head_dim :data:`HEAD_DIM` (32;
    a width below it is one head of that width), n_kv_heads = n_heads / 2 (GQA) when n_heads
    is even, d_ff = 3 * d_model. With ``loop`` = (P, C, Q): P + C + Q blocks, the core of C looped
    R times (:func:`loop_repeats_for`), so that ``sublayers`` is the effective depth.

    Raises:
        KeelError: a width above 32 that is not a multiple of it (it used to get wider heads
            silently: 80 was two heads of 40), or an odd head width (RoPE).
    """
    if d_model > HEAD_DIM and d_model % HEAD_DIM:
        lower = d_model // HEAD_DIM * HEAD_DIM
        raise KeelError(f"--d-model {d_model} is not a multiple of the head dimension {HEAD_DIM} (e.g. {lower} or "
                        f"{lower + HEAD_DIM}; a width below {HEAD_DIM} is one head of that width)")
    m = copy.deepcopy(base.model)
    m.residual = scheme
    m.n_layers = sublayers // 2
    if loop is not None:
        m.loop_repeats = loop_repeats_for(sublayers, loop)
        m.n_layers, m.loop_prelude, m.loop_core = sum(loop), loop[0], loop[1]
    m.d_model = d_model
    m.n_heads = max(1, d_model // HEAD_DIM)
    m.n_kv_heads = m.n_heads // 2 if m.n_heads % 2 == 0 else m.n_heads
    m.d_ff = 3 * d_model
    m.max_seq_len = max(m.max_seq_len, seq_len)
    m.vocab_size = resolve_vocab_size(m.vocab_size, vocab, m.vocab_multiple) if m.vocab_size == "auto" \
        else max(m.vocab_size, vocab)
    if m.head_dim % 2:
        raise KeelError(f"--d-model {d_model}: head dimension {m.head_dim} must be even for RoPE")
    return m.validate()


def _val_batch(data_dir, seq_len: int, batch_size: int):
    windows = validation_tokens(data_dir, seq_len, batch_size * seq_len)
    return windows[:batch_size]


def _sci(v) -> str:
    return "n/a" if v is None else f"{v:.3e}"


_NAME_WIDTH = max(len("residual"), *map(len, SCHEMES))  # the widest scheme name, e.g. hyper_connections


def _summary_line(r: dict) -> str:
    p = r["param_grad_norm"]
    ratio_p = p[0] / p[-1] if p[-1] > 0 else None
    return (f"{r['residual']:<{_NAME_WIDTH}} {r['blocks']:>6} {r['sublayers']:>10} {r['d_model']:>7} {r['loss']:>7.3f} "
            f"{_sci(r['stream_ratio_first_last']):>12} {_sci(r['stream_ratio_block1_last']):>12} {_sci(ratio_p):>12} "
            f"{r['log10_jacobian_product']:>9.2f} {r['log10_jacobian_product_from_block1']:>9.2f} {r['seconds']:>7.1f}")


SUMMARY_HEADER = (f"{'residual':<{_NAME_WIDTH}} {'blocks':>6} {'sub-layers':>10} {'d_model':>7} {'loss':>7} "
                  f"{'stream 0/L-1':>12} {'stream 2/L-1':>12} {'param 0/L-1':>12} "
                  f"{'log10 J*':>9} {'.. blk1+':>9} {'seconds':>7}")


def plot_profiles(results: list[dict], out: str | Path) -> None:
    """PNG of the profiles: one column per depth (sub-layers), top row the parameter
    gradient norm (attention sub-layers solid, FFN sub-layers dotted) and bottom row the
    residual-stream gradient norm against the sub-layer index, one colour per scheme (or
    run), log scale. Written atomically (temp file + rename).

    Raises:
        KeelError: the folder of ``out`` does not exist."""
    matplotlib.use("Agg")

    out = Path(out)
    if not out.parent.is_dir():
        raise KeelError(f"--plot: folder {out.parent} does not exist")
    depths = sorted({r["sublayers"] for r in results})
    fig, axes = plt.subplots(2, len(depths), figsize=(4.2 * len(depths), 7), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for col, L in enumerate(depths):
        lw = 1.1 if L <= 64 else 0.7
        for k, r in enumerate(r for r in results if r["sublayers"] == L):
            label, c = r.get("label") or r["residual"], colors[k % len(colors)]
            p = [max(v, 1e-300) for v in r["param_grad_norm"]]
            # attention (even) and FFN (odd) sub-layers differ a lot: two lines, one colour
            axes[0][col].plot(range(0, L, 2), p[0::2], lw=lw, color=c, label=label)
            axes[0][col].plot(range(1, L, 2), p[1::2], lw=lw, color=c, ls=":")
            axes[1][col].plot(range(L), [max(v, 1e-300) for v in r["stream_grad_norm"]], lw=lw, color=c,
                              label=label)
        axes[0][col].set_title(f"{plural(L // 2, 'block')} = {L} sub-layers")
        for row, name in enumerate(("parameter grad norm\n(solid: attention, dotted: FFN)",
                                    "residual-stream grad norm")):
            ax = axes[row][col]
            ax.set_yscale("log")
            ax.grid(alpha=0.3, which="both")
            ax.set_xlabel("sub-layer index")
            if col == 0:
                ax.set_ylabel(name)
    axes[0][0].legend(fontsize=8)
    save_figure(fig, out)


def profile_runs(run_paths: Sequence[str | Path], seq_len: int | None, batch_size: int, jacobian_iters: int = 32,
                 full_jacobian: bool = False, seed: int = 0, loops: int | None = None) -> list[dict]:
    """:func:`profile_model` of the latest checkpoint of each run, on ``batch_size`` windows
    of ``seq_len`` tokens of the run's validation split (None: ``min(DEFAULT_SEQ_LEN, max_seq_len)``);
    a looped run at ``loops`` core applications (None: its ``model.loop_repeats``; KeelError for a run
    that does not loop).

    Each result adds ``residual``, ``sublayers`` (applied: 2 ``applied_blocks``), ``blocks`` (of weights),
    ``applied_blocks`` (one pass applies: P + R C + Q of a looped run), ``d_model``, ``run``, ``label``
    and ``seconds`` (wall time). Each result is logged as it is ready: one line of a table
    (:data:`SUMMARY_HEADER`, logged with the first) at INFO level, logger ``keel.diagnostics.gradflow``.
    Raises KeelError for a path that is not a run with a checkpoint, or a ``seq_len`` below 1 or above
    the run's ``model.max_seq_len`` (RoPE's cache: the model cannot read a longer window).
    """
    if seq_len is not None and seq_len < 1:  # 0 was read as "the default" (`seq_len or ...`)
        raise KeelError(f"--seq-len must be >= 1 token, got {seq_len}")
    results = []
    for path in run_paths:
        t0 = time.perf_counter()
        run = Run(path)
        cfg = run.config
        if seq_len is not None and seq_len > cfg.model.max_seq_len:
            raise KeelError(f"--seq-len {seq_len} is above model.max_seq_len = {cfg.model.max_seq_len} of {run.path}")
        model = run.load_model(device="cpu")
        if loops is not None:
            model.set_loops(loops)
        batch = _val_batch(run.data_dir(), seq_len or min(DEFAULT_SEQ_LEN, cfg.model.max_seq_len), batch_size)
        model.train()
        applied = len(model.depth_order())  # blocks one pass applies (a looped run: P + R C + Q)
        r = {"residual": cfg.model.residual, "sublayers": 2 * applied, "blocks": cfg.model.n_layers,
             "applied_blocks": applied,
             "d_model": cfg.model.d_model, "run": str(run.path), "label": f"{cfg.model.residual} d{cfg.model.d_model}"}
        r.update(profile_model(model, batch, jacobian_iters, full_jacobian, seed))
        results.append(_finished(r, t0, first=not results))
    return results


def check_profile_fits(model_cfg: ModelConfig, batch_size: int, seq_len: int) -> None:
    """Refuse, before any model is built, a profile at init that cannot fit in this process's memory
    (:func:`keel.train.device.host_memory_bytes`): the model ``model_cfg`` (unlooped: a looped model is
    profiled through its unrolled copies) needs its fp32 weights and gradients (8 bytes per parameter,
    :func:`keel.model.count_parameters`) and the activations its forward pass keeps for the backward,
    :func:`keel.train.device.activation_floor_bytes` at ``batch_size`` x ``seq_len`` tokens. A floor:
    the Jacobian products come on top. ``keel gradflow --sublayers 100000`` ran 7 minutes and was
    killed by the kernel.

    Raises:
        KeelError: one line with the depth, the width and the numbers.
    """
    n = count_parameters(model_cfg)
    train_cfg = TrainConfig(batch_size=batch_size, seq_len=seq_len)
    need = 8 * n + activation_floor_bytes(model_cfg, train_cfg, loops=1)
    have = host_memory_bytes()
    if need > have:
        raise KeelError(f"{model_cfg.n_sublayers:,} sub-layers at width {model_cfg.d_model}: {n:,} parameters' "
                        f"weights and gradients and the activations of {batch_size} x {seq_len} tokens need at least "
                        f"{need / 2**30:,.1f} GiB, more than the {have / 2**30:,.1f} GiB this process may use; "
                        "profile fewer sub-layers, or lower --batch-size, --seq-len or --d-model")


def profile_schemes(base, schemes: Sequence[str], depths: Sequence[int], d_model: int, seq_len: int,
                    batch_size: int, jacobian_iters: int = 32, full_jacobian: bool = False, seed: int = 0,
                    loop: tuple[int, int, int] | None = None) -> list[dict]:
    """:func:`profile_model` of freshly initialised models: every scheme at every depth
    (sub-layers), width ``d_model`` (:func:`_init_config`), on ``batch_size`` validation
    windows of ``seq_len`` tokens of the dataset ``base`` (a :class:`keel.config.Config`)
    names. The init is seeded with ``seed`` for every model. Results as in
    :func:`profile_runs`, plus ``init_std``. With ``loop`` = (P, C, Q), looped models of those blocks
    whose effective depth is each of ``depths`` (:func:`loop_repeats_for`; KeelError if one is not)."""
    _check_config_loop(base.model, depths, loop)
    for L in depths:  # a mistyped depth is refused before any data is prepared (vocabulary: its floor, 1)
        for scheme in schemes:
            check_model_config(_init_config(base, scheme, L, d_model, seq_len, 1, loop))  # e.g. a loop that misses L
            # the unlooped model of L sub-layers: the size of a looped one's unrolled copies (profile_model)
            check_profile_fits(_init_config(base, scheme, L, d_model, seq_len, 1), batch_size, seq_len)
    data_dir = resolve_data(base, progress=interactive())  # as keel train: data.path, or cached under data.cache_dir
    vocab = read_meta(data_dir)["vocab_size"]
    batch = _val_batch(data_dir, seq_len, batch_size)
    results = []
    for L in depths:
        for scheme in schemes:
            t0 = time.perf_counter()
            mcfg = _init_config(base, scheme, L, d_model, seq_len, vocab, loop)
            torch.manual_seed(seed)
            r = {"residual": scheme, "sublayers": L, "blocks": mcfg.n_layers, "applied_blocks": L // 2, "d_model": d_model,
                 "init_std": mcfg.init_std, "label": scheme if loop is None else f"{scheme} looped"}
            if L >= LONG_SUBLAYERS:  # a silent wait of minutes looked like a hang (issue 32)
                _log.info("profiling %s at %s sub-layers: building the model, then one forward and backward pass "
                          "and %s Jacobian products through every sub-layer (time grows with the depth; Ctrl-C "
                          "stops)", scheme, f"{L:,}", "the full" if full_jacobian else jacobian_iters)
            with _beating(L >= LONG_SUBLAYERS, f"gradflow: building the {scheme} model of {L:,} sub-layers"):
                model = Transformer(mcfg)  # minutes at 100,000 sub-layers: a line every HEARTBEAT_S meanwhile
            r.update(profile_model(model, batch, jacobian_iters, full_jacobian, seed))
            results.append(_finished(r, t0, first=not results))
    return results


def _finished(r: dict, t0: float, first: bool) -> dict:
    r["seconds"] = time.perf_counter() - t0
    if first:  # the table's header, once the first profile is ready (not before a failed start)
        _log.info(SUMMARY_HEADER)
    _log.info(_summary_line(r))
    return r
