"""The science commands: ``keel study``, ``keel gradflow``, ``keel stress``, ``keel lr-sensitivity``,
``keel sweep``, ``keel plot`` and ``keel ablate``. The work is done by :mod:`keel.diagnostics.gradflow` and the modules of
:mod:`keel.experiments`; the handlers here parse flags and print.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

from keel.config import key_default, key_help
from keel.diagnostics import gradflow as G
from keel.errors import KeelError
from keel.experiments import ablate as A
from keel.experiments import plot as P
from keel.experiments import sensitivity as LS
from keel.experiments import stress as ST
from keel.experiments import study as SD
from keel.experiments import sweep as S


def register(subparsers) -> None:
    """Add the science commands to the ``keel`` sub-parsers."""
    _register_gradflow(subparsers)
    _register_stress(subparsers)
    _register_lr_sensitivity(subparsers)
    _register_sweep(subparsers)
    _register_plot(subparsers)
    _register_ablate(subparsers)
    _register_study(subparsers)


def cmd_gradflow(args: argparse.Namespace) -> int:
    import torch

    from keel.config import load_config, resolve_config_path
    from keel.model import SCHEMES

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
    if args.run and (args.residual is not None or args.sublayers is not None):
        raise KeelError("--run takes the model from the run; drop --residual and --sublayers")
    common = dict(batch_size=args.batch_size, jacobian_iters=args.jacobian_iters, full_jacobian=args.full_jacobian,
                  seed=args.seed)  # the library logs the summary table (stderr) as each profile finishes
    if args.run:
        results = G.profile_runs(args.run, args.seq_len, **common)
    else:
        schemes = _parse_schemes(args.residual if args.residual is not None else ",".join(SCHEMES))
        depths = _parse_layers(args.sublayers if args.sublayers is not None else G.DEFAULT_LAYERS)
        base = load_config(resolve_config_path(args.config), args.set)
        results = G.profile_schemes(base, schemes, depths, args.d_model, args.seq_len, **common)
    if args.json:
        print(json.dumps({"results": results}))
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)  # as other commands create their folders
        G.plot_profiles(results, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _add_grid_flags(p, report_only: bool = True,
                    config_help: str | None = "base TOML file or preset name (default: demo)") -> None:
    """The flags every grid command shares (``keel sweep``, ``stress``, ``lr-sensitivity``, ``study``):
    base config (not with ``config_help=None``), overrides, worker processes and threads, resume,
    and ``--report-only``."""
    if config_help is not None:
        p.add_argument("--config", default=None, help=config_help)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key in every run (repeatable)")
    p.add_argument("--workers", type=int, default=1, help="worker processes (0 = in this process)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per worker (0 = cores / workers)")
    p.add_argument("--resume", action="store_true", help="continue --out: skip finished runs, resume interrupted ones")
    if report_only:
        p.add_argument("--report-only", action="store_true", help="train nothing: tabulate the finished runs of --out")


_log = logging.getLogger(__name__)


class _DeprecatedLayers(argparse.Action):
    """``--layers``: the old name of ``--sublayers`` (it always counted sub-layers, while the
    config's ``model.n_layers`` counts blocks). Kept for one release; it stores into
    ``sublayers`` and logs one deprecation warning."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        _log.warning("warning: --layers is deprecated and will be removed in the next release; "
                     "use --sublayers (the same value: depths in sub-layers, 2 per block)")
        setattr(namespace, self.dest, values)


def _add_sublayers_flag(p, default: str | None, help: str) -> None:
    """``--sublayers`` (comma-separated depths in sub-layers) and its deprecated alias ``--layers``."""
    p.add_argument("--sublayers", default=default, metavar="L1,L2,...", help=help)
    p.add_argument("--layers", dest="sublayers", action=_DeprecatedLayers, metavar="L1,L2,...",
                   help="deprecated alias of --sublayers (removed in the next release)")


def _register_gradflow(subparsers) -> None:
    """Add ``keel gradflow`` (see :mod:`keel.diagnostics.gradflow`)."""
    p = subparsers.add_parser(
        "gradflow", help="per-sub-layer gradient norms and the residual-path Jacobian product J*",
        description="Gradient-flow profile on one batch of validation tokens, at initialisation "
                    "(--residual, --sublayers) or from trained runs (--run).")
    p.add_argument("--residual", default=None,
                   help="comma-separated schemes (default: every scheme in keel.model.SCHEMES)")
    _add_sublayers_flag(p, None, "comma-separated depths in sub-layers, each even; blocks = L/2 (default: 16,64)")
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
        raise KeelError("--sublayers needs at least one depth (sub-layers, e.g. 16,64)")
    out = []
    for s in items:
        try:
            n = int(s)
        except ValueError:
            raise KeelError(f"--sublayers: {s!r} is not an integer number of sub-layers") from None
        if n < 2 or n % 2:
            raise KeelError(f"--sublayers: {n} is not an even number >= 2 of sub-layers "
                            f"(each block is an attention and an FFN sub-layer)")
        out.append(n)
    return out


def cmd_sweep(args: argparse.Namespace) -> int:
    preset = S.load_preset(args.preset) if args.preset else {}
    grid = {k: list(v) for k, v in preset.get("grid", {}).items()}
    grid.update(S.parse_grid(args.grid))
    if not grid:
        raise KeelError("nothing to sweep: give --grid section.key=v1,v2 (or a --preset with a [grid])")
    sets = list(preset.get("set", {}).items()) + list(args.set)  # typed (key, value) pairs, then --set strings
    config = args.config or preset.get("base")
    best = args.best_over or preset.get("best_over")
    match = args.match_params if args.match_params is not None else preset.get("match_params")
    if args.resume and not args.out:
        raise KeelError("--resume needs --out (the sweep folder to continue)")
    out = Path(args.out) if args.out else Path("runs") / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    s = S.run_sweep(config, grid, sets, out=out, workers=args.workers, threads=args.threads or None,
                  resume=args.resume, best=best, match_params=match)
    print(S.sweep_markdown(s))
    print(f"sweep: {out}/sweep.md, {out}/sweep.json")
    return 1 if any(r.get("status") != "done" for r in s["runs"]) else 0


def _register_sweep(subparsers) -> None:
    """Add ``keel sweep`` (see :mod:`keel.experiments.sweep`)."""
    p = subparsers.add_parser("sweep", help="run a grid of training runs (equal-compute tables, best LR)",
                              description=S.__doc__.split("\n\n")[0])
    _add_grid_flags(p, report_only=False,
                    config_help="base TOML file or preset name (default: demo, or the preset's base)")
    p.add_argument("--preset", default=None, help="sweep preset: a name in keel/configs/sweeps/ or a TOML file")
    p.add_argument("--grid", action="append", default=[], metavar="SECTION.KEY=V1,V2,...",
                   help="a grid axis (repeatable; the sweep is the cartesian product)")
    p.add_argument("--out", default=None, help="sweep folder (default: runs/sweep-<time>)")
    p.add_argument("--best-over", default=None, metavar="KEY",
                   help="report, per combination of the other grid keys, the value of KEY (e.g. train.lr) "
                        "with the lowest final validation loss among runs that did not diverge")
    p.add_argument("--match-params", default=None, metavar="N|auto",
                   help="hold non-embedding parameters at N (auto: the base config's) by choosing d_model per point")
    p.set_defaults(func=cmd_sweep)


def cmd_plot(args: argparse.Namespace) -> int:
    out = Path(args.out)
    if not out.parent.is_dir():
        raise KeelError(f"folder of --out does not exist: {out.parent}")
    if args.kind == "loss":
        n = P.plot_loss_curves(args.paths, out, val=args.val, x=args.x, smooth=args.smooth, title=args.title)
        print(f"{out}: {n} curves")
    else:
        if len(args.paths) != 1:
            raise KeelError(f"keel plot {args.kind} takes one sweep folder, got {len(args.paths)}")
        if args.kind == "depth":
            n = len(P.plot_depth(args.paths[0], out, title=args.title))
        else:
            n = P.plot_lr(args.paths[0], out, title=args.title)
        print(f"{out}: {n} lines")
    return 0


def _register_plot(subparsers) -> None:
    """Add ``keel plot`` (see :mod:`keel.experiments.plot`)."""
    p = subparsers.add_parser("plot", help="plot loss curves, loss vs depth, loss vs LR (PNG)",
                              description=P.__doc__.split("\n\n")[0])
    p.add_argument("kind", choices=("loss", "depth", "lr"))
    p.add_argument("paths", nargs="+", help="run folders / sweep folders (depth, lr: one sweep folder)")
    p.add_argument("--out", required=True, help="PNG file to write")
    p.add_argument("--val", action="store_true", help="loss: validation loss instead of training loss")
    p.add_argument("--x", default="tokens", choices=("tokens", "steps"), help="loss: x axis")
    p.add_argument("--smooth", type=int, default=0, help="loss: trailing mean of the training loss over K steps")
    p.add_argument("--title", default="")
    p.set_defaults(func=cmd_plot)


def cmd_ablate(args: argparse.Namespace) -> int:
    if args.tokens is not None and args.tokens < 1:
        raise KeelError(f"--tokens must be >= 1, got {args.tokens}")
    tokens = args.tokens or 16384
    if args.verbose:  # the library logs each unit's PPL at DEBUG level
        logging.getLogger(A.__name__).setLevel(logging.DEBUG)
    if args.hf:
        text = A.hf_text(args.text, args.run, tokens)
        res = A.ablate_hf_folder(args.hf, text, args.seq_len, tokens, args.batch_size)
        title, default_out = str(args.hf), Path(args.hf) / "ablate"
    elif args.run:
        res = A.ablate_run(args.run, args.seq_len, tokens, args.batch_size, args.device)
        title, default_out = str(args.run), Path(args.run) / "ablate"
    else:
        raise KeelError("give --run DIR (a keel run) or --hf MODEL_PATH")
    res["source"] = title
    out = Path(args.out) if args.out else default_out
    A.write_outputs(res, out, title)
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(A.ablate_markdown(res, title))
        print(f"ablate: {out}/ablate.json, ablate.md, ablate.png")
    return 0


def _register_ablate(subparsers) -> None:
    """Add ``keel ablate`` (see :mod:`keel.experiments.ablate`)."""
    p = subparsers.add_parser("ablate", help="layer importance: ΔPPL when each sub-layer is removed",
                              description=A.__doc__.split("\n\n")[0])
    p.add_argument("--run", default=None, help="a keel run directory (model and validation split)")
    p.add_argument("--hf", default=None, metavar="MODEL_PATH",
                   help="a local Hugging Face causal LM folder instead (one decoder layer = one unit)")
    p.add_argument("--text", default=None, help="with --hf: a text file to measure on (else --run's validation split)")
    p.add_argument("--tokens", type=int, default=None, help="validation tokens to use (default 16384)")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the run's train.seq_len; HF 512)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default=key_default("train.device"), help=key_help("train.device"))
    p.add_argument("--out", default=None, help="output folder (default: RUN/ablate or MODEL_PATH/ablate)")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    p.add_argument("--verbose", action="store_true", help="log each unit's PPL on stderr")
    p.set_defaults(func=cmd_ablate)


def cmd_stress(args) -> int:
    """``keel stress``: see :mod:`keel.experiments.stress`."""
    from keel.model import SCHEMES

    if args.resume and args.report_only:
        raise KeelError("--report-only trains nothing; do not combine it with --resume")
    schemes = _parse_list(args.residual, str, "--residual") if args.residual is not None else list(SCHEMES)
    layers = _parse_list(args.sublayers, int, "--sublayers")
    seeds = _parse_list(args.seeds, int, "--seeds")
    res = ST.run_stress(args.config, args.set, schemes, layers, seeds, args.peak_lr, args.ramp_steps, args.out,
                     args.workers, args.threads, resume=args.resume, report_only=args.report_only,
                     reference_scheme=args.reference_scheme)
    if args.json:
        print(json.dumps(res["table"], indent=1))
    else:
        print(ST.table_markdown(res["table"], args.peak_lr))
        print(f"wrote {Path(args.out) / 'stress.json'}, stress.md, stress.png")
    return 0


def _register_stress(subparsers) -> None:
    """Add ``keel stress`` (see :mod:`keel.experiments.stress`)."""
    p = subparsers.add_parser("stress", help="max-LR stress test: linear LR ramp until divergence (paper Table 1)")
    p.add_argument("--residual", default=None, help="comma-separated schemes (default: every scheme in keel.model.SCHEMES)")
    _add_sublayers_flag(p, "64", "comma-separated depths in sub-layers (even; 2 per block)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated train.seed values")
    p.add_argument("--peak-lr", type=float, default=5e-2, help="LR at the end of the ramp (paper: 5e-2)")
    p.add_argument("--ramp-steps", type=int, default=1000, help="steps of the linear ramp 0 -> peak (paper: 5000)")
    p.add_argument("--reference-scheme", default="pre_ln",
                   help="scheme of the reference run per depth and seed (same ramp; judges degradation)")
    _add_grid_flags(p)
    p.add_argument("--out", default="runs/stress", help="output folder (default: runs/stress)")
    p.add_argument("--json", action="store_true", help="print the table as JSON on stdout")
    p.set_defaults(func=cmd_stress)


def _parse_list(text: str, kind, what: str) -> list:
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise KeelError(f"{what} is empty")
    try:
        return [kind(s) for s in items]
    except ValueError:
        raise KeelError(f"{what} must be a comma-separated list of {kind.__name__}s, got {text!r}") from None


def cmd_lr_sensitivity(args: argparse.Namespace) -> int:
    """``keel lr-sensitivity``: see :mod:`keel.experiments.sensitivity`."""
    if args.resume and args.report_only:
        raise KeelError("--report-only trains nothing; do not combine it with --resume")
    s = LS.run_lr_sensitivity(args.config, _parse_list(args.residual, str, "--residual"),
                              _parse_list(args.sublayers, int, "--sublayers"), _parse_list(args.lrs, float, "--lrs"),
                              _parse_list(args.seeds, int, "--seeds"), args.set,
                              out=args.out, workers=args.workers, threads=args.threads or None, resume=args.resume,
                              report_only=args.report_only)
    if args.json:
        print(json.dumps({k: s[k] for k in ("lrs", "unigram_entropy", "cells")}, indent=1))
    else:
        print(LS.markdown(s))
        print(f"wrote {Path(args.out) / LS.OUT_JSON}, {LS.OUT_MD}, {LS.OUT_PNG}")
    return 1 if any(r.get("status") != "done" for r in s["runs"]) else 0


def _register_lr_sensitivity(subparsers) -> None:
    """Add ``keel lr-sensitivity`` to the CLI."""
    p = subparsers.add_parser("lr-sensitivity", help="final loss against peak LR per scheme and depth "
                              "(Wortsman et al. 2023 LR sensitivity)", description=LS.__doc__.split("\n\n")[0])
    p.add_argument("--residual", default="pre_ln,keel", help="comma-separated schemes")
    _add_sublayers_flag(p, "16,64", "comma-separated depths in sub-layers (even; 2 per block)")
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2,1e-1", help="comma-separated peak LRs (log-spaced)")
    p.add_argument("--seeds", default="0,1", help="comma-separated train.seed values")
    _add_grid_flags(p)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--json", action="store_true", help="print the per-cell numbers as JSON on stdout")
    p.set_defaults(func=cmd_lr_sensitivity)


def cmd_study(args: argparse.Namespace) -> int:
    """``keel study``: see :mod:`keel.experiments.study`."""
    if args.resume and args.report_only:
        raise KeelError("--report-only trains nothing; do not combine it with --resume")
    if args.dry_run and (args.resume or args.report_only):
        raise KeelError("--dry-run only prints the plan; do not combine it with --resume or --report-only")
    if not 0 < args.mfu <= 1 or args.peak_tflops <= 0:
        raise KeelError("--mfu must be in (0, 1] and --peak-tflops > 0")
    out = args.out or f"runs/study-{Path(args.name).stem}-{args.scale}"
    command = " ".join(["keel", "study"] + sys.argv[2:]) if len(sys.argv) > 2 else f"keel study {args.name}"
    r = SD.run_study(args.name, args.scale, out, args.set, workers=args.workers, threads=args.threads or None,
                     resume=args.resume, report_only=args.report_only, dry_run=args.dry_run, mfu=args.mfu,
                     peak_tflops=args.peak_tflops, command=command)
    if args.dry_run:
        print(json.dumps(r["plan"], indent=1, default=str) if args.json else r["markdown"])
        return 0
    if args.json:
        print(json.dumps({"claims": r["claims"]}, indent=1, default=str))
    else:
        for c in r["claims"]:
            print(f"({c['id']}) {c['verdict']:<15} {c['title']}")
        print(f"wrote {Path(out) / 'report.md'}, report.json, {', '.join(r['plots']) or 'no plots yet'}")
    return 1 if any(x["status"] == "error" for x in r["runs"]) else 0


def _register_study(subparsers) -> None:
    """Add ``keel study`` (see :mod:`keel.experiments.study`)."""
    from keel.config import preset_names

    p = subparsers.add_parser("study", help="the paper's claims as one resumable study with computed verdicts",
                              description=SD.__doc__.split("\n\n")[0])
    p.add_argument("name", help=f"a shipped study ({', '.join(preset_names('studies'))}) or a study TOML file")
    p.add_argument("--scale", required=True, help="the study's scale: tiny (tests), cpu, gpu-1 (one GPU-day), paper")
    p.add_argument("--out", default=None, help="output folder (default: runs/study-NAME-SCALE)")
    _add_grid_flags(p, config_help=None)
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (runs, tokens, estimated GPU-hours) and exit; prepares and trains nothing")
    p.add_argument("--mfu", type=float, default=0.35, help="model FLOPs utilisation assumed by --dry-run")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="GPU dense bf16 peak TFLOP/s assumed by --dry-run (H100 SXM: 989)")
    p.add_argument("--json", action="store_true", help="print the verdicts (or the plan) as JSON on stdout")
    p.set_defaults(func=cmd_study)
