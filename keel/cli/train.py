"""The flags of ``keel prepare``, ``keel train`` and ``keel generate`` (handlers: :mod:`keel.cli.handlers.train`)."""

from __future__ import annotations

from keel.cli.trained import add_loops_flag
from keel.config import DEFAULT_PRESET, key_default, key_help


def register(sub) -> None:
    """Add ``prepare``, ``train`` and ``generate`` to the ``keel`` sub-parsers."""
    pp = sub.add_parser("prepare", help="tokenize a corpus into binary shards (cached)",
                        description="Read a corpus (the built-in one, a file or folder of text, or a Hugging Face "
                                    "dataset), train or load a tokenizer, and write train/val token shards; "
                                    "`keel train` does this itself when its data is not prepared yet.")
    for flag in ("source", "tokenizer"):  # defaults and help: the data.* keys' declarations (keel.config)
        pp.add_argument(f"--{flag}", default=key_default(f"data.{flag}"), help=key_help(f"data.{flag}"))
    pp.add_argument("--out", default=None, help="output folder (default: derived from the inputs under --cache-dir)")
    pp.add_argument("--cache-dir", default=key_default("data.cache_dir"), help=key_help("data.cache_dir"))
    pp.add_argument("--val-fraction", type=float, default=key_default("data.val_fraction"),
                    help=key_help("data.val_fraction"))
    pp.add_argument("--max-bytes", type=int, default=key_default("data.max_bytes"), help=key_help("data.max_bytes"))
    pp.add_argument("--text-field", default=key_default("data.text_field"), help=key_help("data.text_field"))
    pp.add_argument("--force", action="store_true",
                    help="prepare again even if the cached dataset matches, and replace a dataset in --out that was "
                         "prepared from other inputs (refused without it: runs trained on it read it by path)")
    pp.set_defaults(handler="keel.cli.handlers.train.cmd_prepare")

    pt = sub.add_parser("train", help="train a language model",
                        description="Train a language model from a config (a preset or a TOML file, with --set "
                                    "overrides) into a run directory: metrics, checkpoints, plots and a sample. "
                                    "Continue an interrupted run with --resume DIR.")
    pt.add_argument("--config", default=None,
                    help=f"TOML file or preset name (see `keel config`; default: {DEFAULT_PRESET})")
    pt.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config key (repeatable)")
    pt.add_argument("--run-dir", default=None, help="where the run goes (default: runs/<time>-<scheme>-<L>sl)")
    pt.add_argument("--resume", default=None, metavar="DIR",
                    help="continue the run in DIR from its newest intact checkpoint")
    pt.add_argument("--restart", action="store_true",
                    help="with --resume DIR or --run-dir DIR: train the run there again from step 0 with its own "
                         "config.toml (--run-dir with --config: that config), deleting its metrics and checkpoints "
                         "(a run with history is otherwise never restarted)")
    pt.add_argument("--nproc", type=int, default=None, metavar="N",
                    help="train with N processes on this machine (launches torchrun; "
                         "train.parallelism picks ddp or fsdp; train.batch_size is the global batch)")
    pt.set_defaults(handler="keel.cli.handlers.train.cmd_train")

    pg = sub.add_parser("generate", help="sample text from a trained run",
                        description="Sample a continuation of --prompt from a run's newest checkpoint.")
    pg.add_argument("--run", required=True, help="run directory")
    pg.add_argument("--prompt", default="", help="text to continue")
    pg.add_argument("--max-new-tokens", type=int, default=100)
    pg.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    pg.add_argument("--top-k", type=int, default=50, help="0 = no top-k filtering")
    pg.add_argument("--num-samples", type=int, default=1)
    pg.add_argument("--seed", type=int, default=0)
    pg.add_argument("--device", default=key_default("train.device"), help=key_help("train.device"))
    add_loops_flag(pg)
    pg.set_defaults(handler="keel.cli.handlers.train.cmd_generate")
