"""The science commands: ``keel study``, ``keel gradflow``, ``keel stress``, ``keel lr-sensitivity``,
``keel sweep``, ``keel plot`` and ``keel ablate``, each command's flags beside its handler
(:mod:`keel.cli.commands`). The work is done by :mod:`keel.diagnostics.gradflow` and the modules of
:mod:`keel.experiments`; the handlers here check flags and print.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import re
import shlex
import sys
import time
from pathlib import Path

from keel.cli.commands import add_loops_flag, check_counts, check_folder_loops, check_loops, check_seed
from keel.cli.formatting import module_summary
from keel.config import ModelConfig, key_default, key_help, load_config, preset_names, resolve_config_path
from keel.errors import KeelError, plural
from keel.experiments.executor import EXECUTORS, Executor, check_slurm_here, parse_slurm
from keel.io import check_output_not_in_checkpoints, check_path_names, make_dirs


def import_library() -> None:
    """The library the handlers below call, imported into this module (:mod:`keel.cli.commands`)."""
    global torch, check_tokenizer_matches, find_data, validation_tokens, G, A, P, presets, LS, ST, run_study, S
    global SCHEMES, Run, check_plot_out, image_format, study_scale, started_scale
    # torch and the library (seconds of import), imported when one of these commands runs, not when the
    # parser is built: `keel --help` loads no torch
    import torch
    from keel.data import check_tokenizer_matches, find_data, validation_tokens
    from keel.diagnostics import gradflow as G
    from keel.diagnostics import ablate as A
    from keel.experiments import plot as P
    from keel.experiments import presets
    from keel.experiments.study.spec import study_scale
    from keel.experiments import sensitivity as LS
    from keel.experiments import stress as ST
    from keel.experiments.study.run import run_study, started_scale
    from keel.experiments import sweep as S
    from keel.model import SCHEMES
    from keel.run import Run
    from keel.train.plots import check_plot_out, image_format


def register(subparsers) -> None:
    """Add the science commands to the ``keel`` sub-parsers."""
    _register_gradflow(subparsers)
    _register_stress(subparsers)
    _register_lr_sensitivity(subparsers)
    _register_sweep(subparsers)
    _register_plot(subparsers)
    _register_ablate(subparsers)
    _register_study(subparsers)


def _add_grid_flags(p, report_only: bool = True,
                    config_help: str | None = "base TOML file or preset name (default: demo)",
                    set_help: str = "override a config key in every run (repeatable)") -> None:
    """The flags every grid command shares (``keel sweep``, ``stress``, ``lr-sensitivity``, ``study``: one
    engine, :func:`keel.experiments.study.run.execute`): base config (not with ``config_help=None``),
    overrides, worker processes and threads, resume, the executor, ``--report-only`` and ``--dry-run``."""
    if config_help is not None:
        p.add_argument("--config", default=None, help=config_help)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=set_help)
    p.add_argument("--workers", type=int, default=None,
                   help="runs at once: worker processes (0 = in this process), or submitit jobs (Slurm: the job "
                        "array's cap) (default 1; with --resume: the folder's)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads per run (0 = cores / workers; on Slurm: each job's CPUs, and given, the CPUs "
                        "each job asks for) (default 0; with --resume: the folder's)")
    p.add_argument("--resume", action="store_true",
                   help="continue --out: skip finished runs, resume interrupted ones, with the executor, workers "
                        "and threads it was started with unless given")
    p.add_argument("--executor", default=None, choices=EXECUTORS,
                   help="where runs go: local worker processes (default), submitit-local (submitit jobs on this "
                        "machine, at most --workers at a time) or slurm (one sbatch job array per grid, at most "
                        "--workers runs at a time, through submitit); docs/cluster.md")
    p.add_argument("--slurm", action="append", default=[], metavar="KEY=VALUE",
                   help="a Slurm parameter of every job (repeatable): partition, account, time (minutes), gpus "
                        "(per node), nodes, cpus, mem_gb, qos, constraint, name (default keel-STUDY-GROUP), setup "
                        "(a shell line run before keel, e.g. 'module load cuda'; repeatable), signal_delay_s "
                        "(default 90), max_num_timeout (requeues after a time limit, default 3), array_parallelism, "
                        "or any other sbatch option")
    p.add_argument("--gpus-per-run", type=int, default=None,
                   help="GPUs each run gets where there are GPUs; with a submitit executor also its processes "
                        "(one job task each, joined as torchrun's workers) (default 1)")
    p.add_argument("--share-gpus", action="store_true",
                   help="let more local workers than GPUs share them, instead of refusing")
    if report_only:
        p.add_argument("--report-only", action="store_true", help="train nothing: tabulate the finished runs of --out")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (runs, tokens, estimated GPU-hours) and exit; prepares and trains nothing")
    p.add_argument("--mfu", type=float, default=0.35, help="model FLOPs utilisation assumed by --dry-run")
    p.add_argument("--peak-tflops", type=float, default=989.0,
                   help="GPU dense bf16 peak TFLOP/s assumed by --dry-run (H100 SXM: 989)")


_log = logging.getLogger(__name__)


class _DeprecatedLayers(argparse.Action):
    """``--layers``: the old name of ``--sublayers`` (it always counted sub-layers, while the
    config's ``model.n_layers`` counts blocks). Kept for one release; it stores into
    ``sublayers`` (and its name in ``sublayers_flag``, for error messages) and logs one
    deprecation warning."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.sublayers_flag = option_string
        _log.warning("warning: --layers is deprecated and will be removed in the next release; "
                     "use --sublayers (the same value: depths in sub-layers, 2 per block)")
        setattr(namespace, self.dest, values)


def _add_sublayers_flag(p, default: str | None, help: str) -> None:
    """``--sublayers`` (comma-separated depths in sub-layers) and its deprecated alias ``--layers``."""
    both = p.add_mutually_exclusive_group()  # `--sublayers 4 --layers 8` is refused, not settled by order
    both.add_argument("--sublayers", default=default, metavar="L1,L2,...", help=help)
    both.add_argument("--layers", dest="sublayers", action=_DeprecatedLayers, metavar="L1,L2,...",
                      help="deprecated alias of --sublayers (removed in the next release)")
    p.set_defaults(sublayers_flag="--sublayers")  # the flag the user typed, named by errors


def _register_gradflow(subparsers) -> None:
    """Add ``keel gradflow`` (see :mod:`keel.diagnostics.gradflow`)."""
    p = subparsers.add_parser(
        "gradflow", help="per-sub-layer gradient norms and the residual-path Jacobian product J*",
        description="Gradient-flow profile on one batch of validation tokens, at initialisation "
                    "(--residual, --sublayers) or from trained runs (--run).")
    p.add_argument("--residual", default=None,
                   help="comma-separated schemes (default: every scheme in keel.model.SCHEMES; with --loop, "
                        "every one that takes that loop: not attn_res, nor keel with a prelude of 0)")
    _add_sublayers_flag(p, None, "comma-separated depths in sub-layers, each even; blocks = L/2 (default: 16,64)")
    p.add_argument("--run", action="append", default=[], metavar="DIR",
                   help="profile the latest checkpoint of a trained run instead (repeatable)")
    p.add_argument("--json", action="store_true", help='print {"results": [...]} as JSON on stdout')
    p.add_argument("--plot", default=None, metavar="FILE", help="write a PNG of the profiles")
    p.add_argument("--d-model", type=int, default=None,
                   help="width at init: a multiple of 32 (heads of head_dim 32), or below 32 for one head of that "
                        "(even) width; d_ff = 3 x width (default 64; not with --run)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences in the batch")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per sequence (default 64; with --run at most the run's model.max_seq_len)")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation and of the Lanczos start vectors")
    p.add_argument("--config", default=None,
                   help="config file or preset for data and init (default: demo). The data is found as keel train "
                        "finds it: data.path if set, else data.source with data.tokenizer (demo: the built-in corpus, "
                        "bpe:8192), prepared once and cached under data.cache_dir (default data/ in the working "
                        "folder), the same dataset keel train and keel prepare use")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config key, e.g. model.init_std=0.125 or data.path=DIR (repeatable; not the "
                        "shape each profile takes from --residual, --sublayers and --d-model)")
    p.add_argument("--jacobian-iters", type=int, default=32,
                   help="Lanczos steps (Krylov dimension) per sub-layer for J*, at most")
    p.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch (0 = torch's default; 1 is fastest for small models on a busy machine)")
    p.add_argument("--full-jacobian", action="store_true",
                   help="also estimate each sub-layer's full Jacobian spectral norm (slower)")
    p.add_argument("--loop", default=None, metavar="P,C,Q",
                   help="at init: looped models of P prelude, C core and Q coda blocks, the core applied R times so "
                        "that each --sublayers depth is the effective one, 2 (P + R C + Q); profiled per applied "
                        "sub-layer")
    add_loops_flag(p, "run (--run)")
    # `--loop -1,8,1` is a value, as argparse takes `-1`: without this it read '-1,8,1' as an unknown option and
    # printed its usage; now _parse_loop says what is wrong with it. (argparse's matcher for negative numbers,
    # widened to comma lists; no option of the command looks like one.)
    p._negative_number_matcher = re.compile(r"^-\d[\d,]*$|^-\d*\.\d+$")
    p.set_defaults(handler=cmd_gradflow)


def cmd_gradflow(args: argparse.Namespace) -> int:
    _check_gradflow_numbers(args)
    if args.plot:
        image_format(args.plot, "--plot")  # before the profiles are computed, not after
        check_plot_out(args.plot, "--plot")
    _check_gradflow_model_flags(args)
    results = _gradflow_profiles(args)
    if args.json:
        print(json.dumps({"results": results}))
    if args.plot:
        make_dirs(Path(args.plot).parent)  # as other commands create their folders
        G.plot_profiles(results, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _check_gradflow_numbers(args: argparse.Namespace) -> None:
    """Raise KeelError for ``keel gradflow``'s counts out of range (``--batch-size``, ``--seq-len``,
    ``--d-model``, ``--threads``, ``--jacobian-iters``, ``--seed``); set torch's threads (``--threads``)."""
    if args.batch_size < 1 or (args.seq_len is not None and args.seq_len < 2):
        raise KeelError("--batch-size must be >= 1 and --seq-len >= 2")
    if args.d_model is not None and args.d_model < 2:
        raise KeelError("--d-model must be >= 2")
    if args.threads < 0:
        raise KeelError("--threads must be >= 0 (0 = torch's default)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.jacobian_iters < 1:
        raise KeelError("--jacobian-iters must be >= 1")
    check_seed(args.seed)


def _check_gradflow_model_flags(args: argparse.Namespace) -> None:
    """Raise KeelError for ``keel gradflow --run`` with flags that build a model at init (the run gives the
    model and data), or ``--loops`` without ``--run``."""
    model_flags = {"--residual": args.residual is not None, args.sublayers_flag: args.sublayers is not None,
                   "--d-model": args.d_model is not None, "--config": args.config is not None, "--set": bool(args.set),
                   "--loop": args.loop is not None}
    if args.run and any(model_flags.values()):  # they were ignored: the profile was of the run's model
        given = ", ".join(k for k, v in model_flags.items() if v)
        raise KeelError(f"--run takes the model and data from the run; drop {given}")
    if args.loops is not None and not args.run:
        raise KeelError("--loops goes with --run (a looped run's count); at init, --loop P,C,Q and --sublayers set it")


def _gradflow_profiles(args: argparse.Namespace) -> list[dict]:
    """``keel gradflow``'s profiles: of each ``--run`` (its model and data; ``--loops`` checked against it), else
    of each scheme (``--residual``) and depth (``--sublayers``) at init."""
    common = dict(batch_size=args.batch_size, jacobian_iters=args.jacobian_iters, full_jacobian=args.full_jacobian,
                  seed=args.seed)  # the library logs the summary table (stderr) as each profile finishes
    if args.run:
        for run in args.run:
            check_loops(args.loops, Run(run).config.model, run)
        return G.profile_runs(args.run, args.seq_len, loops=args.loops, **common)
    loop = _parse_loop(args.loop)
    schemes = _parse_schemes(args.residual) if args.residual is not None else _looping_schemes(args.loop, loop)
    _check_shape_sets(args.set)
    if loop is not None:  # before the config is read: its check of a loop key would name model.loop_core
        _check_loop_sets(args.loop, loop, args.set, args.sublayers is None)
    depths = _parse_layers(args.sublayers if args.sublayers is not None else G.DEFAULT_LAYERS, args.sublayers_flag)
    base = load_config(resolve_config_path(args.config), args.set)
    return G.profile_schemes(base, schemes, depths, args.d_model or G.DEFAULT_WIDTH,
                             args.seq_len or G.DEFAULT_SEQ_LEN, loop=loop, **common)


# The model keys each init-mode profile sets itself (keel.diagnostics.gradflow._init_config), by the flag that sets them
_INIT_SHAPE_KEYS = {"model.residual": "--residual", "model.n_layers": "--sublayers", "model.d_model": "--d-model",
                    "model.n_heads": "--d-model", "model.n_kv_heads": "--d-model", "model.d_ff": "--d-model"}


def _check_shape_sets(sets: list[str] | None) -> None:
    """Raise KeelError (one line) for a ``keel gradflow`` ``--set`` at init of a key each profile sets from a flag
    (:data:`_INIT_SHAPE_KEYS`): ``--set model.d_model=48`` was dropped without a word (the profile was at
    ``--d-model``'s width, 32 by default)."""
    given = [x.split("=", 1)[0].strip() for x in sets or []]
    if keys := [k for k in given if k in _INIT_SHAPE_KEYS]:
        flags = sorted({_INIT_SHAPE_KEYS[k] for k in keys})
        raise KeelError(f"--set {', '.join(keys)}: at init each profile's shape comes from {' and '.join(flags)} "
                        f"(heads of {G.HEAD_DIM}, d_ff = 3 d_model); give {' and '.join(flags)} instead")


def _check_loop_sets(text: str, loop: tuple[int, int, int], sets: list[str], no_depths: bool) -> None:
    """``keel gradflow --loop P,C,Q`` (``text``, parsed ``loop``) sets every profile's loop and takes its effective
    depths from ``--sublayers``. Raises KeelError (one line) for a ``--set model.loop_*`` beside it (a
    ``loop_repeats`` or ``loop_sampling`` was refused as needing model.loop_core, which --loop does set), or
    no ``--sublayers`` (the default depths are no 2 (P + R C + Q) of most loops)."""
    given = [x.split("=", 1)[0].strip() for x in sets or []]
    if keys := [k for k in given if k.startswith("model.loop_")]:
        raise KeelError(f"--loop {text} sets every profile's loop (R from --sublayers; no count is sampled at "
                        f"init); drop --set {', '.join(keys)}")
    if no_depths:
        P, C, Q = loop
        raise KeelError(f"--loop {text} needs --sublayers, the effective depths 2 (P + R C + Q) to profile "
                        f"(e.g. {2 * (P + C + Q)},{2 * (P + 4 * C + Q)},{2 * (P + 16 * C + Q)})")


def _looping_schemes(text: str | None, loop: tuple[int, int, int] | None) -> list[str]:
    """The schemes ``keel gradflow`` profiles without ``--residual``: every scheme, or with ``--loop`` (``text``,
    parsed ``loop`` = (P, C, Q)) every one whose ``check_config`` takes that loop (attn_res refuses any loop, Keel a
    prelude of 0 under its first-sub-layer rule); each one left out is logged with its reason (INFO, one line)."""
    if loop is None:
        return list(SCHEMES)
    P, C, Q = loop
    kept = []
    for scheme in SCHEMES:
        try:
            SCHEMES[scheme].check_config(ModelConfig(residual=scheme, n_layers=P + C + Q, loop_prelude=P, loop_core=C))
        except KeelError as e:
            _log.info("gradflow --loop %s: not profiling %s (%s)", text, scheme, e)
            continue
        kept.append(scheme)
    return kept


def _parse_loop(text: str | None) -> tuple[int, int, int] | None:
    """``--loop P,C,Q``: blocks of prelude (>= 0), core (>= 1) and coda (>= 0); None when not given.
    Raises KeelError: anything else."""
    if text is None:
        return None
    try:
        P, C, Q = (int(x) for x in text.split(","))
    except ValueError:
        raise KeelError(f"--loop takes P,C,Q: the blocks of prelude, core and coda (e.g. 1,8,1), got {text!r}") from None
    if P < 0 or C < 1 or Q < 0:
        raise KeelError(f"--loop {text}: the prelude and coda need >= 0 blocks and the core >= 1")
    return P, C, Q


def _parse_schemes(text: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise KeelError("--residual needs at least one scheme")
    for n in names:
        if n not in SCHEMES:
            raise KeelError(f"unknown residual scheme {n!r} in --residual (choose from {', '.join(SCHEMES)})")
    return names


def _parse_layers(text: str, flag: str = "--sublayers") -> list[int]:
    """Comma-separated even depths in sub-layers; KeelError naming ``flag`` (the option typed) otherwise."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    if not items:
        raise KeelError(f"{flag} needs at least one depth (sub-layers, e.g. 16,64)")
    out = []
    for s in items:
        try:
            n = int(s)
        except ValueError:
            raise KeelError(f"{flag}: {s!r} is not an integer number of sub-layers") from None
        if n < 2 or n % 2:
            raise KeelError(f"{flag}: {n} is not an even number >= 2 of sub-layers "
                            f"(each block is an attention and an FFN sub-layer)")
        out.append(n)
    return out


def stored_flags(args: argparse.Namespace, out: str | Path, command: str, keys: tuple[str, ...] = (),
                 refuse: bool = True, fixed: tuple[str, ...] = ()) -> argparse.Namespace:
    """``args`` with the flags ``keys`` (argparse dests) and the ``--set`` flags of the ``keel COMMAND``
    that started the grid folder ``out`` (its ``study.json``; the ``--set`` given now follow, each once),
    so that ``keel sweep --out DIR --resume`` or ``keel study NAME --out DIR --resume`` alone continues
    as it began. A ``--set`` given now that contradicts a recorded one is refused by the engine
    (:func:`keel.experiments.study.run.check_started_runs`), naming the key. A flag left at its
    default (``keel stress``'s ``--seeds 0,1,2``, ``--peak-lr``, ...) counts as not given. With
    ``refuse`` False a flag of ``keys`` given now is kept (``keel stress`` / ``lr-sensitivity``: the
    engine reads their runs of that grid, e.g. a narrower ``--lrs``) and only those not given take the
    folder's; the flags of ``fixed`` (a ramp's ``--peak-lr``, ``--ramp-steps``: every run's own settings, of
    which no value reads a subset of the grid) are refused with another value even then, by their name (the
    engine's refusal named the config key they set, ``train.lr``). Unchanged when ``out`` holds no ``keel
    COMMAND`` command.

    Raises:
        KeelError: with ``refuse``, one of ``keys`` (else one of ``fixed``) given now with another value: another
            grid belongs in another folder.
    """
    try:
        recorded = json.loads((Path(out) / "study.json").read_text(encoding="utf-8"))["command"]
        argv = shlex.split(recorded)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return args
    if argv[:2] != ["keel", command]:
        return args
    from keel.cli import build_parser  # lazy: keel.cli imports this module

    try:
        old = build_parser().parse_args(argv[1:])
    except SystemExit:  # a command an older keel recorded, with flags this one no longer has
        return args
    default = build_parser().parse_args([command, "--out", str(out)]) if keys else None  # each flag when not given
    given = [k for k in keys if getattr(args, k) not in (None, []) and getattr(args, k) != getattr(default, k)]
    for k in given:
        if (refuse or k in fixed) and getattr(args, k) != getattr(old, k):
            doing = "--resume continues" if getattr(args, "resume", False) else "--report-only reports"
            raise KeelError(f"{doing} the {command} {out} holds ({recorded}); --{k.replace('_', '-')} "
                            f"differs from it: drop it, or give another --out for another {command}")
    taken = {k: getattr(old, k) for k in keys if refuse or k not in given}
    again = [s for s in args.set if s not in old.set]  # a resume with the full flags: each --set once
    return argparse.Namespace(**{**vars(args), **taken, "set": old.set + again})


def _register_sweep(subparsers) -> None:
    """Add ``keel sweep`` (see :mod:`keel.experiments.sweep`)."""
    p = subparsers.add_parser("sweep", help="run a grid of training runs (equal-compute tables, best LR)",
                              description=module_summary("keel.experiments.sweep"))
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
    p.set_defaults(handler=cmd_sweep)


def cmd_sweep(args: argparse.Namespace) -> int:
    if args.resume and args.out:
        args = stored_flags(args, args.out, "sweep", ("grid", "preset", "config", "best_over", "match_params"))
    preset = presets.load_sweep_preset(args.preset) if args.preset else {}
    grid = {k: list(v) for k, v in preset.get("grid", {}).items()}
    grid.update(S.parse_grid(args.grid))
    if not grid:  # a bare --resume of a mistyped --out has no recorded grid either: say so, not "give --grid"
        _check_resume_target(args.resume, args.out)
        if args.resume and args.out:  # a folder that holds no keel sweep (another command's, or none)
            raise KeelError(f"--resume: {args.out} was not started by keel sweep (its study.json records no keel "
                            "sweep command), so there is no grid to continue; check --out, or give --grid")
        raise KeelError("nothing to sweep: give --grid section.key=v1,v2 (or a --preset with a grid group)")
    sets = list(preset.get("set", [])) + list(args.set)  # typed (key, value) pairs, then --set strings
    config = args.config or preset.get("base")
    best = args.best_over or preset.get("best_over")
    match = args.match_params if args.match_params is not None else preset.get("match_params")
    if args.resume and not args.out:
        raise KeelError("--resume needs --out (the sweep folder to continue)")
    _check_engine_flags(args)
    out = Path(args.out) if args.out else Path("runs") / f"sweep-{time.strftime('%Y%m%d-%H%M%S')}"
    check_path_names(out, "--out")
    check_output_not_in_checkpoints(out, "--out")  # before grid.json / study.json go in
    s = presets.run_sweep(config, grid, sets, out=out, best=best, match_params=match, **engine_options(args, "sweep"))
    if args.dry_run:
        return _print_plan(s, False)
    print(S.sweep_markdown(s))
    print(f"sweep: {out}/report.md, {out}/report.json (sweep.md, sweep.json: deprecated, see report.md)")
    return 1 if any(r.get("status") != "done" for r in s["runs"]) else 0


def _register_plot(subparsers) -> None:
    """Add ``keel plot`` (see :mod:`keel.experiments.plot`)."""
    p = subparsers.add_parser("plot", help="plot loss curves, loss vs depth, loss vs LR (PNG)",
                              description=module_summary("keel.experiments.plot"))
    p.add_argument("kind", choices=("loss", "depth", "lr"))
    p.add_argument("paths", nargs="+", help="run folders / sweep folders (depth, lr: one sweep folder)")
    p.add_argument("--out", required=True, help="image file to write: .png, or .pdf, .svg, .jpg ... (by its suffix)")
    p.add_argument("--val", action="store_true", help="loss: validation loss instead of training loss")
    p.add_argument("--x", default="tokens", choices=("tokens", "steps"), help="loss: x axis")
    p.add_argument("--smooth", type=int, default=0, help="loss: trailing mean of the training loss over K steps")
    p.add_argument("--title", default="")
    p.set_defaults(handler=cmd_plot)


def cmd_plot(args: argparse.Namespace) -> int:
    out = Path(args.out)
    image_format(out)
    check_output_not_in_checkpoints(out, "--out")
    check_plot_out(out, "--out")
    make_dirs(out.parent)  # as export-hf and gradflow --plot create theirs
    if args.kind == "loss":
        n = P.plot_loss_curves(args.paths, out, val=args.val, x=args.x, smooth=args.smooth, title=args.title)
        print(f"{out}: {plural(n, 'curve')}")
    else:
        if len(args.paths) != 1:
            raise KeelError(f"keel plot {args.kind} takes one sweep folder, got {len(args.paths)}")
        loss_only = [flag for flag, given in (("--val", args.val), ("--x", args.x != "tokens"),
                                              ("--smooth", args.smooth)) if given]
        if loss_only:
            raise KeelError(f"{', '.join(loss_only)}: only `keel plot loss` reads {'it' if len(loss_only) == 1 else 'them'}"
                            f"; `keel plot {args.kind}` plots each run's final validation loss")
        if args.kind == "depth":
            n = len(P.plot_depth(args.paths[0], out, title=args.title))
        else:
            n = P.plot_lr(args.paths[0], out, title=args.title)
        print(f"{out}: {plural(n, 'line')}")
    return 0


def _ablate_hf(args: argparse.Namespace, tokens: int) -> dict:
    """``keel ablate --hf``: a keel export (``model_type`` keel, written by ``keel export-hf``) is
    ablated as the native model it wraps, by sub-layer as ``--run`` does and, without ``--text``, on
    the same windows: the validation split of ``--run``'s dataset or of the one its
    ``keel_config.toml`` names, ``--seq-len`` defaulting to its ``train.seq_len``. Any other Hugging
    Face causal LM is ablated by decoder layer on text (:func:`A.ablate_hf_folder`): ``--text``, or
    ``--run``'s validation split decoded."""
    config = Path(args.hf) / "config.json"
    try:
        keel_export = json.loads(config.read_text(encoding="utf-8")).get("model_type") == "keel"
    except (OSError, ValueError):
        keel_export = False  # not a readable keel config: ablate_hf_folder names the problem
    if not keel_export:
        if args.loops is not None:
            raise KeelError(f"--loops needs a looped keel model; {args.hf} is not a keel export (model_type keel)")
        return A.ablate_hf_folder(args.hf, A.ablation_text(args.text, args.run, tokens), args.seq_len, tokens,
                                  args.batch_size)
    from keel.hf.convert import KEEL_CONFIG_NAME, load_hf  # lazy: transformers takes ~2 s to import, only for --hf

    hf, tok, _ = load_hf(args.hf, device=args.device)
    check_loops(args.loops, hf.model.cfg, args.hf)
    if args.loops is not None:
        hf.model.set_loops(args.loops)
    else:  # the count config.json's loops sets, capped as --loops is
        check_folder_loops(hf.model.loops, hf.model.cfg, args.hf)
    exported = Path(args.hf) / KEEL_CONFIG_NAME
    cfg = load_config(exported, stored=True) if exported.is_file() else None
    seq = args.seq_len or (cfg.train.seq_len if cfg is not None else min(512, hf.model.cfg.max_seq_len))
    if not 1 <= seq <= hf.model.cfg.max_seq_len:
        raise KeelError(f"--seq-len must be between 1 and model.max_seq_len = {hf.model.cfg.max_seq_len}, got {seq}")
    A.check_tokens(tokens, seq)
    data_dir = None
    if not args.text:  # the run's dataset (tokenizer checked by Run.data_dir), else the one the export names
        data_dir = Run(args.run).data_dir() if args.run else find_data(cfg) if cfg is not None else None
    if data_dir is None:
        text = A.ablation_text(args.text, args.run, tokens)
        windows = A.text_windows(tok(text, add_special_tokens=False)["input_ids"], seq, tokens)
    else:  # the token ids --run ablates on, not their text encoded again (EOS would become text)
        check_tokenizer_matches(tok.backend_tokenizer, data_dir)
        windows = validation_tokens(data_dir, seq, tokens)
    return A.ablate_model(hf.model.float(), windows, batch_size=args.batch_size)


def _register_ablate(subparsers) -> None:
    """Add ``keel ablate`` (see :mod:`keel.diagnostics.ablate`)."""
    p = subparsers.add_parser("ablate", help="layer importance: ΔPPL when each sub-layer is removed",
                              description=module_summary("keel.diagnostics.ablate"))
    p.add_argument("--run", default=None, help="a keel run directory (model and validation split)")
    p.add_argument("--hf", default=None, metavar="MODEL_PATH",
                   help="a local Hugging Face causal LM folder instead (a keel export: one sub-layer = one unit; "
                        "another model: one decoder layer)")
    p.add_argument("--text", default=None, help="a text file to measure on (default: the run's validation split; "
                   "with --hf, that of --run)")
    p.add_argument("--tokens", type=int, default=None, help="validation tokens to use (default 16384)")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the run's train.seq_len; HF 512)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default=key_default("train.device"), help=key_help("train.device"))
    p.add_argument("--out", default=None, help="output folder: new, empty or an earlier ablation (default: RUN/ablate; "
                   "required with --hf, whose folder keel did not write)")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    p.add_argument("--verbose", action="store_true", help="log each unit's PPL on stderr")
    add_loops_flag(p, "run or keel export")
    p.set_defaults(handler=cmd_ablate)


def cmd_ablate(args: argparse.Namespace) -> int:
    check_counts(args, "tokens", "seq_len", "batch_size", "loops")
    if not (args.hf or args.run):
        raise KeelError("give --run DIR (a keel run) or --hf MODEL_PATH")
    if args.hf and not args.out:  # MODEL_PATH/ablate would write into a folder keel did not create
        raise KeelError("ablate --hf needs --out: keel writes only into new folders or its own runs")
    title = str(args.hf or args.run)
    out = Path(args.out) if args.out else Path(title) / "ablate"
    A.check_out(out, "--out")  # before the ablation's minutes, not after
    tokens = args.tokens or 16384
    if args.verbose:  # the library logs each unit's PPL at DEBUG level
        logging.getLogger(A.__name__).setLevel(logging.DEBUG)
    if args.hf:
        res = _ablate_hf(args, tokens)
    else:
        check_loops(args.loops, Run(args.run).config.model, args.run)
        text = A.ablation_text(args.text, None, tokens) if args.text else None
        res = A.ablate_run(args.run, args.seq_len, tokens, args.batch_size, args.device, text=text, loops=args.loops)
    res["source"] = title
    if res["tokens"] < tokens // res["seq_len"] * res["seq_len"]:  # it was capped without a word
        print(f"note: --tokens {tokens:,}: the {'text' if args.text else 'validation split'} gives "
              f"{res['tokens']:,} tokens in whole windows of {res['seq_len']}; ablated on those", file=sys.stderr)
    if args.text:  # the report names the text it measured on, not "validation tokens"
        res["text"] = str(args.text)
    res = A.write_outputs(res, out, title)  # --json prints what ablate.json holds
    if args.json:
        print(json.dumps(res, indent=1))
    else:
        print(A.ablate_markdown(res, title))
        print(f"ablate: {out}/ablate.json, ablate.md, ablate.png")
    return 0


def _register_stress(subparsers) -> None:
    """Add ``keel stress`` (see :mod:`keel.experiments.stress`)."""
    p = subparsers.add_parser(
        "stress", help="max-LR stress test: linear LR ramp until divergence (paper Table 1)",
        description="The paper's max-LR stress test (Table 1): each scheme trains while its LR ramps linearly "
                    "from 0 to --peak-lr; the report gives the LR at which each run diverges and how.")
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
    p.set_defaults(handler=cmd_stress)


STRESS_GRID_FLAGS = ("residual", "sublayers", "seeds", "peak_lr", "ramp_steps", "reference_scheme", "config")
SENSITIVITY_GRID_FLAGS = ("residual", "sublayers", "lrs", "seeds", "config")


def cmd_stress(args) -> int:
    """``keel stress``: see :mod:`keel.experiments.stress`."""
    if args.resume or args.report_only:  # the grid the folder holds, not the defaults' (they trained a new grid in it)
        args = stored_flags(args, args.out, "stress", STRESS_GRID_FLAGS, refuse=False,
                            fixed=("peak_lr", "ramp_steps", "reference_scheme", "config"))
    _check_engine_flags(args)
    check_output_not_in_checkpoints(args.out, "--out")
    schemes = _parse_list(args.residual, str, "--residual") if args.residual is not None else list(SCHEMES)
    layers = _parse_list(args.sublayers, int, args.sublayers_flag)
    seeds = _parse_list(args.seeds, int, "--seeds")
    res = presets.run_stress(args.config, args.set, schemes, layers, seeds, args.peak_lr, args.ramp_steps, args.out,
                             reference_scheme=args.reference_scheme, report_only=args.report_only,
                             **engine_options(args, "stress"))
    if args.dry_run:
        return _print_plan(res, args.json)
    if args.json:
        print(json.dumps(res["table"], indent=1))
    else:
        print(ST.table_markdown(res["table"], args.peak_lr))
        print(f"wrote {Path(args.out) / 'report.md'}, report.json, stress.png (stress.md, stress.json: deprecated, "
              "see report.md)")
    return 0


def engine_options(args: argparse.Namespace, name: str) -> dict:
    """The engine options (:func:`keel.experiments.study.run.execute`) of a grid command's flags;
    ``name``: the command, for the command line the report shows."""
    command = " ".join(["keel", name] + [shlex.quote(a) for a in args.cli_argv[1:] if a not in ("--resume", "--json")])
    return dict(workers=args.workers, threads=args.threads, resume=args.resume, dry_run=args.dry_run,
                mfu=args.mfu, peak_tflops=args.peak_tflops, command=command, executor=executor_of(args))


def _check_engine_flags(args: argparse.Namespace) -> None:
    """Raise KeelError for flags of a grid command that do not go together (``--resume`` with
    ``--report-only`` or ``--dry-run``), a bad ``--mfu`` / ``--peak-tflops``, ``--resume`` of a missing folder."""
    report_only = getattr(args, "report_only", False)
    if args.resume and report_only:
        raise KeelError("--report-only trains nothing; do not combine it with --resume")
    if args.dry_run and (args.resume or report_only):
        raise KeelError("--dry-run only prints the plan; do not combine it with --resume or --report-only")
    if not 0 < args.mfu <= 1 or not 0 < args.peak_tflops < math.inf:
        raise KeelError("--mfu must be in (0, 1] and --peak-tflops a finite number > 0")
    if getattr(args, "restore", None) is None:  # with --restore a new folder continues the restored study
        _check_resume_target(args.resume, getattr(args, "out", None))


def _print_plan(r: dict, as_json: bool) -> int:
    """Print a ``--dry-run`` plan (:func:`keel.experiments.study.run.execute`): JSON or the markdown table."""
    plan = {"groups": r["plan"], "total": r["total"], **{k: r[k] for k in ("restored", "restored_from") if k in r}}
    print(json.dumps(plan, indent=1, default=str) if as_json else r["markdown"])
    return 0


def executor_of(args: argparse.Namespace) -> Executor | None:
    """The grid commands' ``--executor``, ``--slurm``, ``--gpus-per-run`` and ``--share-gpus``; None where
    none is given (the engine takes the folder's on ``--resume``, else the local executor). A ``--resume``
    with ``--slurm`` and no ``--executor`` is Slurm's (the engine refuses it for a folder started otherwise).

    Raises:
        KeelError: a bad ``--slurm`` item or value, ``--slurm`` without ``--executor slurm``, ``--gpus-per-run < 1``,
            ``--workers 0`` (in this process) with a submitit executor;
            ``--executor slurm`` (not ``--dry-run``) where Slurm's ``sbatch`` is not on PATH
            (:func:`keel.experiments.executor.check_slurm_here`).
    """
    if args.executor is None and not args.slurm and args.gpus_per_run is None and not args.share_gpus:
        return None
    unset = frozenset(k for k, v in (("gpus_per_run", args.gpus_per_run), ("share_gpus", args.share_gpus)) if not v)
    kind = args.executor or ("slurm" if args.slurm and getattr(args, "resume", False) else "local")
    ex = Executor(kind, parse_slurm(args.slurm), 1 if args.gpus_per_run is None else args.gpus_per_run,
                  args.share_gpus, unset=unset)
    if kind != "local" and getattr(args, "workers", None) == 0:  # it ran at most 1 job at a time, silently
        raise KeelError(f"--workers 0 runs the grid in this process; with --executor {kind} give the runs at once "
                        "(>= 1)")
    # a --resume's --slurm without --executor: the engine first checks it against the folder's executor (it
    # said "--executor slurm needs Slurm" of a submitit-local folder), then that Slurm is here
    if not getattr(args, "dry_run", False) and args.executor is not None:
        check_slurm_here(ex)
    return ex


def _check_resume_target(resume: bool, out) -> None:
    """Raise KeelError for ``--resume`` on an ``out`` folder that does not exist (a mistyped --out
    used to start the whole grid again there, which at the cpu scale of a study is hours)."""
    if resume and out and not Path(out).is_dir():
        raise KeelError(f"--resume: {out} does not exist, nothing to continue; check --out, or drop --resume "
                        "to start there")


def _parse_list(text: str, kind, what: str) -> list:
    items = [s.strip() for s in str(text).split(",") if s.strip()]
    if not items:
        raise KeelError(f"{what} is empty")
    try:
        return [kind(s) for s in items]
    except ValueError:
        raise KeelError(f"{what} must be a comma-separated list of {kind.__name__}s, got {text!r}") from None


def _register_lr_sensitivity(subparsers) -> None:
    """Add ``keel lr-sensitivity`` to the CLI."""
    p = subparsers.add_parser("lr-sensitivity", help="final loss against peak LR per scheme and depth "
                              "(Wortsman et al. 2023 LR sensitivity)",
                              description=module_summary("keel.experiments.sensitivity"))
    p.add_argument("--residual", default="pre_ln,keel", help="comma-separated schemes")
    _add_sublayers_flag(p, "16,64", "comma-separated depths in sub-layers (even; 2 per block)")
    p.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2,1e-1", help="comma-separated peak LRs (log-spaced)")
    p.add_argument("--seeds", default="0,1", help="comma-separated train.seed values")
    _add_grid_flags(p)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--json", action="store_true", help="print the per-cell numbers as JSON on stdout")
    p.set_defaults(handler=cmd_lr_sensitivity)


def cmd_lr_sensitivity(args: argparse.Namespace) -> int:
    """``keel lr-sensitivity``: see :mod:`keel.experiments.sensitivity`."""
    if args.resume or args.report_only:  # the grid the folder holds, as keel stress
        args = stored_flags(args, args.out, "lr-sensitivity", SENSITIVITY_GRID_FLAGS, refuse=False, fixed=("config",))
    _check_engine_flags(args)
    s = presets.run_lr_sensitivity(args.config, _parse_list(args.residual, str, "--residual"),
                                   _parse_list(args.sublayers, int, args.sublayers_flag),
                                   _parse_list(args.lrs, float, "--lrs"), _parse_list(args.seeds, int, "--seeds"),
                                   args.set, out=args.out, report_only=args.report_only,
                                   **engine_options(args, "lr-sensitivity"))
    if args.dry_run:
        return _print_plan(s, args.json)
    if args.json:
        print(json.dumps({k: s[k] for k in ("lrs", "unigram_entropy", "cells")}, indent=1))
    else:
        print(LS.markdown(s))
        png = f", {LS.OUT_PNG}" if (Path(args.out) / LS.OUT_PNG).is_file() else ""  # none when no run finished
        print(f"wrote {Path(args.out) / 'report.md'}, report.json{png} ({LS.OUT_MD}, {LS.OUT_JSON}: deprecated, "
              "see report.md)")
    return 1 if any(r.get("status") != "done" for r in s["runs"]) else 0


def study_command(argv: list[str]) -> str:
    """The command that trains the whole study, as the report shows it: ``keel study`` and
    ``argv`` without the flags that only pick what this invocation does (``--resume``,
    ``--groups G``, ``--json``), e.g. a study started with ``--groups ramp,init``."""
    keep, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--resume", "--json") or a.startswith("--groups="):
            continue
        elif a == "--groups":
            skip = True
        else:
            keep.append(shlex.quote(a))
    return " ".join(["keel", "study"] + keep)


def _register_study(subparsers) -> None:
    """Add ``keel study`` (see :mod:`keel.experiments.study`)."""
    p = subparsers.add_parser("study", help="the paper's claims as one resumable study with computed verdicts",
                              description=module_summary("keel.experiments.study"))
    p.add_argument("name", help=f"a shipped study ({', '.join(preset_names('studies'))}) or a study TOML file")
    p.add_argument("--scale", default=None, help="the study's scale: tiny (tests), cpu, gpu-1 (one GPU-day), paper; "
                   "needed for a study that declares [scales] (a file without them has one size)")
    p.add_argument("--out", default=None, help="output folder (default: runs/study-NAME-SCALE)")
    _add_grid_flags(p, config_help=None, set_help="override a config key in every run, after the scale's and the "
                    "group's own keys (repeatable; not the keys the groups vary: model.residual, model.n_layers, "
                    "train.lr, train.seed)")
    p.add_argument("--groups", default=None, metavar="G[,G...]",
                   help="train (or with --dry-run: plan) only these groups (e.g. ramp,init), in the study's order; "
                        "the report still covers all")
    p.add_argument("--restore", default=None, metavar="REPORT_JSON",
                   help="an earlier report.json of the same study and scale (e.g. the committed one, when the "
                        "run folders are gone): its finished runs are not trained again and count in the report; "
                        "a warning names those the study no longer plans (left out of the new report)")
    p.add_argument("--json", action="store_true", help="print the verdicts (or the plan) as JSON on stdout")
    p.set_defaults(handler=cmd_study)


def cmd_study(args: argparse.Namespace) -> int:
    """``keel study``: see :mod:`keel.experiments.study`."""
    groups = _study_groups(args)
    if args.scale is None and (args.resume or args.report_only) and args.out:  # the scale DIR was started at
        args.scale = started_scale(args.out)
    args.scale = study_scale(args.name, args.scale)
    out = args.out or f"runs/study-{Path(args.name).stem}-{args.scale}"
    if args.resume or (args.report_only and args.restore is None):  # the --set flags the study started with
        args = stored_flags(args, out, "study")  # (as keel sweep --resume); --report-only takes none of its own
    check_path_names(out, "--out")  # "File name too long" was a traceback
    check_output_not_in_checkpoints(out, "--out")
    _check_engine_flags(argparse.Namespace(**{**vars(args), "out": out}))
    command = study_command(args.cli_argv[1:]) if len(args.cli_argv) > 1 else f"keel study {args.name}"
    r = run_study(args.name, args.scale, out, args.set, workers=args.workers, threads=args.threads,
                  resume=args.resume, report_only=args.report_only, dry_run=args.dry_run, mfu=args.mfu,
                  peak_tflops=args.peak_tflops, command=command, groups=groups, restore=args.restore,
                  executor=executor_of(args))
    if args.dry_run:
        return _print_plan(r, args.json)
    _print_verdicts(r, out, args.json)
    return 1 if any(x["status"] == "error" for x in r["runs"]) else 0


def _study_groups(args: argparse.Namespace) -> list[str]:
    """``keel study``'s ``--groups`` as a list (empty: every group), after its flags are checked.

    Raises:
        KeelError: ``--groups`` with no name, or with ``--report-only``; an empty study name, ``--out`` or
            ``--restore``; ``--set`` with ``--report-only`` and no ``--restore``.
    """
    groups = [g.strip() for g in (args.groups or "").split(",") if g.strip()]
    if args.groups is not None and not groups:
        raise KeelError("--groups needs group names, e.g. --groups ramp,init (leave it out to train every group)")
    if groups and args.report_only:
        raise KeelError("--groups picks the groups to train; do not combine it with --report-only")
    if not args.name.strip():
        raise KeelError("the study name is empty: give a shipped study (e.g. claims) or a study TOML file")
    if args.out is not None and not args.out.strip():
        raise KeelError("--out is empty: give an output folder (or leave --out out: runs/study-NAME-SCALE)")
    if args.set and args.report_only and args.restore is None:  # with --restore they must match the report's
        raise KeelError("--report-only reads the finished runs as they were trained; do not combine it with --set")
    if args.restore is not None and not args.restore.strip():
        raise KeelError("--restore is empty: give an earlier report.json of this study")
    return groups


def _print_verdicts(r: dict, out: str, as_json: bool) -> None:
    """Print a study's verdicts (:func:`keel.experiments.study.run.execute`'s report ``r``): JSON, or a line per
    claim and the files written into ``out``."""
    if as_json:
        print(json.dumps({"claims": r["claims"]}, indent=1, default=str))
        return
    for c in r["claims"]:
        print(f"({c['id']}) {c['verdict']:<15} {c['title']}")
    print(f"wrote {Path(out) / 'report.md'}, report.json, {', '.join(r['plots']) or 'no plots yet'}")
