"""``keel prepare``, ``keel train`` and ``keel generate``: each command's flags beside its handler
(:mod:`keel.cli.commands`)."""

from __future__ import annotations

import argparse
import functools
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from keel.cli.commands import add_loops_flag, check_loops, check_seed
from keel.config import DEFAULT_PRESET, TrainConfig, key_default, key_help, load_config, parse_override, resolve_config_path
from keel.errors import Interrupted, KeelError, plural
from keel.io import STOP_SIGNALS, check_path_names, die_with_parent, passing_on_stop_signals
from keel.rundir import RunDir


def import_library() -> None:
    """The library the handlers below call, imported into this module (:mod:`keel.cli.commands`)."""
    global check_given_dataset, prepare_dataset, read_meta, train_run, Run, CheckpointManager, checkpoint_step
    global read_metrics, interactive, sample_text, perplexity, check_batch_divides
    # torch and the library (seconds of import), imported when one of these commands runs, not when the
    # parser is built: `keel --help` loads no torch
    from keel.data import check_given_dataset, prepare_dataset, read_meta
    from keel.experiments.training import train_run
    from keel.run import Run
    from keel.train.checkpoint import CheckpointManager, checkpoint_step
    from keel.train.metrics import read_metrics
    from keel.train.progress import interactive
    from keel.train.sampling import sample_text
    from keel.train.trainer import check_batch_divides, perplexity


def register(sub) -> None:
    """Add ``prepare``, ``train`` and ``generate`` to the ``keel`` sub-parsers."""
    _register_prepare(sub)
    _register_train(sub)
    _register_generate(sub)


def _register_prepare(sub) -> None:
    """Add ``keel prepare``."""
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
    pp.set_defaults(handler=cmd_prepare)


def cmd_prepare(args: argparse.Namespace) -> int:
    out = prepare_dataset(args.source, args.tokenizer, args.out, val_fraction=args.val_fraction,
                          max_bytes=args.max_bytes, text_field=args.text_field, cache_dir=args.cache_dir,
                          progress=interactive(), force=args.force)  # no progress bars written into a log file
    meta = read_meta(out)
    print(f"dataset: {out}")
    asked = args.tokenizer.split(":", 1)[1] if args.tokenizer.startswith("bpe:") else ""
    if asked.isdigit() and meta["vocab_size"] < int(asked):
        print(f"  note: asked for {asked} BPE tokens, the corpus supports only {meta['vocab_size']}")
    if meta.get("docs_with_replacement_chars"):
        print(f"  note: {meta['docs_with_replacement_chars']} document(s) were not valid UTF-8; "
              "their undecodable bytes became U+FFFD")
    if meta.get("docs_skipped_binary"):
        print(f"  note: {meta['docs_skipped_binary']} document(s) were skipped as not text (NUL/control bytes)")
    if meta.get("long_docs_chunked"):
        print(f"  note: {meta['long_docs_chunked']} long document(s) were cut into {meta['chunks_of_long_docs']} "
              "chunks for the train/val split")
    if meta.get("docs_with_nul"):
        print(f"  note: {meta['docs_with_nul']} document(s) hold NUL bytes; kept as text (under 10% control "
              "characters), the NULs included")
    if meta["val_tokens"] > meta["train_tokens"]:
        print("  warning: the validation split is larger than the training split (too few documents?)")
    need = TrainConfig().seq_len + 1
    for split in ("val", "train"):
        if meta[f"{split}_tokens"] < need:
            print(f"  warning: the {'validation' if split == 'val' else 'training'} split has only "
                  f"{meta[f'{split}_tokens']:,} tokens; keel train needs at least train.seq_len + 1 of them "
                  f"({need} with the default seq_len); use more text"
                  + (" or a larger --val-fraction" if split == "val" else ""))
    print(f"  vocab {meta['vocab_size']}, train {meta['train_tokens']:,} tokens ({plural(meta['n_docs_train'], 'doc')}), "
          f"val {meta['val_tokens']:,} tokens ({plural(meta['n_docs_val'], 'doc')})")
    return 0


def default_run_dir(cfg) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return Path("runs") / f"{stamp}-{cfg.model.residual}-{cfg.model.n_sublayers}sl"


def launch_torchrun(args: argparse.Namespace, run_dir: Path) -> int:
    """Re-run this ``keel train`` under torchrun with ``args.nproc`` processes on this machine:
    ``python -m torch.distributed.run --standalone --nproc_per_node N -m keel train <args>``
    (the same arguments, without ``--nproc``, and with the run directory made explicit so
    that every rank agrees on it).

    torchrun starts each worker in a session of its own, so a signal to ``keel train`` (or
    to its process group) never reaches them directly. SIGINT, SIGTERM and SIGHUP received here are
    passed to torchrun (started in its own session, so a terminal's Ctrl-C reaches it once,
    from here), which passes them to every worker: each finishes its step, the run is
    checkpointed, and all stop. If ``keel train`` itself dies, torchrun gets SIGTERM
    (:func:`keel.io.die_with_parent` with SIGTERM, which torchrun passes to its workers).
    A stop signal sent to a worker directly stops every rank after one step too (the trainer's
    :func:`keel.train.interrupt.agreed_stop_signal`); torchrun then exits 1 with its ChildFailedError
    traceback (its agent counts any non-zero exit as a failure, with no option to pass a worker's status
    on), which is read, not shown: the same one line and 128 + the signal (:func:`_workers_stop_signal`).
    Returns torchrun's exit status.

    Raises:
        Interrupted: stopped by SIGINT / SIGTERM ... (the message says how to resume).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
           "-m", "keel", "train"]
    if args.restart:
        cmd += ["--restart"]
    if args.resume:
        cmd += ["--resume", str(args.resume)]
    else:
        if args.config:
            cmd += ["--config", str(args.config)]
        cmd += ["--run-dir", str(run_dir)]
    for item in args.set:
        cmd += ["--set", item]
    proc = subprocess.Popen(cmd, start_new_session=True, stderr=subprocess.PIPE, text=True, errors="replace",
                            preexec_fn=functools.partial(die_with_parent, signal.SIGTERM))
    stopping = threading.Event()  # set on a stop signal: torchrun's traceback and the workers' stop lines are ours to say
    report = threading.Thread(target=_pass_on_and_read_failure, args=(proc.stderr, failure := {}, stopping), daemon=True)
    report.start()
    # torchrun passes SIGINT / SIGTERM to its workers but dies of SIGUSR1 / SIGUSR2 (Slurm's pre-timeout signals):
    # send it those as SIGTERM, which every worker checkpoints on
    usr = (signal.SIGUSR1, signal.SIGUSR2)
    with passing_on_stop_signals(lambda s: (stopping.set(), proc.send_signal(signal.SIGTERM if s in usr else s))
                                 ) as received:
        code = proc.wait()
    report.join(timeout=10)  # the rest of the report; a worker that outlived torchrun may hold the pipe open
    if received:
        for message in failure["errors"]:
            print(f"keel: error: {message}", file=sys.stderr)
        name = signal.Signals(received[0]).name
        if not failure["errors"] and (step := trained_to_the_end(run_dir, failure["stopped"])) is not None:
            print(f"keel: {name} arrived after the run's last step ({step}): the run is complete, nothing to resume",
                  file=sys.stderr)
            return 0
        raise Interrupted(nproc_stop_message(name, run_dir, args.nproc), received[0])
    if code and (signum := _workers_stop_signal(failure)):  # a signal sent to a worker, not to us
        raise Interrupted(nproc_stop_message(signal.Signals(signum).name, run_dir, args.nproc, to_a_worker=True), signum)
    sys.stderr.write("".join(failure["stops"]))  # the workers' stop lines, held back by _pass_on_and_read_failure
    return _end_of_failure(code, failure, args.nproc, run_dir) if code else 0


_WORKER_STOP = re.compile(r"keel: stopped by (SIG[A-Z0-9]+)( after step (\d+): )?")  # a worker's stop line


def trained_to_the_end(run_dir: Path, stopped: int) -> int | None:
    """The last step of the run in ``run_dir`` when its workers trained it to the end (``train.steps``,
    checkpointed) and none stopped on a signal (``stopped``: how many stop lines they printed): a stop
    signal that reached them after the last step, which they take as no stop (they finish the run);
    else None."""
    if stopped or not RunDir(run_dir).config.is_file():
        return None
    steps = load_config(RunDir(run_dir).config, stored=True).train.steps
    ckpt = CheckpointManager(run_dir).latest()
    return steps if ckpt is not None and checkpoint_step(ckpt) >= steps else None


def _workers_stop_signal(failure: dict) -> int | None:
    """The stop signal a worker of ``keel train --nproc`` was sent directly (not through ``keel train``): the
    workers stopped as they do on a signal (their stop lines, one at least "after step N": the ranks agreed on
    the step and checkpointed it), none with an error, and torchrun's report names a worker that exited
    128 + the signal of such a line; torchrun's agent reports that as a failure (any non-zero exit is one to
    it). The signal is the one the lines name other than SIGTERM (what the other ranks stop on; a rank the
    agent then sent SIGTERM says so without a step), else SIGTERM. None otherwise."""
    lines = [m.groups() for m in map(_WORKER_STOP.match, failure["stops"]) if m]
    names, steps = {name for name, _, _ in lines}, {step for _, _, step in lines if step is not None}
    if (len(steps) != 1 or failure["errors"] or not names <= {s.name for s in STOP_SIGNALS}
            or failure.get("exitcode", 0) - 128 not in {int(signal.Signals[n]) for n in names}):
        return None
    return int(signal.Signals[min(names - {"SIGTERM"}, default="SIGTERM")])


def _end_of_failure(code: int, failure: dict, nproc: int, run_dir: Path) -> int:
    """Say once why the workers failed, from what :func:`_pass_on_and_read_failure` kept.
    Every worker ended on a user error (``keel: error: ...``, exit status 2: a missing data
    source, a run folder that holds a run): that line, once, and exit status 2 (torchrun's
    report of its ChildFailedError is dropped). Otherwise (killed, out of memory): torchrun's
    report, then one line naming the worker and what the run folder allows next. Returns the
    exit status."""
    errors = failure["errors"]
    for message in errors:
        print(f"keel: error: {message}", file=sys.stderr)
    if errors and failure.get("exitcode") == 2:
        return 2
    sys.stderr.write("".join(failure.get("before", []) + failure["report"]))
    print(f"keel: {_failed_worker(failure)} of this {nproc}-process run failed (torchrun exit status {code}); "
          f"{_what_next(run_dir, nproc)}", file=sys.stderr)
    return code


def _continue_command(run_dir: Path, nproc: int) -> tuple[int | None, str]:
    """``(step of the latest checkpoint or None, the command that goes on with run_dir)`` after a
    ``keel train --nproc`` stopped or failed: a resume (from that checkpoint; with ``--restart``
    when the workers wrote config.toml but no checkpoint), else "the same command"."""
    ckpt = CheckpointManager(run_dir).latest()  # the workers may have died before writing config.toml: no Run()
    if ckpt is not None:
        return checkpoint_step(ckpt), f"keel train --resume {run_dir} --nproc {nproc}"
    if RunDir(run_dir).config.is_file():
        return None, f"keel train --resume {run_dir} --restart --nproc {nproc}"
    return None, "the same command"


def _what_next(run_dir: Path, nproc: int) -> str:
    """How to go on after the workers of ``keel train --nproc`` failed, from what ``run_dir`` holds."""
    step, command = _continue_command(run_dir, nproc)
    if step is not None:
        return f"the last checkpoint (step {step}) is intact: {command}"
    if command.startswith("keel "):
        return f"no checkpoint was written; start it again with: {command}"
    return "nothing was written; run the same command again"


_AGENT_REPORT = re.compile(r"[EW]\d{4} .*\] failed \(exitcode: -?\d+\)")  # torchrun's agent: its workers failed
_AGENT_LOG = re.compile(r"[EW]\d{4} \S+ \d+ \S*torch/distributed/elastic/")  # torchrun's warnings (any install path)
_ERROR = "keel: error: "


def _pass_on_and_read_failure(stream, failure: dict, stopping: threading.Event | None = None) -> None:
    """Copy torchrun's standard error (its workers' too) to ours, line by line, keeping back
    (in ``failure``) the workers' ``keel: error: ...`` lines (key ``errors``: each message
    once, as every rank prints it, maybe interleaved on one line) and torchrun's failure
    report (key ``report``: from its agent's "failed (exitcode: N)" line on; its warnings before
    that line under ``before``), and the first
    rank and exit code the report names as its "Root Cause" (keys ``rank``, ``exitcode``).
    The workers' own stop lines (``keel: stopped by ...``, without ``--nproc``) are counted (key
    ``stopped``) and kept back under ``stops``; once ``stopping`` is set (``keel train`` got a stop signal
    and says how to resume), they and torchrun's traceback of the signal it got (``SignalException``) are
    dropped (:func:`_without_signal_traceback`)."""
    cause, owed = False, 0  # owed: newlines of the error lines interleaved onto one line
    errors, report = failure.setdefault("errors", []), failure.setdefault("report", [])
    stopping = stopping or threading.Event()
    stops = failure.setdefault("stops", [])
    failure.setdefault("stopped", 0)
    for line in _without_signal_traceback(stream, stopping):
        if line.startswith("keel: stopped by "):  # a worker's: held back (a stop of the whole run is one line)
            failure["stopped"] += 1
            if not stopping.is_set():
                stops.append(line)
            continue
        if report or _AGENT_REPORT.match(line):
            report.append(line)
        elif _AGENT_LOG.match(line):  # e.g. "Sending process P closing signal SIGTERM": part of its report
            failure.setdefault("before", []).append(line)
            continue
        elif line.strip() == "" and owed:
            owed -= 1
            continue
        parts = [line] if report else re.split(f"(?={_ERROR})", line)
        owed += max(_keep_errors(parts, errors) - 1, 0)
        if not report:
            sys.stderr.write("".join(p for p in parts if not p.startswith(_ERROR)))
        cause = _read_root_cause(line, cause, failure)
    sys.stderr.flush()


def _keep_errors(parts: list[str], errors: list[str]) -> int:
    """Append to ``errors`` each new message of the ``keel: error: ...`` lines among ``parts`` (a line of
    torchrun's standard error split before each such line); returns how many error lines ``parts`` held."""
    messages = [p[len(_ERROR):].strip() for p in parts if p.startswith(_ERROR)]
    errors += [m for m in dict.fromkeys(messages) if m and m not in errors]
    return len(messages)


def _read_root_cause(line: str, cause: bool, failure: dict) -> bool:
    """Whether torchrun's report has reached its "Root Cause" section (``cause``: it had before ``line``);
    in it, the first ``rank : R`` and ``exitcode : N`` lines go into ``failure`` (as ints)."""
    cause = cause or "Root Cause" in line
    m = re.match(r"\s*(rank|exitcode)\s*:\s*(-?\d+)", line) if cause else None
    if m and m.group(1) not in failure:
        failure[m.group(1)] = int(m.group(2))
    return cause


def _without_signal_traceback(lines, stopping: threading.Event):
    """``lines`` less, once ``stopping`` is set, each Python traceback that ends in torchrun's
    ``SignalException`` (the signal it got and passed on: expected, not a failure). A traceback is
    held back until its last line (the first after it that is neither indented nor blank: a frame
    whose source line is blank prints one) shows what it is."""
    held: list[str] = []
    for line in lines:
        if held and (line[:1] in (" ", "\t") or not line.strip()):
            held.append(line)
            continue
        if held:
            if not (stopping.is_set() and "SignalException" in line):
                yield from held + [line]
            held = []
            continue
        if line.startswith("Traceback (most recent call last):"):
            held = [line]
        else:
            yield line
    yield from held


def _failed_worker(failure: dict) -> str:
    """"worker rank R (killed by SIGKILL)" from torchrun's report as read by
    :func:`_pass_on_and_read_failure`, or "a worker" when it named none."""
    if "rank" not in failure:
        return "a worker"
    code = failure.get("exitcode")
    if code is None:
        return f"worker rank {failure['rank']}"
    how = f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals() else None
    return f"worker rank {failure['rank']} ({how or f'exit status {code}'})"


def nproc_stop_message(name: str, run_dir: Path, nproc: int, to_a_worker: bool = False) -> str:
    """What ``keel train --nproc`` says after a stop signal (``to_a_worker``: one sent to a worker, not to
    ``keel train``), from what the workers left in ``run_dir``: the promised checkpoint of the last step,
    or (workers killed before they wrote it, e.g. by torchrun's 30 s grace) where a resume will really
    continue from."""
    last = max((r["step"] for r in read_metrics(RunDir(run_dir).metrics) if "step" in r), default=0)
    done, command = _continue_command(run_dir, nproc)
    if done is not None and done >= last:
        how = "sent to a worker: every worker" if to_a_worker else "passed to every worker: each"
        return (f"stopped by {name} ({how} finished its step, the run is checkpointed at step {done}); "
                f"resume with: {command}")
    if done is None:
        return (f"stopped by {name}, but the workers ended before writing a checkpoint (last step logged: {last}); "
                f"start the run again with: {command}")
    return f"stopped by {name}, but the workers ended before checkpointing step {last}; {command} continues from step {done}"


def _register_train(sub) -> None:
    """Add ``keel train``."""
    pt = sub.add_parser("train", help="train a language model",
                        description="Train a language model from a config (a preset or a TOML file, with --set "
                                    "overrides) into a run directory: metrics, checkpoints, plots and a sample. "
                                    "Continue an interrupted run with --resume DIR.")
    pt.add_argument("--config", default=None,
                    help=f"TOML file or preset name (see `keel config`; default: {DEFAULT_PRESET}); a file's keys "
                         "start from keel's declared defaults (listed by `keel config`), not from a preset")
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
    pt.set_defaults(handler=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    _check_train_flags(args)
    cfg, run_dir = _train_config(args)
    if cfg.data.path:  # a --set data.tokenizer (say) would be replaced by the dataset's own without a word
        check_given_dataset(cfg.to_dict()["data"], read_meta(cfg.data.path), [parse_override(x)[0] for x in args.set])
    if args.nproc is not None:
        check_batch_divides(cfg.train.batch_size, args.nproc)  # here, not after torchrun's banner in each worker
        return launch_torchrun(args, run_dir)
    res = train_run(cfg, run_dir, resume=bool(args.resume), restart=args.restart)

    if int(os.environ.get("RANK", "0")) == 0:  # only rank 0 reports
        print_result(res)
    return 0


def _check_train_flags(args: argparse.Namespace) -> None:
    """The flags of ``keel train`` that rule each other out (--nproc inside torchrun, --restart without a
    run, --resume with --run-dir) and its path names.

    Raises:
        KeelError: a flag combination keel refuses, or a path name the OS cannot hold.
    """
    if args.nproc is not None:
        if args.nproc < 1:
            raise KeelError(f"--nproc must be >= 1, got {args.nproc}")
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            raise KeelError("--nproc starts torchrun itself; do not use it inside torchrun")
    if args.restart and not (args.resume or args.run_dir):  # it started a new run in a fresh folder
        raise KeelError("--restart goes with --resume DIR or --run-dir DIR: the run to start again from step 0")
    if args.resume and args.run_dir:
        raise KeelError(f"--run-dir does not go with --resume: a resumed run stays in its folder ({args.resume})")
    for flag, given in (("--resume", args.resume), ("--run-dir", args.run_dir)):
        if given:
            check_path_names(given, flag)  # "File name too long" was a traceback


def _train_config(args: argparse.Namespace) -> tuple[TrainConfig, Path]:
    """The config ``keel train`` trains and its run folder: a resumed run's own config.toml (with --set),
    the run's own again for ``--restart`` without --config, else --config (a preset or file) and --run-dir
    (default: :func:`default_run_dir`).

    Raises:
        KeelError: --resume of a folder that is not a run, --resume with --config, or a bad config.
    """
    if args.resume:
        run_dir = Path(args.resume)
        if not RunDir(run_dir).config.is_file():
            raise KeelError(f"cannot resume {run_dir}: no {RunDir.CONFIG} there (not a run directory)")
        if args.config:
            raise KeelError("--resume takes the run's own config.toml; use --set to change keys")
        return load_config(RunDir(run_dir).config, args.set, stored=True), run_dir  # keel wrote it: no rename notes
    if args.restart and not args.config and RunDir(args.run_dir).config.is_file():
        run_dir = Path(args.run_dir)  # the run there, again from step 0: its own config (it trained the demo)
        return load_config(RunDir(run_dir).config, args.set, stored=True), run_dir
    cfg = load_config(resolve_config_path(args.config), args.set)
    return cfg, Path(args.run_dir) if args.run_dir else default_run_dir(cfg)


def print_result(res) -> None:
    """The summary of a :class:`keel.train.TrainResult` on stdout."""
    print(f"run: {res.run_dir}")
    if res.steps_run == 0 and res.resumed_from is not None:  # the trainer's log said so, once
        return
    if res.resumed_from is not None:
        print(f"resumed at step {res.resumed_from}, trained {res.steps_run} more step(s)")
    if res.first_val_loss is not None:
        print(f"validation loss at step 0: {res.first_val_loss:.4f} (perplexity {perplexity(res.first_val_loss):.1f})")
    print(f"validation loss at step {res.step}: {res.val_loss:.4f} (perplexity {perplexity(res.val_loss):.2f})")
    print(f"tokens: {res.tokens:,}, mean {res.tokens_per_s:,.0f} tokens/s")
    if res.sample:  # train.sample_tokens = 0: none was drawn
        print("sample:")
        print(res.sample)


def _register_generate(sub) -> None:
    """Add ``keel generate``."""
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
    pg.set_defaults(handler=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 0:
        raise KeelError(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise KeelError(f"--temperature must be a finite number >= 0 (0 = greedy), got {args.temperature}")
    if args.top_k < 0:
        raise KeelError(f"--top-k must be >= 0, got {args.top_k}")
    if args.num_samples < 1:
        raise KeelError(f"--num-samples must be >= 1, got {args.num_samples}")
    check_seed(args.seed)
    check_seed(args.seed + args.num_samples - 1, "--seed + --num-samples - 1 (the last sample's seed)")
    run = Run(args.run)
    check_loops(args.loops, run.config.model, str(args.run))  # before the weights load

    # a prompt that is not valid UTF-8 reaches Python with lone surrogates (os.fsdecode):
    # its undecodable bytes become U+FFFD, as keel prepare reads such text
    prompt = os.fsencode(args.prompt).decode("utf-8", errors="replace")
    model, tokenizer = run.load_model(device=args.device), run.tokenizer()
    if args.loops is not None:
        model.set_loops(args.loops)  # the KV cache keeps a slot per applied block at any count
    device = next(model.parameters()).device

    def show(piece: str) -> None:  # the text as it is generated: a long sample is not minutes of silence
        sys.stdout.write(piece)
        sys.stdout.flush()

    for i in range(args.num_samples):
        sample_text(model, tokenizer, prompt, args.max_new_tokens, device,
                    temperature=args.temperature, top_k=args.top_k or None, seed=args.seed + i, stream=show)
        print()
        if i + 1 < args.num_samples:
            print("-" * 40)
    return 0
