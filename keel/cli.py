"""The ``keel`` command line: ``keel prepare``, ``keel train``, ``keel generate``.

A user mistake (bad path, bad config value, too little data) prints one line
``keel: error: ...`` on stderr and exits with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

from keel.errors import KeelError

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = "demo"

# Commands that live beside their feature: "module:function", where function(subparsers)
# adds one sub-command and sets ``func``. Such modules must import torch lazily (inside the
# command), so that ``keel --help`` stays fast.
PLUGGED_COMMANDS: list[str] = [
    "keel.diagnostics.gradflow:register",
    "keel.experiments.stress:register",
    "keel.eval.cli:register_hf",
    "keel.eval.cli:register",
    "keel.experiments.sweep:register",
    "keel.experiments.plot:register",
    "keel.experiments.ablate:register",
    "keel.experiments.sensitivity:register",
]


def resolve_config_path(name: str | None) -> Path | None:
    """A config file path, or a preset name from ``configs/`` (``demo``, ``paper-512``...)."""
    name = name or DEFAULT_CONFIG
    p = Path(name)
    if p.suffix == ".toml" or p.exists():
        if not p.is_file():
            raise KeelError(f"config file not found: {p}")
        return p
    preset = CONFIG_DIR / f"{name}.toml"
    if preset.is_file():
        return preset
    known = ", ".join(sorted(q.stem for q in CONFIG_DIR.glob("*.toml"))) or "none found"
    raise KeelError(f"unknown config {name!r}: not a file and not a preset in {CONFIG_DIR} ({known})")


def cmd_prepare(args: argparse.Namespace) -> int:
    from keel.data import prepare_dataset, read_meta

    out = prepare_dataset(args.source, args.tokenizer, args.out, val_fraction=args.val_fraction,
                          max_bytes=args.max_bytes, text_field=args.text_field, cache_dir=args.cache_dir)
    meta = read_meta(out)
    print(f"dataset: {out}")
    asked = args.tokenizer.split(":", 1)[1] if args.tokenizer.startswith("bpe:") else ""
    if asked.isdigit() and meta["vocab_size"] < int(asked):
        print(f"  note: asked for {asked} BPE tokens, the corpus supports only {meta['vocab_size']}")
    if meta.get("docs_with_replacement_chars"):
        print(f"  note: {meta['docs_with_replacement_chars']} document(s) were not valid UTF-8; "
              "their undecodable bytes became U+FFFD")
    if meta["val_tokens"] > meta["train_tokens"]:
        print("  warning: the validation split is larger than the training split (too few documents?)")
    print(f"  vocab {meta['vocab_size']}, train {meta['train_tokens']:,} tokens ({meta['n_docs_train']} docs), "
          f"val {meta['val_tokens']:,} tokens ({meta['n_docs_val']} docs)")
    return 0


def default_run_dir(cfg) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{cfg.model.residual}-{cfg.model.n_sublayers}sl"


def launch_torchrun(args: argparse.Namespace, run_dir: Path) -> int:
    """Re-run this ``keel train`` under torchrun with ``args.nproc`` processes on this machine:
    ``python -m torch.distributed.run --standalone --nproc_per_node N -m keel train <args>``
    (the same arguments, without ``--nproc``, and with the run directory made explicit so
    that every rank agrees on it). Returns torchrun's exit status."""
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           "-m", "keel", "train"]
    if args.resume:
        cmd += ["--resume", str(args.resume)]
    else:
        if args.config:
            cmd += ["--config", str(args.config)]
        cmd += ["--run-dir", str(run_dir)]
    for item in args.set:
        cmd += ["--set", item]
    return subprocess.call(cmd)


def cmd_train(args: argparse.Namespace) -> int:
    from keel.config import load_config
    from keel.train import train

    if args.nproc is not None:
        import os

        if args.nproc < 1:
            raise KeelError(f"--nproc must be >= 1, got {args.nproc}")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            raise KeelError("--nproc starts torchrun itself; do not use it inside torchrun")
    if args.resume:
        run_dir = Path(args.resume)
        if not (run_dir / "config.toml").is_file():
            raise KeelError(f"cannot resume {run_dir}: no config.toml there (not a run directory)")
        if args.config:
            raise KeelError("--resume takes the run's own config.toml; use --set to change keys")
        cfg = load_config(run_dir / "config.toml", args.set)
    else:
        cfg = load_config(resolve_config_path(args.config), args.set)
        run_dir = Path(args.run_dir) if args.run_dir else default_run_dir(cfg)
    if args.nproc is not None:
        return launch_torchrun(args, run_dir)
    res = train(cfg, run_dir, resume=bool(args.resume))
    import os

    if int(os.environ.get("RANK", "0")) != 0:
        return 0  # only rank 0 reports
    print(f"run: {res.run_dir}")
    if res.first_val_loss is not None:
        print(f"validation loss at step 0: {res.first_val_loss:.4f} (perplexity {math.exp(res.first_val_loss):.1f})")
    print(f"validation loss at step {res.step}: {res.val_loss:.4f} (perplexity {res.val_ppl:.2f})")
    print(f"tokens: {res.tokens:,}, mean {res.tokens_per_s:,.0f} tokens/s")
    print("sample:")
    print(res.sample)
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0:
        raise KeelError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise KeelError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0 or args.num_samples < 1:
        raise KeelError("--top-k must be >= 0 and --num-samples >= 1")
    from keel.train.checkpoint import load_run

    model, tokenizer, device = load_run(args.run, device=args.device)
    from keel.train.trainer import sample_text

    for i in range(args.num_samples):
        text = sample_text(model, tokenizer, args.prompt, args.max_new_tokens, device,
                           temperature=args.temperature, top_k=args.top_k or None, seed=args.seed + i)
        print(text)
        if i + 1 < args.num_samples:
            print("-" * 40)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="keel", description="Keel and its baselines: prepare data, train, sample.")
    sub = p.add_subparsers(dest="command", required=True)

    pp = sub.add_parser("prepare", help="tokenize a corpus into binary shards (cached)")
    pp.add_argument("--source", default="builtin:python-stdlib",
                    help="builtin:python-stdlib | a file or folder | hf:NAME[:CONFIG]")
    pp.add_argument("--tokenizer", default="bpe:8192", help="bpe:N | path/to/tokenizer.json | HF tokenizer name")
    pp.add_argument("--out", default=None, help="output folder (default: derived from the inputs under --cache-dir)")
    pp.add_argument("--cache-dir", default="data")
    pp.add_argument("--val-fraction", type=float, default=0.01, help="fraction of documents for validation")
    pp.add_argument("--max-bytes", type=int, default=None, help="read at most this many bytes of text")
    pp.add_argument("--text-field", default="text", help="field holding the text in .jsonl/.json/.parquet")
    pp.set_defaults(func=cmd_prepare)

    pt = sub.add_parser("train", help="train a language model")
    pt.add_argument("--config", default=None, help=f"TOML file or preset name in configs/ (default: {DEFAULT_CONFIG})")
    pt.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a config key (repeatable)")
    pt.add_argument("--run-dir", default=None, help="where the run goes (default: runs/<time>-<scheme>-<L>sl)")
    pt.add_argument("--resume", default=None, metavar="DIR", help="continue the run in DIR from its latest checkpoint")
    pt.add_argument("--nproc", type=int, default=None, metavar="N",
                    help="train with N processes on this machine (launches torchrun; "
                         "train.parallelism picks ddp or fsdp; train.batch_size is the global batch)")
    pt.set_defaults(func=cmd_train)

    pg = sub.add_parser("generate", help="sample text from a trained run")
    pg.add_argument("--run", required=True, help="run directory")
    pg.add_argument("--prompt", default="", help="text to continue")
    pg.add_argument("--max-new-tokens", type=int, default=100)
    pg.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    pg.add_argument("--top-k", type=int, default=50, help="0 = no top-k filtering")
    pg.add_argument("--num-samples", type=int, default=1)
    pg.add_argument("--seed", type=int, default=0)
    pg.add_argument("--device", default="auto")
    pg.set_defaults(func=cmd_generate)

    import importlib

    for spec in PLUGGED_COMMANDS:
        module, func = spec.split(":")
        getattr(importlib.import_module(module), func)(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeelError as e:
        print(f"keel: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("keel: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
