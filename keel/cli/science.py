"""The science commands' flags: ``keel study``, ``keel gradflow``, ``keel stress``, ``keel lr-sensitivity``,
``keel sweep``, ``keel plot`` and ``keel ablate``. Their handlers are in :mod:`keel.cli.handlers.science`;
the work is done by :mod:`keel.diagnostics.gradflow` and the modules of :mod:`keel.experiments`.
"""

from __future__ import annotations

import argparse
import logging

from keel.cli.formatting import module_summary
from keel.cli.trained import add_loops_flag
from keel.config import key_default, key_help, preset_names
from keel.experiments.executor import EXECUTORS


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
                   help="comma-separated schemes (default: every scheme in keel.model.SCHEMES)")
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
                   help="override a config key, e.g. model.init_std=0.125 or data.path=DIR (repeatable)")
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
    p.set_defaults(handler="keel.cli.handlers.science.cmd_gradflow")


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
    p.set_defaults(handler="keel.cli.handlers.science.cmd_sweep")


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
    p.set_defaults(handler="keel.cli.handlers.science.cmd_plot")


def _register_ablate(subparsers) -> None:
    """Add ``keel ablate`` (see :mod:`keel.diagnostics.ablate`)."""
    p = subparsers.add_parser("ablate", help="layer importance: ΔPPL when each sub-layer is removed",
                              description=module_summary("keel.diagnostics.ablate"))
    p.add_argument("--run", default=None, help="a keel run directory (model and validation split)")
    p.add_argument("--hf", default=None, metavar="MODEL_PATH",
                   help="a local Hugging Face causal LM folder instead (one decoder layer = one unit)")
    p.add_argument("--text", default=None, help="a text file to measure on (default: the run's validation split; "
                   "with --hf, that of --run)")
    p.add_argument("--tokens", type=int, default=None, help="validation tokens to use (default 16384)")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the run's train.seq_len; HF 512)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default=key_default("train.device"), help=key_help("train.device"))
    p.add_argument("--out", default=None, help="output folder (default: RUN/ablate or MODEL_PATH/ablate)")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the table")
    p.add_argument("--verbose", action="store_true", help="log each unit's PPL on stderr")
    add_loops_flag(p, "run or keel export")
    p.set_defaults(handler="keel.cli.handlers.science.cmd_ablate")


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
    p.set_defaults(handler="keel.cli.handlers.science.cmd_stress")


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
    p.set_defaults(handler="keel.cli.handlers.science.cmd_lr_sensitivity")


def _register_study(subparsers) -> None:
    """Add ``keel study`` (see :mod:`keel.experiments.study`)."""
    p = subparsers.add_parser("study", help="the paper's claims as one resumable study with computed verdicts",
                              description=module_summary("keel.experiments.study"))
    p.add_argument("name", help=f"a shipped study ({', '.join(preset_names('studies'))}) or a study TOML file")
    p.add_argument("--scale", required=True, help="the study's scale: tiny (tests), cpu, gpu-1 (one GPU-day), paper")
    p.add_argument("--out", default=None, help="output folder (default: runs/study-NAME-SCALE)")
    _add_grid_flags(p, config_help=None, set_help="override a config key in every run, after the scale's and the "
                    "group's own keys (repeatable; not the keys the groups vary: model.residual, model.n_layers, "
                    "train.lr, train.seed)")
    p.add_argument("--groups", default=None, metavar="G[,G...]",
                   help="train (or with --dry-run: plan) only these groups (e.g. ramp,init), in the study's order; "
                        "the report still covers all")
    p.add_argument("--restore", default=None, metavar="REPORT_JSON",
                   help="an earlier report.json of the same study and scale (e.g. the committed one, when the "
                        "run folders are gone): its finished runs are not trained again and count in the report")
    p.add_argument("--json", action="store_true", help="print the verdicts (or the plan) as JSON on stdout")
    p.set_defaults(handler="keel.cli.handlers.science.cmd_study")
