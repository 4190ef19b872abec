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
  is block-diagonal over tokens; J*_i is computed per token by the Lanczos method on
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
  after sub-layer 0 (resp. 2) divided by that after sub-layer L-1.
* with ``--full-jacobian``: also the spectral norm of each sub-layer's *full* Jacobian
  (branch included; attention couples the tokens of a sequence, so per sequence), and its
  product in log space (``log10_full_jacobian_product``).

Usage::

    keel gradflow --residual pre_ln,post_ln,keel --layers 16,64,256,1024 [--d-model 64]
                  [--batch-size 4] [--seq-len 64] [--seed 0] [--json] [--plot FILE]
    keel gradflow --run runs/a --run runs/b [--json] [--plot FILE]

Heavy modules (torch, matplotlib) are imported inside the functions, so that registering
the command keeps ``keel --help`` fast.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from keel.errors import KeelError

DEFAULT_LAYERS = "16,64"


# ---- the model's sub-layers ------------------------------------------------------------

def _plain(model):
    """The plain :class:`keel.model.Transformer` inside DDP or ``torch.compile`` wrappers."""
    from keel.model import Transformer
    from keel.train.parallelize import unwrap

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
    import torch

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
    import torch
    from torch.func import jvp, vjp

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
            self.inputs[i] = x.detach()
            self.branch_fn[i] = f

            def recorded(h):
                out = f(h)
                self.branch_out[i] = out.detach()
                return out
            return (x, recorded)
        return hook

    def _post_hook(self, i):
        def hook(module, args, output):
            if output.requires_grad:
                def grad_hook(g):
                    self.stream_grad[i] = float(g.detach().double().norm())
                output.register_hook(grad_hook)
        return hook


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
        ``log10_full_jacobian_product``.
    """
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    plain = _unwrap(model)
    plain.zero_grad(set_to_none=True)
    with _Recorder(plain) as rec:
        loss = plain(batch[:, :-1], batch[:, 1:])
    loss.backward()
    out: dict[str, Any] = {"loss": float(loss.detach())}
    out["param_grad_norm"] = sublayer_grad_norms(plain)
    out["stream_grad_norm"] = [g if g is not None else 0.0 for g in rec.stream_grad]

    log_js, log_full = [], []
    for i, (_, unit) in enumerate(rec.pairs):
        x = rec.inputs[i].double()
        f_fixed = rec.branch_out[i].double()

        def shortcut(z, unit=unit, f_fixed=f_fixed):
            return unit(z, lambda _h: f_fixed)

        sigma = jacobian_spectral_norms(shortcut, x, group_dims=1, iters=jacobian_iters, seed=seed + i)
        log_js.append(float(sigma.clamp_min(torch.finfo(sigma.dtype).tiny).log().mean()))
        if full_jacobian:
            xf = rec.inputs[i].float()
            f_orig = rec.branch_fn[i]

            def full(z, unit=unit, f_orig=f_orig):
                return unit(z, f_orig)

            # the math SDPA kernel is composite, so forward-mode AD (jvp) runs through it
            with sdpa_kernel(SDPBackend.MATH):
                s_full = jacobian_spectral_norms(full, xf, group_dims=2, iters=jacobian_iters, seed=seed + i)
            log_full.append(float(s_full.double().clamp_min(1e-300).log().mean()))
    out["jacobian_star"] = [math.exp(v) for v in log_js]
    out["log10_jacobian_product"] = _log10_product(log_js)
    out["jacobian_product"] = _clamped_pow10(out["log10_jacobian_product"])
    # Block 0 sees the raw embedding (RMS ~ init_std), so its norms have J* ~ 1/init_std
    # whatever the depth; the product over blocks 1 .. n-1 is the depth-dependent part.
    out["log10_jacobian_product_from_block1"] = _log10_product(log_js[2:])
    s = out["stream_grad_norm"]
    out["stream_ratio_first_last"] = s[0] / s[-1] if s[-1] > 0 else None  # None: no gradient at the top
    out["stream_ratio_block1_last"] = s[min(2, len(s) - 1)] / s[-1] if s[-1] > 0 else None
    if full_jacobian:
        out["full_jacobian"] = [math.exp(v) for v in log_full]
        out["log10_full_jacobian_product"] = _log10_product(log_full)
    return out


# ---- the command ------------------------------------------------------------------------

def _parse_schemes(text: str) -> list[str]:
    from keel.model import SCHEMES

    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise KeelError("--residual needs at least one scheme")
    for n in names:
        if n not in SCHEMES:
            raise KeelError(f"unknown residual scheme {n!r} in --residual (choose from {', '.join(SCHEMES)})")
    return names


def _parse_layers(text: str) -> list[int]:
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise KeelError("--layers needs at least one depth (sub-layers, e.g. 16,64)")
    out = []
    for s in items:
        try:
            n = int(s)
        except ValueError:
            raise KeelError(f"--layers: {s!r} is not an integer number of sub-layers") from None
        if n < 2 or n % 2:
            raise KeelError(f"--layers: {n} is not an even number >= 2 of sub-layers "
                            f"(each block is an attention and an FFN sub-layer)")
        out.append(n)
    return out


def _init_config(base, scheme: str, sublayers: int, d_model: int, seq_len: int, vocab: int):
    """The model config for the init-mode profile: the base config's model section with the
    residual scheme, n_layers = sublayers / 2, width d_model, head_dim 32 (one head below
    width 32), n_kv_heads = n_heads / 2 (GQA) when n_heads is even, d_ff = 3 * d_model."""
    import copy

    m = copy.deepcopy(base.model)
    m.residual = scheme
    m.n_layers = sublayers // 2
    m.d_model = d_model
    m.n_heads = max(1, d_model // 32)
    while d_model % m.n_heads:
        m.n_heads -= 1
    m.n_kv_heads = m.n_heads // 2 if m.n_heads % 2 == 0 else m.n_heads
    m.d_ff = 3 * d_model
    m.max_seq_len = max(m.max_seq_len, seq_len)
    m.vocab_size = max(m.vocab_size, vocab)
    if m.head_dim % 2:
        raise KeelError(f"--d-model {d_model}: head dimension {m.head_dim} must be even for RoPE")
    return m.validate()


def _val_batch(data_dir, seq_len: int, batch_size: int):
    from keel.data import validation_tokens

    windows = validation_tokens(data_dir, seq_len, batch_size * seq_len)
    return windows[:batch_size]


def _sci(v) -> str:
    return "n/a" if v is None else f"{v:.3e}"


def _summary_line(r: dict) -> str:
    p = r["param_grad_norm"]
    ratio_p = p[0] / p[-1] if p[-1] > 0 else None
    return (f"{r['residual']:<11} {r['blocks']:>6} {r['sublayers']:>10} {r['d_model']:>7} {r['loss']:>7.3f} "
            f"{_sci(r['stream_ratio_first_last']):>12} {_sci(r['stream_ratio_block1_last']):>12} {_sci(ratio_p):>12} "
            f"{r['log10_jacobian_product']:>9.2f} {r['log10_jacobian_product_from_block1']:>9.2f} {r['seconds']:>7.1f}")


SUMMARY_HEADER = (f"{'residual':<11} {'blocks':>6} {'sub-layers':>10} {'d_model':>7} {'loss':>7} "
                  f"{'stream 0/L-1':>12} {'stream 2/L-1':>12} {'param 0/L-1':>12} "
                  f"{'log10 J*':>9} {'.. blk1+':>9} {'seconds':>7}")


def plot_profiles(results: list[dict], out: str | Path) -> None:
    """PNG of the profiles: one column per depth (sub-layers), top row the parameter
    gradient norm (attention sub-layers solid, FFN sub-layers dotted) and bottom row the
    residual-stream gradient norm against the sub-layer index, one colour per scheme (or
    run), log scale. Written atomically (temp file + rename).

    Raises:
        KeelError: the folder of ``out`` does not exist."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from keel.train.plots import save_figure

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
        axes[0][col].set_title(f"{L // 2} blocks = {L} sub-layers")
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


def cmd_gradflow(args: argparse.Namespace) -> int:
    import torch

    from keel.config import load_config, resolve_config_path
    from keel.model import SCHEMES
    from keel.data import read_meta
    from keel.data import resolve_data

    if args.batch_size < 1 or args.seq_len < 2:
        raise KeelError("--batch-size must be >= 1 and --seq-len >= 2")
    if args.d_model < 2:
        raise KeelError("--d-model must be >= 2")
    if args.threads < 0:
        raise KeelError("--threads must be >= 0 (0 = torch's default)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.jacobian_iters < 1:
        raise KeelError("--jacobian-iters must be >= 1")
    if args.plot and not Path(args.plot).parent.is_dir():
        raise KeelError(f"--plot: folder {Path(args.plot).parent} does not exist")
    results = []
    log = (lambda *a: print(*a, file=sys.stderr)) if args.json else print

    def finish(r: dict, t0: float) -> None:
        r["seconds"] = time.perf_counter() - t0
        results.append(r)
        if not args.json:
            print(_summary_line(r), flush=True)

    if args.run and (args.residual is not None or args.layers is not None):
        raise KeelError("--run takes the model from the run; drop --residual and --layers")
    if not args.run:
        schemes = _parse_schemes(args.residual if args.residual is not None else ",".join(SCHEMES))
        depths = _parse_layers(args.layers if args.layers is not None else DEFAULT_LAYERS)
    if not args.json:
        print(SUMMARY_HEADER)
    if args.run:
        from keel.run import Run

        for run_path in args.run:
            run = Run(run_path)
            run_dir = run.path
            t0 = time.perf_counter()
            model = run.load_model(device="cpu")
            cfg = run.config
            data_dir = run.data_dir()
            seq_len = min(args.seq_len, cfg.model.max_seq_len)
            batch = _val_batch(data_dir, seq_len, args.batch_size)
            model.train()
            r = {"residual": cfg.model.residual, "sublayers": cfg.model.n_sublayers, "blocks": cfg.model.n_layers,
                 "d_model": cfg.model.d_model, "run": str(run_dir),
                 "label": f"{cfg.model.residual} d{cfg.model.d_model}"}
            r.update(profile_model(model, batch, args.jacobian_iters, args.full_jacobian, args.seed))
            finish(r, t0)
    else:
        base = load_config(resolve_config_path(args.config), args.set)
        data_dir = resolve_data(base, progress=False)
        vocab = read_meta(data_dir)["vocab_size"]
        batch = _val_batch(data_dir, args.seq_len, args.batch_size)
        from keel.model import Transformer

        for L in depths:
            for scheme in schemes:
                t0 = time.perf_counter()
                mcfg = _init_config(base, scheme, L, args.d_model, args.seq_len, vocab)
                torch.manual_seed(args.seed)
                model = Transformer(mcfg)
                r = {"residual": scheme, "sublayers": L, "blocks": L // 2, "d_model": args.d_model,
                     "init_std": mcfg.init_std, "label": scheme}
                r.update(profile_model(model, batch, args.jacobian_iters, args.full_jacobian, args.seed))
                del model
                finish(r, t0)
    if args.json:
        print(json.dumps({"results": results}))
    if args.plot:
        plot_profiles(results, args.plot)
        log(f"plot: {args.plot}")
    return 0


def register(subparsers) -> None:
    """Add ``keel gradflow`` to the CLI (see the module docstring)."""
    p = subparsers.add_parser(
        "gradflow", help="per-sub-layer gradient norms and the residual-path Jacobian product J*",
        description="Gradient-flow profile on one batch of validation tokens, at initialisation "
                    "(--residual, --layers) or from trained runs (--run).")
    p.add_argument("--residual", default=None,
                   help="comma-separated schemes (default: every scheme in keel.model.SCHEMES)")
    p.add_argument("--layers", default=None,
                   help=f"comma-separated depths in SUB-layers, each even; blocks = L/2 (default: {DEFAULT_LAYERS})")
    p.add_argument("--run", action="append", default=[], metavar="DIR",
                   help="profile the latest checkpoint of a trained run instead (repeatable)")
    p.add_argument("--json", action="store_true", help='print {"results": [...]} as JSON on stdout')
    p.add_argument("--plot", default=None, metavar="FILE", help="write a PNG of the profiles")
    p.add_argument("--d-model", type=int, default=64, help="width at init (head_dim 32, d_ff = 3 x width)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences in the batch")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation and of the Lanczos start vectors")
    p.add_argument("--config", default=None, help="config file or preset for data and init (default: demo)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key, e.g. model.init_std=0.125 or data.path=DIR (repeatable)")
    p.add_argument("--jacobian-iters", type=int, default=32,
                   help="Lanczos steps (Krylov dimension) per sub-layer for J*, at most")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch (0 = torch's default; 1 is fastest for small models on a busy machine)")
    p.add_argument("--full-jacobian", action="store_true",
                   help="also estimate each sub-layer's full Jacobian spectral norm (slower)")
    p.set_defaults(func=cmd_gradflow)
