"""``keel eval``: its flags beside its handler (:mod:`keel.cli.commands`).

Usage::

    keel eval --run runs/x | --hf hf/x [--tasks t1,t2] [--task-dir DIR] [--limit N] [--json]
              [--text FILE] [--device auto] [--loops R]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from keel.cli.commands import add_loops_flag, check_counts, check_folder_loops, check_loops
from keel.config import key_default, key_help, load_config
from keel.errors import KeelError, plural


def import_library() -> None:
    """The library the handler below calls, imported into this module (:mod:`keel.cli.commands`)."""
    global find_data, EOS_TOKEN, read_text_file, text_perplexity, validation_perplexity, check_tasks, run_tasks, Run
    # torch and the library (seconds of import), imported when one of these commands runs, not when the
    # parser is built: `keel --help` loads no torch
    from keel.data import find_data
    from keel.data.prepare import EOS_TOKEN
    from keel.data.text import read_text_file
    from keel.eval.perplexity import text_perplexity, validation_perplexity
    from keel.eval.tasks import check_tasks, run_tasks
    from keel.run import Run


KEEL_CONFIG = "keel_config.toml"  # the run's config in an exported folder (keel.hf.convert.KEEL_CONFIG_NAME)


def _load(args):
    """(native model, tokenizers.Tokenizer, Config or None, device, description)."""
    if args.run:
        run = Run(args.run)
        model = run.load_model(device=args.device)
        return model, run.tokenizer(), run.config, next(model.parameters()).device, str(args.run)
    # lazy: keel.hf needs transformers (the optional extra [hf]) and adds ~1.7 s of import,
    # which `keel eval --run` neither needs nor pays
    from keel.hf.convert import KEEL_CONFIG_NAME, load_hf

    hf, hf_tok, device = load_hf(args.hf, device=args.device)
    cfg = None
    if (Path(args.hf) / KEEL_CONFIG_NAME).is_file():
        cfg = load_config(Path(args.hf) / KEEL_CONFIG_NAME, stored=True)
        cfg.model = hf.config.to_model_config()
    return hf.model, hf_tok.backend_tokenizer, cfg, device, str(args.hf)


def _held_out_dataset(args, cfg):
    """(prepared dataset folder or None, why none): ``--run`` prepares it if needed; ``--hf``
    only uses one that exists (:func:`keel.data.find_data`)."""
    if cfg is None:
        return None, f"no {KEEL_CONFIG} in {args.hf}"

    if args.run:  # the run's loader: refuses a dataset prepared since with another tokenizer
        return Run(args.run).data_dir(), ""
    found = find_data(cfg)
    d = cfg.data
    where = f"data.path {d.path}" if d.path else f"data.source {d.source} under data.cache_dir {d.cache_dir}"
    return found, f"the dataset {KEEL_CONFIG} names ({where}) is not prepared here"


def _window(args: argparse.Namespace, cfg, max_seq_len: int) -> int:
    """The scoring window in tokens: ``--seq-len``, else the run's ``train.seq_len`` (an export
    without keel's config: ``max_seq_len``). Raises KeelError: outside [1, max_seq_len], or a
    ``--max-tokens`` below one window (it scored one whole window without a word)."""
    seq_len = args.seq_len if args.seq_len is not None else (cfg.train.seq_len if cfg is not None else max_seq_len)
    if not 1 <= seq_len <= max_seq_len:
        raise KeelError(f"--seq-len must be between 1 and model.max_seq_len = {max_seq_len}, got {seq_len}")
    if args.max_tokens is not None and args.max_tokens < seq_len:
        raise KeelError(f"--max-tokens {args.max_tokens} is less than one window of {seq_len} tokens (--seq-len); "
                        f"give at least {seq_len}")
    return seq_len


def _looped(model) -> str:
    """", looped: 1 + 2 x 6 + 1" (prelude + core x count + coda, in blocks) for a looped model, else ""."""
    mc = model.cfg
    if not mc.loop_core:
        return ""
    trained = "" if model.loops == mc.loop_repeats else f", trained at {mc.loop_repeats}"
    return (f", looped: {mc.loop_prelude} + {mc.loop_core} x {model.loops} + "
            f"{mc.n_layers - mc.loop_prelude - mc.loop_core}{trained}")


def register(subparsers) -> None:
    """Add ``eval`` to the ``keel`` sub-parsers."""
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
                   help="validation tokens to score (default: the run's train.eval_tokens; not with --text, "
                        "which scores the whole file)")
    p.add_argument("--batch-size", type=int, default=8,
                   help="windows (perplexity) or requests (tasks) per forward pass")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--verbose", action="store_true", help="show lm-evaluation-harness' own progress bars and logs")
    p.add_argument("--device", default=key_default("train.device"), help=key_help("train.device"))
    add_loops_flag(p, "model")
    p.set_defaults(handler=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    """``keel eval``: held-out perplexity / bits per byte, then lm-eval tasks; exit 1 if a task could not run."""
    task_names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    check_counts(args, "limit", "batch_size", "max_tokens", "seq_len", "loops")
    if args.text and args.max_tokens is not None:  # it scored every token of the file without a word
        raise KeelError(f"--max-tokens limits the validation split; --text {args.text} is scored whole "
                        "(shorten the file to score fewer tokens)")
    index = check_tasks(task_names, args.task_dir, args.verbose) if task_names else None  # before the model loads
    model, tokenizer, cfg, device, name = _load(args)
    mc = model.cfg
    check_loops(args.loops, mc, name)
    if args.loops is not None:
        model.set_loops(args.loops)
    elif args.hf:  # the count config.json's loops sets, capped as --loops is
        check_folder_loops(model.loops, mc, name)
    seq_len = _window(args, cfg, mc.max_seq_len)
    report = _model_report(model, name)
    human = not args.json  # --json: stdout holds the JSON report only
    if human:
        print(f"model: {name} ({mc.residual}, {plural(mc.n_layers, 'block')}{_looped(model)} = {report['sublayers']} "
              f"sub-layers, d_model {mc.d_model}, {model.num_params() / 1e6:.2f}M parameters)")

    res, why_none = _held_out_perplexity(args, model, tokenizer, cfg, seq_len, device)
    if res is not None:
        report["perplexity"] = {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                                for k, v in res.to_dict().items()}
    if human:
        _print_held_out(res, seq_len, why_none)

    failed = 0
    if task_names:
        results = run_tasks(model, tokenizer, task_names, limit=args.limit, task_dir=args.task_dir,
                            batch_size=args.batch_size, verbose=args.verbose, index=index)  # a failure: logged
        report["tasks"] = results
        failed = _task_lines(results, human)
    if args.json:
        print(json.dumps(report, indent=2))
    return 1 if failed else 0


def _model_report(model, name: str) -> dict:
    """The start of ``keel eval``'s JSON report: the model ``name`` (its scheme, blocks, sub-layers one pass
    applies, width, parameters; a looped model's loop), no perplexity or tasks yet."""
    mc = model.cfg
    applied = len(model.depth_order())  # blocks one pass applies: n_layers, or P + R C + Q of a looped model
    report: dict = {"model": name, "residual": mc.residual, "blocks": mc.n_layers, "applied_blocks": applied,
                    "sublayers": 2 * applied,
                    "d_model": mc.d_model, "parameters": model.num_params(), "perplexity": None, "tasks": {}}
    if mc.loop_core:
        report["loop"] = model.loop_shape()
    return report


def _held_out_perplexity(args, model, tokenizer, cfg, seq_len: int, device):
    """(perplexity result or None, why none): of ``--text FILE`` (as ``keel prepare`` reads it; a note on
    stderr where it is not valid UTF-8), else of the run's held-out data where there is some
    (:func:`_held_out_dataset`)."""
    if args.text:
        path = Path(args.text)
        text, replaced = read_text_file(path)  # as `keel prepare` reads it: invalid UTF-8 -> U+FFFD
        if replaced:
            print(f"note: {path} is not valid UTF-8; its undecodable bytes became U+FFFD", file=sys.stderr)

        return text_perplexity(model, tokenizer, text, seq_len, device, eos_id=tokenizer.token_to_id(EOS_TOKEN),
                               source=str(path), batch_size=args.batch_size), None
    data_dir, why_none = _held_out_dataset(args, cfg)
    if data_dir is None:
        return None, why_none
    max_tokens = args.max_tokens if args.max_tokens is not None else cfg.train.eval_tokens
    return validation_perplexity(model, tokenizer, data_dir, seq_len, max_tokens, device,
                                 batch_size=args.batch_size), why_none


def _print_held_out(res, seq_len: int, why_none: str | None) -> None:
    """Print the held-out perplexity ``res`` (windows of ``seq_len`` tokens), or why there is none."""
    if res is not None:
        tokens, size = f"{res.tokens:,} token{'s' * (res.tokens != 1)}", f"{res.bytes:,} byte{'s' * (res.bytes != 1)}"
        print(f"held-out text: {res.source} ({tokens}, {size}, windows of {seq_len} tokens)")
        print(f"  loss {res.loss:.4f} nats/token, perplexity {res.perplexity:.2f}, bits per byte {res.bits_per_byte:.4f}")
    else:
        print(f"held-out text: none ({why_none}; pass --text FILE)")


def _task_lines(results: dict, human: bool) -> int:
    """Print (``human``) one line per lm-eval task of ``results`` that ran, its metrics; returns the number
    of tasks that could not run (each logged already)."""
    failed = 0
    for task, metrics in results.items():
        if "error" in metrics:
            failed += 1
            continue
        vals = ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        if human:
            print(f"task {task}: {vals}")
    return failed
