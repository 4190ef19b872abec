"""The training loop behind ``keel train``.

One run directory holds everything about a run (:class:`keel.run.Run` reads it back); its
layout (config, metrics, checkpoints, tokenizer, loss plot, sample, ...) is
:class:`keel.rundir.RunDir`'s.

``step`` in metrics counts optimiser steps done (1-based); step 0 is the evaluation of the
freshly initialised model.

Resuming (``resume=True``) never loses a run's history: it continues from the newest
*intact* checkpoint (:meth:`keel.train.checkpoint.CheckpointManager.find_intact`; a newer damaged
one is skipped with a warning naming the problem), and refuses with a one-line
:class:`KeelError` when the run has history (metrics past step 0, or checkpoint folders)
but no intact checkpoint, unless ``restart=True`` (which starts the run again from step 0,
deleting its metrics and checkpoints). Temporaries left by a crash are removed at start.

Config changes on resume (the run's ``config.toml`` plus ``--set``) are compared with the
config saved in the checkpoint, key by key (:mod:`keel.train.resume`): keys that would make
the continuation a different run (every ``model.*`` key, the data keys, ``train.seed``,
``train.batch_size``, ``train.seq_len``, ``train.grad_accum``) are refused with a
one-line error; every other key is applied from the resumed step on, with a warning and a
``{"step": k, "config_change": {"section.key": {"old": .., "new": ..}}}`` record in
``metrics.jsonl``; a change of the LR at the resumed step is called out. ``config.toml``
always holds the config in effect. A ``train.steps`` below the resumed step is refused; a resume
with nothing left to train applies no change and writes nothing (one line says so).

Several processes (``torchrun --nproc_per_node N -m keel train ...`` or
``keel train --nproc N``): ``train.parallelism`` picks DDP or FSDP2 (applied by
:mod:`keel.train.parallelize`). ``train.batch_size`` is the GLOBAL number of sequences per
micro-batch, split evenly over the ranks (it must be divisible by the world size), so one
optimiser step always sees ``batch_size * seq_len * grad_accum`` tokens (``tokens`` in the
metrics counts them over all ranks) and the same windows whatever the world size. Only
rank 0 writes files and logs; every rank evaluates its share of the validation windows and
writes its own shards of the weights and optimizer state into a sharded checkpoint
(``torch.distributed.checkpoint``, :class:`keel.train.checkpoint.CheckpointManager`). Resuming from the
checkpoint at step k reproduces the uninterrupted run's losses exactly on CPU: weights,
AdamW state, data position, RNG state and an fp16 run's loss scaler are all restored (the LR is
a pure function of the step, :func:`keel.train.optim.set_lr`: nothing of it is saved).

``train.precision = "fp16-autocast"``: loss scaling, overflowed steps (skipped, counted) and the
scaler in checkpoints are :mod:`keel.train.loss_scaling`'s; a resume into fp16 starts a fresh scale.

The loop knows nothing of diagnostics, evaluation tasks or experiment tracking: those come
in as :class:`keel.train.callbacks.Callback` objects.
"""

from __future__ import annotations

import contextlib
import logging
import math
import shutil
import signal
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import torch

from keel.config import Config, checked_copy, dump_config, resolve_vocab_size
from keel.data import (TokenLoader, absolute_data_paths, load_tokenizer, prepared_from, read_meta, resolve_data,
                       validation_tokens)
from keel.errors import KeelError, plural
from keel.io import RunLock, atomic_path, atomic_write_text, check_run_folder, disk_errors, write_failure
from keel.model import Transformer, check_model_config, flops_per_token, get_scheme, ignored_keys, loop_count
from keel.model.model import LARGEST_LOOP_DRAWS
from keel.rundir import RunDir
from keel.train import dist as D, state_dict as SD
from keel.train.callbacks import Callback, StepState, unhonoured_keys
from keel.train.checkpoint import CheckpointManager, NonFiniteWeights, checkpoint_step, is_sharded, step_name, tied_aliases
from keel.train.device import (autocast_context, peak_flops, check_activations_fit, check_model_fits, flushing_denormals,
                               memory_errors, resolve_device)
from keel.train.nll import eval_batch_size, mean_nll, perplexity
from keel.train.interrupt import StopSignals, TrainingInterrupted, agreed_stop_signal
from keel.train.loggers import open_sinks
from keel.train.loss_scaling import LossScaling
from keel.train.metrics import mean_tokens_per_s, truncate_metrics, untimed_tokens
from keel.train.optim import apply_config, build_optimizer, set_lr
from keel.train.parallelize import checkpointed_blocks, gradient_sync, parallelize
from keel.train.plots import plot_loss
from keel.train.progress import ProgressReporter, interactive
from keel.train.resume import check_config_changes, check_refused_before_data, checkpoint_to_resume
from keel.train.sampling import sample_text

log = logging.getLogger(__name__)


class TrainingStopped(KeelError):
    """Raised when a run stops early: too many non-finite steps in a row
    (``train.max_bad_steps``) or a callback asked to stop (e.g. a divergence verdict)."""


@dataclass
class TrainResult:
    """What ``keel train`` reports at the end (losses in nats per token)."""

    run_dir: Path
    step: int
    tokens: int
    first_val_loss: float | None
    val_loss: float
    val_ppl: float
    tokens_per_s: float
    sample: str
    resumed_from: int | None = None  # the step a resumed run continued from (None: a fresh run)
    steps_run: int = 0  # optimiser steps done by this call (0: nothing to do)



def skipped_step_words(step: int, record: dict, bad_in_row: int) -> str:
    """The warning of a step whose update was skipped: which of its loss, gradient norm and LR (``record``'s
    ``loss``, ``grad_norm``, ``lr``) is not finite, the others beside it (the warning named all three, so that
    a finite loss read as the cause), and how many such steps ran in a row."""
    names = {"loss": "loss", "grad_norm": "grad norm", "lr": "LR"}
    bad = [k for k in names if not (isinstance(record.get(k), (int, float)) and math.isfinite(record[k]))]
    good = [f"{names[k]} {record[k]:.6g}" for k in names if k not in bad]
    return (f"step {step}: non-finite {', '.join(f'{names[k]} {record.get(k)}' for k in bad) or 'value'}"
            + (f" ({', '.join(good)})" if good else "") + f"; update skipped ({bad_in_row} in a row)")


def check_checkpoint_min_loops(cfg: Config) -> None:
    """``train.activation_checkpoint_min_loops`` > 0 needs what it selects on: a looped model
    (``model.loop_core`` > 0), a checkpointing mode to switch (not ``none``), and no ``train.compile``
    (the compiled block would be traced for each of the two forwards).

    Raises:
        KeelError: one line naming the key and what is missing.
    """
    tc, n = cfg.train, cfg.train.activation_checkpoint_min_loops
    if n == 0:
        return
    what = "train.activation_checkpoint_min_loops"
    if not cfg.model.loop_core:
        raise KeelError(f"{what} = {n} needs a looped model (model.loop_core > 0), whose steps it "
                        "selects by their drawn core count; set it to 0")
    if tc.activation_checkpointing == "none":
        raise KeelError(f"{what} = {n} has nothing to switch with train.activation_checkpointing = none; "
                        "set that to block or every_k")
    if tc.compile:
        raise KeelError(f"{what} = {n} is not supported with train.compile (each block would compile both "
                        "forwards); set it to 0 or train.compile = false")


def checkpoint_min_loops_words(cfg: Config) -> str:
    """The run header's words on ``train.activation_checkpoint_min_loops`` = n > 0 (else ''): which steps
    checkpoint, and how many of this run's do (the counts are a pure function of seed and step, known before it
    starts; :func:`keel.model.loop_count`), e.g. `` on steps that draw >= 6 core applications (none of its 30
    steps: they draw at most 5)``."""
    tc, m = cfg.train, cfg.model
    if not (tc.activation_checkpoint_min_loops and m.loop_core):
        return ""
    n = tc.activation_checkpoint_min_loops
    counts = [loop_count(m, tc.seed, step) or m.loop_repeats for step in range(min(tc.steps, LARGEST_LOOP_DRAWS))]
    hit = sum(c >= n for c in counts)
    return (f" on steps that draw >= {n} core applications ("
            + (f"{hit:,} of its {plural(len(counts), 'step')}" if hit else
               f"none of its {plural(len(counts), 'step')}: they draw at most {max(counts)}") + ")")


def check_batch_divides(batch_size: int, world_size: int) -> None:
    """Raise KeelError where ``train.batch_size`` (sequences per micro-batch, global) does not split evenly
    over ``world_size`` ranks."""
    if batch_size % world_size:
        raise KeelError(f"train.batch_size ({batch_size}, the global number of sequences per "
                        f"micro-batch) is not divisible by the world size ({world_size})")


def check_train_config(cfg: Config, here: bool = True, world_size: int = 1) -> None:
    """Validate the keys the trainer needs before any work is done.

    Args:
        here: the run trains on this machine: also check its device and that the model and a step's
            activations fit its memory (False: a Slurm job's node, which is another machine).
        world_size: the ranks the run will have (e.g. a grid job's, :meth:`keel.experiments.executor.Executor.world_size`):
            ``train.batch_size`` must divide over them.
    Raises:
        KeelError: naming the first bad key.
    """
    check_model_config(cfg.model)
    # built in full, in fp32, on every rank's CPU before any sharding; "auto" vocab: its floor
    floor = cfg.model if cfg.model.vocab_size != "auto" else replace(cfg.model, vocab_size=1)
    if here:
        check_model_fits(floor, 4, "their fp32 weights")
    tc = cfg.train
    tc.validate()
    check_batch_divides(tc.batch_size, world_size)
    cfg.data.validate()
    if tc.seq_len > cfg.model.max_seq_len:
        raise KeelError(f"train.seq_len ({tc.seq_len}) exceeds model.max_seq_len ({cfg.model.max_seq_len})")
    checkpointed_blocks(cfg.model.n_layers, tc.activation_checkpointing, tc.activation_checkpoint_k)
    check_checkpoint_min_loops(cfg)
    # activations live on the CPU too (a GPU says so itself); the global batch: the ranks of a CPU run share one host
    if here and resolve_device(tc.device).type == "cpu":
        check_activations_fit(floor, tc)


def train(cfg: Config, run_dir: str | Path, resume: bool = False, callbacks: Sequence[Callback] = (),
          restart: bool = False) -> TrainResult:
    """Train ``cfg`` into ``run_dir`` (or continue it with ``resume=True``) with the given
    callbacks only: the low-level loop, for callers who pass their own hooks.

    ``keel.train_run`` (:func:`keel.experiments.training.train_run`, what ``keel train``
    calls) is the public entry point: it attaches the callbacks the config asks for. Keys
    only a callback implements (:data:`keel.train.callbacks.CALLBACK_KEYS`:
    ``train.stop_on_divergence``, ``divergence_reference``, ``gradflow_every``,
    ``eval_tasks``) are refused here when no callback implements them, never ignored;
    ``train.divergence_warnings`` (on by default; logging only) has no effect without the
    divergence callback.

    Launched by torchrun (``RANK``/``WORLD_SIZE`` set), every process calls this; rank 0's
    ``run_dir`` is used by all. See the module docstring for the global batch.

    Args:
        callbacks: hooks called at every step (:class:`keel.train.callbacks.Callback`).
        restart: start the run in ``run_dir`` again from step 0, deleting its metrics and
            checkpoints (what ``--restart`` asks for); otherwise a run with history is
            never started again.
    Raises:
        KeelError: bad config, data problems, a run directory that already holds a run
            (without ``resume``), a run directory that is not new, empty or a keel run (another
            tool's files; only a job scheduler's ``slurm-*.out`` / ``.err`` logs may be there:
            :func:`keel.io.check_run_folder`), a resume of a run with history but no intact checkpoint
            (without ``restart``), a refused config change on resume, a key of
            :data:`keel.train.callbacks.CALLBACK_KEYS` no callback implements, ``train.batch_size``
            not divisible by the world size, or ``TrainingStopped`` (the last good
            checkpoint is left intact).
    """
    cfg = checked_copy(cfg)  # a Config built or edited in Python is checked as the CLI checks it
    check_train_config(cfg)
    missing = unhonoured_keys(cfg, callbacks)
    if missing:
        raise KeelError(f"keel.train.train cannot honour {', '.join(missing)} without the callback that implements it: "
                        "train with keel.train_run (what `keel train` does), or pass "
                        "callbacks=keel.experiments.training.run_callbacks(cfg)")
    info = D.init_distributed(resolve_device(cfg.train.device))
    finished = False
    signals = StopSignals(announce=info.is_main)  # installed by fit; after the last step they outlive it (close)
    try:
        run_dir = Path(D.broadcast_object(str(run_dir), info))
        D.check_same_config(cfg.to_dict(), info)  # before the run folder is touched or the model is built
        with run_lock(run_dir, info), flushing_denormals(cfg.train.flush_denormal), memory_errors(cfg.train):
            result = Trainer(cfg, run_dir, resume, list(callbacks), info, restart=restart).fit(signals)
        finished = True
        return result
    finally:
        try:
            D.destroy_distributed(info, finished)  # a barrier: a finished rank may wait here for the others
        finally:
            signals.close()


@contextlib.contextmanager
def run_lock(run_dir: Path, info: D.DistInfo):
    """Rank 0 holds the run directory's lock (:class:`keel.io.RunLock`) for the whole run, so
    a second ``keel train`` (or ``--resume``) on the same folder stops at once; every rank
    learns whether it got it.

    Raises:
        KeelError: another process holds the lock (naming its pid), the folder cannot be made, or it
            is neither new, empty nor a keel run (:func:`keel.io.check_run_folder`).
    """
    lock = RunLock(run_dir)
    # a folder of another tool's files is refused before the lock file goes into it (keel.io.check_run_folder)
    D.decide_on_rank0(lambda: check_run_folder(run_dir) or lock.acquire() and None, info)  # the lock stays on rank 0
    try:
        yield
    finally:
        lock.release()


class Trainer:
    """One training run: :meth:`__init__` builds or restores everything, :meth:`fit` loops."""

    def __init__(self, cfg: Config, run_dir: str | Path, resume: bool, callbacks: list[Callback], info: D.DistInfo,
                 restart: bool = False):
        cfg = checked_copy(cfg)  # checked as the CLI checks; the run resolves keys: never the caller's object
        cfg.data = replace(cfg.data, **absolute_data_paths(vars(cfg.data)))  # stored: found from any folder
        self.cfg, self.tc, self.info, self.callbacks = cfg, cfg.train, info, callbacks
        self.main = info.is_main
        self.ws = info.world_size if info.distributed else 1
        check_batch_divides(self.tc.batch_size, self.ws)
        self.local_bs = self.tc.batch_size // self.ws
        self.run_dir = Path(run_dir)
        self.rd = RunDir(self.run_dir)  # the run folder's files
        self.metrics_path = self.rd.metrics
        self.checkpoints = CheckpointManager(self.run_dir, info, keep=self.tc.keep_checkpoints)  # RUN/checkpoints
        self.ckpt = self._open_run_folder(resume, restart)
        self.device = info.device
        self.amp = autocast_context(self.device, self.tc.precision,
                                    sharded=info.distributed and self.tc.parallelism == "fsdp")
        saved = self.checkpoints.load_trainer_state(self.ckpt) if self.ckpt is not None else None
        self.changes: dict[str, dict] = {}  # applied from the resumed step, recorded in metrics.jsonl
        self.not_applied: dict[str, dict] = {}  # those of a resume with nothing left to train: said, never written
        self.nothing_left = saved is not None and saved["step"] >= self.tc.steps
        if saved is not None:  # a refused change costs no dataset preparation
            D.decide_on_rank0(lambda: check_refused_before_data(saved, self.cfg, self.run_dir), self.info)
        self._load_data(resuming=saved is not None)
        if saved is not None:
            self._check_config_changes(saved)  # before the weights are loaded: a clear refusal
        self._build_model()
        self.scaling = LossScaling(self.device, self.tc.precision, sharded=self.fsdp)  # fp16 only; else a no-op
        self.state = SD.TrainState(self.loader, self.cfg.to_dict(), scaling=self.scaling)
        if saved is not None:
            self._restore(saved)
        elif resume and not restart and self.main:
            log.info("no checkpoint in %s yet (no step was saved): starting it from step 0", self.run_dir)
        self.resumed_from = self.state.step if self.ckpt is not None else None
        self.sink = None  # the train.loggers sinks (keel.train.loggers), opened by the first write
        self.history = self._prepare_run_dir()
        self.untimed_tokens = untimed_tokens(self.history, self.state.tokens, self.state.elapsed)  # import-hf's
        self.tokens_per_step = self.tc.batch_size * self.tc.seq_len * self.tc.grad_accum  # global
        peak = peak_flops(self.device, self.tc.peak_tflops)  # one process's; None: MFU is not logged
        self.mfu_peak = peak * self.ws if peak else None  # FLOP/s of every process; None: MFU is not logged
        self.flops_at: dict[int | None, float] = {}  # loop count drawn (None: R) -> model FLOPs per token

    def _open_run_folder(self, resume: bool, restart: bool) -> Path | None:
        """Check and tidy the run folder before anything is built: refuse a new run in a folder that holds
        one and a run that would meet a checkpoint folder it cannot write; remove stale temporaries (and, for
        a restart, the old history). Returns the checkpoint to resume from (None: from step 0).

        Raises:
            KeelError: the folder holds a run and neither ``resume`` nor ``restart`` is set; a checkpoint
                folder from the start step on holds files keel did not write; a resume finds history but no
                intact checkpoint.
        """
        if not (resume or restart) and self.metrics_path.exists():
            raise KeelError(f"run directory {self.run_dir} already holds a run; continue it (keel train --resume "
                            f"{self.run_dir}; in Python resume=True), start it again (--restart; restart=True), or "
                            "give another run directory")
        if restart:  # before its checkpoints are deleted: a checkpoint folder it could not write again
            self._check_checkpoint_folders(0)
        self._clean_run_dir(restart)
        ckpt = self._find_checkpoint() if resume and not restart else None
        if not restart:
            self._check_checkpoint_folders(checkpoint_step(ckpt) if ckpt is not None else 0)
        return ckpt

    def _clean_run_dir(self, restart: bool) -> None:
        """Rank 0 removes stale temporaries (and, for a restart, the old history)."""
        if self.main:
            for path in self.checkpoints.clean_temporaries():
                log.info("removed %s (left by an interrupted write)", path)
            if restart and (self.metrics_path.exists() or self.rd.checkpoints.exists()):
                log.warning("restarting %s from step 0: deleting its metrics and checkpoints", self.run_dir)
                self.metrics_path.unlink(missing_ok=True)
                self.checkpoints.remove_all()  # keel's files only: anything else stays, with a warning
        D.barrier(self.info)

    def _check_checkpoint_folders(self, start: int) -> None:
        """Refuse, before any training, a run from step ``start`` that would meet a checkpoint folder
        holding files keel did not write (:meth:`CheckpointManager.check_writable`; rank 0 decides)."""
        D.decide_on_rank0(lambda: self.checkpoints.check_writable(start, self.tc.steps), self.info)

    def _find_checkpoint(self) -> Path | None:
        """The newest intact checkpoint to resume from (rank 0 decides,
        :func:`keel.train.resume.checkpoint_to_resume`; all ranks agree).

        Raises:
            KeelError: the run has history but no intact checkpoint.
        """
        found = D.decide_on_rank0(lambda: checkpoint_to_resume(self.checkpoints), self.info)
        return Path(found) if found is not None else None

    def _load_data(self, resuming: bool = False) -> None:
        """Rank 0 prepares (or finds) the dataset; the others wait for its answer. Resolves
        ``model.vocab_size`` in the run's own copy of the config (never the caller's).

        Raises:
            KeelError: ``resuming`` on a dataset whose tokenizer has more ids than the run's embedding rows
                (another tokenizer: the run cannot read it; "auto" cannot help, the weights have their shape)."""
        self.data_dir = Path(D.decide_on_rank0(
            lambda: str(resolve_data(self.cfg, progress=self.tc.progress and interactive())), self.info))
        self.meta = read_meta(self.data_dir)
        if self.cfg.data.path:  # the dataset is given: its config records how it was made, not unread defaults
            self.cfg.data = replace(self.cfg.data, **absolute_data_paths(prepared_from(self.meta)))
        if resuming and self.cfg.model.vocab_size != "auto" and int(self.cfg.model.vocab_size) < self.meta["vocab_size"]:
            raise KeelError(f"cannot resume {self.run_dir} on {self.data_dir}: its tokenizer has {self.meta['vocab_size']} "
                            f"ids, more than the run's {self.cfg.model.vocab_size} embedding rows (model.vocab_size); "
                            "resume on the data the run was trained with, or start a new run")
        vocab = resolve_vocab_size(self.cfg.model.vocab_size, self.meta["vocab_size"], self.cfg.model.vocab_multiple)
        if self.cfg.model.vocab_size == "auto" and self.main:
            log.info("model.vocab_size = \"auto\": %d (tokenizer: %d ids, rounded up to a multiple of %d)",
                     vocab, self.meta["vocab_size"], self.cfg.model.vocab_multiple)
        self.cfg.model.vocab_size = vocab
        self.tokenizer = load_tokenizer(self.data_dir)
        self.loader = TokenLoader(self.data_dir, "train", batch_size=self.local_bs, seq_len=self.tc.seq_len,
                                  seed=self.tc.seed, rank=self.info.rank, world_size=self.ws)
        self.val_windows = validation_tokens(self.data_dir, self.tc.seq_len, self.tc.eval_tokens)
        self.eval_bs = eval_batch_size(self.local_bs, self.tc.seq_len, self.tc.eval_batch_tokens)  # windows per pass

    def _checkpoint_now(self) -> bool:
        """Whether a checkpointed block recomputes in this step's backward (``parallelize``'s
        ``checkpoint_when``): set per step from its drawn core count and
        ``train.activation_checkpoint_min_loops``; True before the first step (no-grad forwards never read it)."""
        return self.checkpointing

    def _build_model(self) -> None:
        self.checkpointing = True  # train_step sets it per step
        torch.manual_seed(self.tc.seed)
        self.model = Transformer(self.cfg.model)
        self.aliases = tied_aliases(self.model)
        self.sharded_ckpt = self.ckpt is not None and is_sharded(self.ckpt)
        if self.ckpt is not None and not self.sharded_ckpt:
            self.checkpoints.load_weights(self.model, self.ckpt)  # full weights, before any sharding
        self.model.to(self.device)
        self.train_module = parallelize(self.model, self.tc, self.info, self._checkpoint_now)  # DDP, or the model
        self.fsdp = self.info.distributed and self.tc.parallelism == "fsdp"
        self.optimizer = build_optimizer(self.model, self.tc)  # a sharded checkpoint's weights: _restore

    def _restore(self, state: dict) -> None:
        if ("optimizer" not in state and not self.sharded_ckpt) or "loader" not in state:
            raise KeelError(f"cannot resume from {self.ckpt}: it holds weights only (no optimiser or data state; "
                            "made by keel import-hf?); start a new run from it instead")
        # the optimiser (sharded: with the weights, resharded to this world size), data position, RNG, counters
        self.checkpoints.restore(self.ckpt, self.model, self.optimizer, self.state, state)
        apply_config(self.optimizer, self.tc)  # an older checkpoint's "scheduler" entry is not needed: set_lr
        if self.scaling.enabled and "grad_scaler" not in state and self.main:  # trained in fp32/bf16 until now
            log.info("resume: %s has no loss-scaler state: fp16 loss scale %g", self.ckpt.name, self.scaling.scale_value)
        if self.main:
            log.info("resuming %s from step %d (%s)", self.run_dir, self.state.step, self.ckpt.name)

    def _check_config_changes(self, state: dict) -> None:
        """The resume policy (:func:`keel.train.resume.check_config_changes`): refuse or apply
        (rank 0 decides and logs; every rank raises a refusal); with nothing left to train, the
        changes are kept aside as not applied (:meth:`_nothing_to_do` says so, nothing records them)."""
        changes = D.decide_on_rank0(lambda: check_config_changes(state, self.cfg, self.run_dir), self.info)
        self.changes, self.not_applied = ({}, changes) if self.nothing_left else (changes, {})

    def _prepare_run_dir(self) -> list[dict]:
        """Write config and tokenizer; cut metrics.jsonl back to the restored step and record
        config changes. Returns the records kept (the run's history up to ``self.state.step``)."""
        history = []
        if self.main:
            with disk_errors(self.run_dir):
                self.run_dir.mkdir(parents=True, exist_ok=True)
                if not (self.nothing_left and self.rd.config.is_file()):  # a no-op resume: as it was
                    dump_config(self.cfg, self.rd.config)
                    with atomic_path(self.rd.tokenizer) as tmp:  # a full disk: this path, not the source
                        shutil.copyfile(self.data_dir / "tokenizer.json", tmp)
                history = truncate_metrics(self.metrics_path, self.state.step if self.ckpt is not None else -1)
                if self.ckpt is not None:  # the history past it is gone: so are its checkpoints
                    self.checkpoints.remove_after(self.state.step)
            self.history = history  # what the sinks may replay (keel.train.loggers)
            if self.changes:
                record = {"step": self.state.step, "config_change": self.changes}
                if not history or history[-1] != record:
                    self.write(record)
                    history.append(record)
        return D.broadcast_object(history, self.info)

    def _describe(self) -> None:
        """Log what is about to be trained (rank 0)."""
        cfg, tc = self.cfg, self.tc
        if not self.main:
            return
        if tc.warmup_steps > tc.steps:
            log.warning("warning: train.warmup_steps (%d) > train.steps (%d): the LR never reaches train.lr",
                        tc.warmup_steps, tc.steps)
        if tc.eval_tokens < tc.seq_len:  # validation_tokens takes one whole window: more than asked for
            log.warning("warning: train.eval_tokens (%d) < train.seq_len (%d): each evaluation reads one window "
                        "of %d tokens", tc.eval_tokens, tc.seq_len, tc.seq_len)
        notes = get_scheme(cfg.model.residual).config_notes(cfg.model)  # e.g. a mix_ln that is pre_ln
        for line in ignored_keys(cfg.model) + notes:  # e.g. model.alpha set for a pre_ln run
            log.warning(line)
        log.info("run directory: %s", self.run_dir)
        m = cfg.model
        looped = f", looped: {m.loop_prelude} + {m.loop_core} x {m.loop_repeats} + " \
                 f"{m.n_layers - m.loop_prelude - m.loop_core}" if m.loop_core else ""  # as keel eval spells it
        log.info(f"model: {m.residual}, {plural(m.n_layers, 'block')}{looped} = {m.n_sublayers} sub-layers, "
                 f"d_model {cfg.model.d_model}, {self.model.num_params() / 1e6:.2f}M parameters; "
                 f"data: {self.data_dir} ({self.meta['train_tokens']:,} train tokens)")
        log.info(f"global batch: {tc.batch_size} sequences x {tc.seq_len} tokens x grad_accum {tc.grad_accum} = "
                 f"{self.tokens_per_step:,} tokens per optimizer step; world size {self.ws}"
                 + (f" ({tc.parallelism}, {self.local_bs} sequences per rank per micro-batch)"
                    if self.info.distributed else "")
                 + (f"; activation checkpointing: {tc.activation_checkpointing}{checkpoint_min_loops_words(cfg)}"
                    if tc.activation_checkpointing != "none" else "")
                 + ("; torch.compile" if tc.compile else ""))
        passes = -(-len(self.val_windows) // (self.eval_bs * self.ws))
        if passes > 100:  # a validation that looks hung otherwise (tiny windows, a huge train.eval_tokens)
            log.info(f"validation: {len(self.val_windows):,} windows (train.eval_tokens = {tc.eval_tokens:,}, "
                     f"train.seq_len = {tc.seq_len}), {self.eval_bs:,} per forward pass on each process "
                     f"(train.eval_batch_tokens = {tc.eval_batch_tokens:,}): {passes:,} forward passes per evaluation")

    # ------------------------------------------------------------------ pieces of a step
    def validate(self) -> float:
        """Mean validation loss (nats/token) on the fixed validation windows (all ranks)."""
        return mean_nll(self.model, self.val_windows, self.eval_bs, self.device, self.amp, self.info)

    def write(self, record: dict) -> None:
        """Send ``record`` to every sink of ``train.loggers`` (metrics.jsonl, TensorBoard, W&B; rank 0)."""
        if self.main:
            try:
                if self.sink is None:
                    self.sink = open_sinks(self.cfg, self.run_dir, self.resumed_from, self.history)
                self.sink.write(record)
            except Exception as e:  # noqa: BLE001 -- only a full disk / read-only folder is turned into one line
                if write_failure(e) is None:
                    raise
                with disk_errors(self.metrics_path, f"; last good checkpoint: {self._last_good()}"):
                    raise

    def close_sink(self) -> None:
        """Close the ``train.loggers`` sinks, if open (flushes TensorBoard, finishes W&B)."""
        if self.sink is not None:
            self.sink.close()
            self.sink = None

    def checkpoint(self) -> None:
        """Save weights and trainer state: one process writes the full tensors; several
        processes write a sharded checkpoint, each rank its own shards (collective). The
        newest ``train.keep_checkpoints`` are kept (0: every checkpoint is kept).

        Raises:
            TrainingStopped: the weights are not all finite (nothing is written; the last
                good checkpoint stays ``latest``): a training outcome.
            KeelError: the checkpoint cannot be written (a full disk, a read-only folder): a
                fault, not an outcome of training (a grid records the run as failed and
                ``--resume`` trains it again), naming the last good checkpoint.
        """
        step = self.state.step
        try:
            self.checkpoints.save(step, self.model, self.state, optimizer=self.optimizer, aliases=self.aliases)
        except NonFiniteWeights as e:
            raise TrainingStopped(f"stopped at step {step}: {e}; last good checkpoint: {self._last_good()}") from None
        except Exception as e:  # noqa: BLE001 -- a full disk / read-only folder: one line, the last good step
            cause = write_failure(e)
            if cause is None or self.info.distributed:
                raise
            raise KeelError(f"cannot write the checkpoint of step {step} in {self.rd.checkpoints}: "
                            f"{cause.strerror}{' (' + str(cause.filename) + ')' if cause.filename else ''}; "
                            f"last good checkpoint (intact): {self._last_good()}") from None

    def _last_good(self) -> str:
        ckpt, _ = self.checkpoints.find_intact()
        return str(ckpt) if ckpt is not None else "none"

    def plain_model(self) -> torch.nn.Module | None:
        """The unsharded model on rank 0 (None elsewhere); collective under FSDP, where it is a
        gathered copy on the CPU (no second full model on the GPU of rank 0)."""
        if not self.fsdp:
            return self.model if self.main else None
        weights = SD.full_model_state_dict(self.model)
        if not self.main:
            return None
        copy = Transformer(self.cfg.model)
        copy.load_state_dict(weights)
        return copy

    def _hooks(self, name: str, state: StepState) -> dict:
        fields: dict = {}
        for cb in self.callbacks:
            fields.update(getattr(cb, name)(state) or {})
        return fields

    def forward_backward(self, loops: int | None = None) -> float:
        """Forward and backward over ``grad_accum`` micro-batches (``loops``: see Transformer); the global mean loss."""
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for micro in range(self.tc.grad_accum):
            batch = self.loader.next_batch().to(self.device, non_blocking=True)
            with gradient_sync(self.train_module, micro == self.tc.grad_accum - 1):
                with self.amp:
                    loss = self.train_module(batch[:, :-1], batch[:, 1:], **({"loops": loops} if loops else {}))
                self.scaling.scale(loss / self.tc.grad_accum).backward()  # times the loss scale (fp16 only)
            loss_sum += loss.detach().float()
        return D.all_reduce_mean(loss_sum / self.tc.grad_accum, self.info).item()

    def train_step(self, state: StepState) -> dict:
        """One optimiser step (skipped when the loss or gradient is not finite); returns its record."""
        t0 = time.perf_counter()
        state.lr = set_lr(self.optimizer, self.state.step, self.tc)
        loops = loop_count(self.cfg.model, self.tc.seed, self.state.step)  # a looped core's depth drawn this step
        self.checkpointing = loops is None or loops >= self.tc.activation_checkpoint_min_loops
        state.loss, state.grad_norm = self.forward_backward(loops), None
        self.scaling.unscale_(self.optimizer)  # fp16: hooks, clipping and the logged norm see true gradients
        fields = self._hooks("on_gradients", state)  # raw gradients, before clipping
        max_norm = self.tc.grad_clip if self.tc.grad_clip > 0 else float("inf")
        state.grad_norm = SD.clip_grad_norm_(self.model.parameters(), max_norm)
        # a non-finite LR would write NaN into every weight: it is skipped like a non-finite gradient
        state.finite = math.isfinite(state.loss) and math.isfinite(state.grad_norm) and math.isfinite(state.lr)
        if state.finite:
            self.optimizer.step()
        scaled = self.scaling.update(state.finite)  # fp16: {"loss_scale", "skipped_steps"}; else {}
        self.optimizer.zero_grad(set_to_none=True)
        self.state.step, self.state.tokens = self.state.step + 1, self.state.tokens + self.tokens_per_step
        state.step, state.tokens = self.state.step, self.state.tokens
        dt = time.perf_counter() - t0
        self.state.elapsed += dt
        record = {"step": self.state.step, "tokens": self.state.tokens, "loss": state.loss, "lr": state.lr,
                  "grad_norm": state.grad_norm, "tokens_per_s": self.tokens_per_step / dt, "elapsed_s": self.state.elapsed}
        if self.mfu_peak is not None:  # model FLOPs / s over the peak of every process (PaLM App. B), at this
            # step's loop count (a sampled count: 1 application costs less than the mean R)
            if loops not in self.flops_at:
                self.flops_at[loops] = flops_per_token(self.cfg.model, self.tc.seq_len, loops)
            record["mfu"] = record["tokens_per_s"] * self.flops_at[loops] / self.mfu_peak
        return {**record, **scaled, **fields, **({"loops": loops} if loops is not None else {})}

    def _skip_policy(self, record: dict, finite: bool, bad_in_row: int) -> int:
        """Count a non-finite step (``finite`` False: its update was skipped); raise
        TrainingStopped after ``train.max_bad_steps`` in a row. Returns the new count."""
        if not finite:
            bad_in_row += 1
            record["skipped"] = True
            overflow = self.scaling.overflow_line(record, bad_in_row)  # fp16: an info line, not a warning
            if self.main and overflow:
                log.info(overflow)
            elif self.main:
                log.warning(skipped_step_words(self.state.step, record, bad_in_row))
            if bad_in_row >= self.tc.max_bad_steps:
                self.write(record)
                last = self.checkpoints.latest()
                raise TrainingStopped(f"stopped at step {self.state.step}: {bad_in_row} non-finite steps in a row "
                                      f"(train.max_bad_steps); last good checkpoint: {last if last else 'none'}")
            return bad_in_row
        return 0

    # ------------------------------------------------------------------ the loop
    def fit(self, signals: StopSignals | None = None) -> TrainResult:
        """Train to ``train.steps``; returns the final numbers. ``signals``: the stop-signal handlers
        (:class:`StopSignals`) to train under, which the caller closes (:func:`train` does once the process
        group is gone: a signal after the last step does not kill the finished run on its way out); None:
        the run's own, put back on return.

        Raises:
            TrainingInterrupted: a stop signal during training (after the step's checkpoint).
        """
        own = signals is None
        signals = StopSignals(announce=self.main) if own else signals
        try:
            if self.nothing_left:
                with signals:  # a run already at train.steps is complete: a signal lets it write what it lacks
                    signals.finish(self.state.step)
                    self.close_sink()
                    return self._nothing_to_do()
            return self._train(signals)
        finally:
            if own:
                signals.close()

    def _train(self, signals: StopSignals) -> TrainResult:
        """:meth:`fit` of a run with steps left to train, under ``signals``: the loop, then (the run
        complete: :meth:`StopSignals.finish`) its final files."""
        self._describe()
        first_val = self._first_eval()
        state = StepState(self.cfg, self.run_dir, self.info, self.model, self.tokenizer, self.plain_model,
                          step=self.state.step, tokens=self.state.tokens, history=self.history, data_dir=self.data_dir)
        for cb in self.callbacks:
            cb.on_train_start(state)
        bar = ProgressReporter(self.tc.steps, self.state.step, self.tokens_per_step, enabled=self.tc.progress and self.main,
                               every_steps=self.tc.log_every)
        bad_in_row, val_loss = 0, None
        self.train_module.train()
        with signals:
            try:
                while self.state.step < self.tc.steps:
                    record = self.train_step(state)
                    record.update(self._hooks("on_step_end", state))
                    bad_in_row = self._skip_policy(record, state.finite, bad_in_row)
                    if state.stop is not None:
                        self.write(record)
                        raise TrainingStopped(f"stopped at step {self.state.step}: {state.stop}")
                    if self.state.step % self.tc.eval_every == 0 or self.state.step == self.tc.steps:
                        val_loss = self.validate()
                        record.update(val_loss=val_loss, val_ppl=perplexity(val_loss))
                    self.write(record)
                    bar.update(record)
                    saved = self.state.step % self.tc.checkpoint_every == 0 or self.state.step == self.tc.steps
                    if saved:
                        self.checkpoint()
                    self._stop_if_signalled(signals, saved)
                signals.finish(self.state.step)  # trained and checkpointed: a signal from here on ends nothing
                end = self._hooks("on_train_end", state)  # e.g. a loss spike still open at the last step
                if end:
                    self.write({"step": self.state.step, "tokens": self.state.tokens, **end})
            finally:
                bar.close()
                self.close_sink()
            return self._finish(first_val, val_loss)

    def _stop_if_signalled(self, signals: StopSignals, saved: bool) -> None:
        """After a step: if any rank got SIGINT/SIGTERM, checkpoint (unless this step just did)
        and raise :class:`TrainingInterrupted` on every rank."""
        signum = agreed_stop_signal(signals.received, self.info, self.device)
        if not signum:
            return
        if not saved:
            self.checkpoint()
        name = signal.Signals(signum).name
        raise TrainingInterrupted(f"stopped by {name} after step {self.state.step}: checkpoint "
                                  f"{RunDir(self.run_dir).checkpoints / step_name(self.state.step)} written; resume with: "
                                  f"keel train --resume {self.run_dir}", signum)

    def _nothing_to_do(self) -> TrainResult:
        """A resumed run already at ``train.steps``: report and train nothing (a changed key is not
        applied, so not recorded either: one line says so). The final files a stop or a full disk during
        finalisation left out (``loss.png``, ``sample.txt``) are written, and one line says so."""
        missing = D.decide_on_rank0(lambda: [name for name in (RunDir.LOSS_PLOT, RunDir.SAMPLE)
                                             if not (self.run_dir / name).is_file()
                                             and (name == RunDir.LOSS_PLOT or self.tc.sample_tokens > 0)], self.info)
        if missing:
            self._write_final_files(plot=RunDir.LOSS_PLOT in missing, sample=RunDir.SAMPLE in missing)
        if self.main and missing:
            log.info("%s is already at step %d (train.steps = %d): wrote the final files it lacked (%s); nothing "
                     "left to train", self.run_dir, self.state.step, self.tc.steps, ", ".join(missing))
        if self.main and self.not_applied:
            keys = ", ".join(f"{k} = {c['new']!r}" for k, c in self.not_applied.items())
            log.warning("%s is already at step %d (train.steps = %d): nothing left to train; not applied and not "
                        "written: %s (raise train.steps with --set to train further)", self.run_dir, self.state.step,
                        self.tc.steps, keys)
        elif self.main and not missing:
            log.info("%s is already at step %d (train.steps = %d): nothing to do (raise train.steps with --set to "
                     "train further)", self.run_dir, self.state.step, self.tc.steps)
        vals = [r["val_loss"] for r in self.history if r.get("val_loss") is not None]
        val_loss = vals[-1] if vals else self.validate()
        sample_path = self.rd.sample
        sample = sample_path.read_text().rstrip("\n") if sample_path.is_file() else ""
        st = self.state
        tok_s = mean_tokens_per_s(st.tokens, st.elapsed, self.untimed_tokens) or 0.0
        return TrainResult(self.run_dir, st.step, st.tokens, None, val_loss, perplexity(val_loss), tok_s, sample,
                           resumed_from=st.step, steps_run=0)

    def _first_eval(self) -> float | None:
        """Validation loss of the fresh model (logged as step 0), or the logged one on resume."""
        if self.ckpt is None:
            first = self.validate()
            self.write({"step": 0, "tokens": 0, "val_loss": first, "val_ppl": perplexity(first)})
            return first
        return self.history[0].get("val_loss") if self.history else None

    def _write_final_files(self, plot: bool = True, sample: bool = True) -> str:
        """Write ``RUN/loss.png`` (``plot``) and ``RUN/sample.txt`` (``sample``, when
        ``train.sample_tokens`` > 0) from rank 0; return the sample text ("" when none written).
        Collective: every rank calls it (the plain model is gathered under FSDP)."""
        plain = self.plain_model() if sample and self.tc.sample_tokens > 0 else None  # collective under FSDP
        text = ""
        if self.main:
            if plot:
                plot_loss(self.metrics_path, self.rd.loss_plot,
                          title=f"{self.cfg.model.residual}, {self.cfg.model.n_sublayers} sub-layers")
            if plain is not None:
                text = sample_text(plain, self.tokenizer, self.tc.sample_prompt, self.tc.sample_tokens,
                                   next(plain.parameters()).device, seed=self.tc.seed)
                atomic_write_text(self.rd.sample, text + "\n")
        D.barrier(self.info)
        return text

    def _finish(self, first_val: float | None, val_loss: float | None) -> TrainResult:
        """Plot, sample, and the final numbers."""
        if val_loss is None:  # resumed at the end: nothing ran
            val_loss = self.validate()
        sample = self._write_final_files()
        st = self.state
        tok_s = mean_tokens_per_s(st.tokens, st.elapsed, self.untimed_tokens) or 0.0
        return TrainResult(self.run_dir, st.step, st.tokens, first_val, val_loss, perplexity(val_loss), tok_s,
                           sample, resumed_from=self.resumed_from, steps_run=st.step - (self.resumed_from or 0))
