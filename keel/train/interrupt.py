"""Stopping a run cleanly on SIGINT (Ctrl-C), SIGTERM, SIGHUP (a closed terminal or SSH session),
SIGUSR1 or SIGUSR2 (Slurm's pre-timeout signals): :data:`keel.io.STOP_SIGNALS`.

While :class:`StopSignals` is active, the first of these signals does not kill the process:
it is recorded (:attr:`StopSignals.received`), and the training loop finishes its current
step, writes a checkpoint and stops (:class:`TrainingInterrupted`); under torchrun every rank
stops on the same step (:func:`agreed_stop_signal`). The
original handlers are put back at once, so a second signal stops the process the usual way
(Ctrl-C twice: ``KeyboardInterrupt`` at once). Handlers can only be installed in the main
thread; elsewhere (a thread running a run) the class does nothing.

SIGHUP is a stop request like the others (checkpoint, exit 129): a run started in an SSH session
that closes is saved, not lost; its standard output and error, where they were that terminal, go to
``/dev/null`` from then on (:func:`keel.io.silence_hung_up_terminal`). SIGQUIT (Ctrl-\\) is
deliberately left at its default: it quits at once, without the checkpoint (with a core dump where
enabled), the way to stop now; the last checkpoint is intact and ``--resume`` continues from it.
"""

from __future__ import annotations

import logging
import signal
import threading

import torch

from keel.errors import Interrupted
from keel.io import STOP_SIGNALS, silence_hung_up_terminal
from keel.train import dist as D

log = logging.getLogger(__name__)

SIGNALS = STOP_SIGNALS  # SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 (keel.io.STOP_SIGNALS)


class StopSignals:
    """Context manager: record the first SIGINT/SIGTERM instead of dying (see the module docstring).

    Once the run has trained its last step (:meth:`finish`), a signal is no stop request: the run is
    complete, it writes its final files and ends normally; one line says so. Until :meth:`close`
    (called by :func:`keel.train.trainer.train` once the process group is gone), the handlers then stay
    installed after the ``with`` block, so a signal on the way out does not kill a finished run.

    Attributes:
        received: the signal number received while training (``signal.SIGINT`` ...), or None.
        late: the signal received after the last step (the run is complete), or None.
    """

    def __init__(self, announce: bool = True):
        self.received: int | None = None
        self.late: int | None = None
        self.finished_at: int | None = None  # the last step, once trained (finish)
        self.announce = announce
        self._saved: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        self._restore()
        silence_hung_up_terminal(signum)  # SIGHUP: the terminal is gone; a write to it would end the run
        if self.finished_at is not None:
            self.late = signum
            self._say_late()
            return
        self.received = signum
        if self.announce:
            log.warning("%s received: stopping after this step and saving a checkpoint (send it again to stop "
                        "at once, losing the steps since the last checkpoint)", signal.Signals(signum).name)

    def _say_late(self) -> None:
        if self.announce:
            log.warning("%s received after the last step (%d): the run is complete; writing its final files, "
                        "nothing to resume (send it again to stop at once)", signal.Signals(self.late).name,
                        self.finished_at)

    def finish(self, step: int) -> None:
        """The run has trained its last step ``step`` (checkpointed): from now on a signal is recorded as
        :attr:`late` and said in one line, and the run completes. A signal received since the last
        :func:`agreed_stop_signal` (the ranks trained on) counts as late too."""
        self.finished_at = step
        if self.received is not None:
            self.late, self.received = self.received, None
            self._say_late()

    def _restore(self) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        self._saved = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread() and not self._saved:
            for signum in SIGNALS:
                self._saved[signum] = signal.signal(signum, self._handler)
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None or self.finished_at is None:  # stopped or failed: the handlers go back now
            self._restore()

    def close(self) -> None:
        """Put the original handlers back (a no-op when they are)."""
        self._restore()


def agreed_stop_signal(received: int | None, info: D.DistInfo, device: torch.device) -> int:
    """The signal every rank stops on after a step (collective: every rank calls it): this
    rank's own ``received`` if any, else SIGTERM when another rank got one, else 0.

    ``received`` is read once, by the caller, before the all-reduce: a signal that lands
    during it counts at the next step, on every rank. (Reading it again after the all-reduce
    let the rank that just got it stop and checkpoint while the others trained on: the two
    waited for each other in different collectives until torchrun killed both, without a
    checkpoint.)
    """
    mine = int(received or 0)
    if not info.distributed:
        return mine
    total = D.all_reduce_sum(torch.tensor(float(mine), device=device), info).item()
    return mine or (int(signal.SIGTERM) if total else 0)


class TrainingInterrupted(Interrupted):
    """Raised when a run was stopped by SIGINT or SIGTERM after its checkpoint was written;
    the message says how to resume (``exit_code`` 130 / 143, see :class:`keel.errors.Interrupted`)."""
