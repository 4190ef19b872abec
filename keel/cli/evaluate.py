"""``keel eval``, ``keel export-hf`` and ``keel import-hf``.

Importing :mod:`keel.hf` registers the model with transformers (a heavy import), so it
happens inside the handlers only.

Usage::

    keel export-hf --run runs/x --out hf/x
    keel import-hf --hf hf/x --out runs/x-back
    keel eval --run runs/x | --hf hf/x [--tasks t1,t2] [--task-dir DIR] [--limit N] [--json]
              [--text FILE] [--device auto]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from keel.config import key_default, key_help
from keel.errors import KeelError

KEEL_CONFIG = "keel_config.toml"  # the run's config in an exported folder (keel.hf.convert.KEEL_CONFIG_NAME)


def _register_hf(subparsers) -> None:
    """Add ``export-hf`` and ``import-hf`` to the ``keel`` sub-parsers."""
    pe = subparsers.add_parser("export-hf", help="write a run as a Hugging Face model folder",
                               description="Write the latest checkpoint of a run as config.json + model.safetensors "
                                           "+ tokenizer files + modeling code generated from keel's source. Load it "
                                           "anywhere with AutoModelForCausalLM.from_pretrained(OUT, "
                                           "trust_remote_code=True), or with keel's code after `import keel.hf`. "
                                           "A pre_ln run is exported as a stock LlamaForCausalLM (no custom code).")
    pe.add_argument("--run", required=True, help="run directory")
    pe.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    pe.set_defaults(func=_cmd_export_hf)

    pi = subparsers.add_parser("import-hf", help="make a run directory from a keel or Llama Hugging Face folder",
                               description="Inverse of export-hf, and the way in for a stock LlamaForCausalLM "
                                           "(becomes a pre_ln run; RoPE scaling, biases and other features keel "
                                           "lacks are refused by name): a run directory that `keel generate`, "
                                           "`keel eval` and `keel train --resume` accept (its checkpoint is step 0 "
                                           "with a fresh optimiser).")
    pi.add_argument("--hf", required=True, help="Hugging Face folder: from `keel export-hf`, or a stock Llama")
    pi.add_argument("--out", required=True, help="run directory to create (must not exist or be empty)")
    pi.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="set a data.* or train.* key of the new run (repeatable); train.batch_size and "
                         "train.seq_len cannot change on resume, so choose them here")
    pi.set_defaults(func=_cmd_import_hf)


def _cmd_export_hf(args: argparse.Namespace) -> int:
    from keel.hf.convert import export_hf

    out = export_hf(args.run, args.out)
    print(f"exported {args.run} -> {out}")
    print(f"load it with AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True), or after "
          "`import keel.hf` without trust_remote_code (a pre_ln export is a plain Llama model)")
    return 0


def _cmd_import_hf(args: argparse.Namespace) -> int:
    from keel.hf.convert import import_hf

    out = import_hf(args.hf, args.out, overrides=args.set)
    print(f"imported {args.hf} -> run {out} (continue training with `keel train --resume {out}`)")
    return 0


def register(subparsers) -> None:
    """Add ``eval``, ``export-hf`` and ``import-hf`` to the ``keel`` sub-parsers."""
    p = subparsers.add_parser(
        "eval", help="perplexity, bits per byte and lm-evaluation-harness tasks",
        description="Report loss, perplexity and bits per byte on held-out text (the run's validation split, "
                    "or --text FILE), then score lm-evaluation-harness tasks (--tasks), one by one: a task "
                    "whose data cannot be loaded is reported in one line and the others still run.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", help="run directory")
    src.add_argument("--hf", help="Hugging Face folder of a keel model (from `keel export-hf`)")
    p.add_argument("--tasks", default="", help="comma-separated lm-eval task names "
                                               "(shipped: keel_python_completion, keel_python_paragraphs, "
                                               "keel_python_generate)")
    p.add_argument("--task-dir", default=None, help="extra folder of task YAMLs (local JSONL data allowed)")
    p.add_argument("--limit", type=int, default=None, help="at most N documents per task")
    p.add_argument("--text", default=None, metavar="FILE", help="held-out text file instead of the validation split")
    p.add_argument("--seq-len", type=int, default=None,
                   help="tokens per window for perplexity (default: train.seq_len of the run, else max_seq_len)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="validation tokens to score (default: the run's train.eval_tokens)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="windows (perplexity) or requests (tasks) per forward pass")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--verbose", action="store_true", help="show lm-evaluation-harness' own progress bars and logs")
    p.add_argument("--device", default=key_default("train.device"), help=key_help("train.device"))
    p.set_defaults(func=cmd_eval)
    _register_hf(subparsers)


def _load(args):
    """(native model, tokenizers.Tokenizer, Config or None, device, description)."""
    if args.run:
        from keel.run import Run

        run = Run(args.run)
        model = run.load_model(device=args.device)
        return model, run.tokenizer(), run.config, next(model.parameters()).device, str(args.run)
    from keel.hf.convert import KEEL_CONFIG_NAME, load_hf

    hf, hf_tok, device = load_hf(args.hf, device=args.device)
    cfg = None
    if (Path(args.hf) / KEEL_CONFIG_NAME).is_file():
        from keel.config import load_config

        cfg = load_config(Path(args.hf) / KEEL_CONFIG_NAME)
        cfg.model = hf.config.to_model_config()
    return hf.model, hf_tok.backend_tokenizer, cfg, device, str(args.hf)


def _held_out_dataset(args, cfg):
    """(prepared dataset folder or None, why none): ``--run`` prepares it if needed; ``--hf``
    only uses one that exists (:func:`keel.data.find_data`)."""
    if cfg is None:
        return None, f"no {KEEL_CONFIG} in {args.hf}"
    from keel.data import find_data, resolve_data

    if args.run:
        return resolve_data(cfg, progress=False), ""
    found = find_data(cfg)
    d = cfg.data
    where = f"data.path {d.path}" if d.path else f"data.source {d.source} under data.cache_dir {d.cache_dir}"
    return found, f"the dataset {KEEL_CONFIG} names ({where}) is not prepared here"


def _check_counts(args: argparse.Namespace) -> None:
    """``--limit``, ``--batch-size``, ``--max-tokens`` and ``--seq-len``, when given, are >= 1 (KeelError)."""
    for flag in ("limit", "batch_size", "max_tokens", "seq_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise KeelError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")


def cmd_eval(args: argparse.Namespace) -> int:
    """``keel eval``: held-out perplexity / bits per byte, then lm-eval tasks; exit 1 if a task could not run."""
    from keel.eval.perplexity import text_perplexity, validation_perplexity

    task_names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    _check_counts(args)
    model, tokenizer, cfg, device, name = _load(args)
    mc = model.cfg
    default_seq = cfg.train.seq_len if cfg is not None else mc.max_seq_len
    seq_len = args.seq_len if args.seq_len is not None else default_seq
    if not 1 <= seq_len <= mc.max_seq_len:
        raise KeelError(f"--seq-len must be between 1 and model.max_seq_len = {mc.max_seq_len}, got {seq_len}")
    report: dict = {"model": name, "residual": mc.residual, "blocks": mc.n_layers, "sublayers": mc.n_sublayers,
                    "d_model": mc.d_model, "parameters": model.num_params(), "perplexity": None, "tasks": {}}
    human = not args.json  # --json: stdout holds the JSON report only
    if human:
        print(f"model: {name} ({mc.residual}, {mc.n_layers} blocks = {mc.n_sublayers} sub-layers, "
              f"d_model {mc.d_model}, {model.num_params() / 1e6:.2f}M parameters)")

    res = None
    if args.text:
        path = Path(args.text)
        if not path.is_file():
            raise KeelError(f"--text file not found: {path}")
        from keel.data.text import read_text_file

        text, replaced = read_text_file(path)  # as `keel prepare` reads it: invalid UTF-8 -> U+FFFD
        if replaced:
            print(f"note: {path} is not valid UTF-8; its undecodable bytes became U+FFFD", file=sys.stderr)
        from keel.data.prepare import EOS_TOKEN

        res = text_perplexity(model, tokenizer, text, seq_len, device, eos_id=tokenizer.token_to_id(EOS_TOKEN),
                              source=str(path), batch_size=args.batch_size)
    else:
        data_dir, why_none = _held_out_dataset(args, cfg)
        if data_dir is not None:
            max_tokens = args.max_tokens if args.max_tokens is not None else cfg.train.eval_tokens
            res = validation_perplexity(model, tokenizer, data_dir, seq_len, max_tokens, device,
                                        batch_size=args.batch_size)
    if res is not None:
        report["perplexity"] = {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                                for k, v in res.to_dict().items()}
    if human and res is not None:
        print(f"held-out text: {res.source} ({res.tokens:,} tokens, {res.bytes:,} bytes, windows of {seq_len} tokens)")
        print(f"  loss {res.loss:.4f} nats/token, perplexity {res.perplexity:.2f}, bits per byte {res.bits_per_byte:.4f}")
    elif human:
        print(f"held-out text: none ({why_none}; pass --text FILE)")

    failed = 0
    if task_names:
        from keel.eval.tasks import run_tasks

        results = run_tasks(model, tokenizer, task_names, limit=args.limit, task_dir=args.task_dir,
                            batch_size=args.batch_size, verbose=args.verbose)  # a task that fails: logged
        report["tasks"] = results
        for task, metrics in results.items():
            if "error" in metrics:
                failed += 1
                continue
            vals = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
            if human:
                print(f"task {task}: {vals}")
    if args.json:
        print(json.dumps(report, indent=2))
    return 1 if failed else 0
