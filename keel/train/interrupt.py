"""Stopping a run cleanly on SIGINT (Ctrl-C), SIGTERM, SIGUSR1 or SIGUSR2 (Slurm's pre-timeout signals).

While :class:`StopSignals` is active, the first of these signals does not kill the process:
it is recorded (:attr:`StopSignals.received`), and the training loop finishes its current
step, writes a checkpoint and stops (:class:`keel.train.trainer.TrainingInterrupted`). The
original handlers are put back at once, so a second signal stops the process the usual way
(Ctrl-C twice: ``KeyboardInterrupt`` at once). Handlers can only be installed in the main
thread; elsewhere (a thread running a run) the class does nothing.
"""

from __future__ import annotations

import logging
import signal
import threading

from keel.io import STOP_SIGNALS

log = logging.getLogger(__name__)

SIGNALS = STOP_SIGNALS  # SIGINT, SIGTERM, SIGUSR1 and SIGUSR2 (keel.io.STOP_SIGNALS)


class StopSignals:
    """Context manager: record the first SIGINT/SIGTERM instead of dying (see the module docstring).

    Attributes:
        received: the signal number received (``signal.SIGINT`` ...), or None.
    """

    def __init__(self, announce: bool = True):
        self.received: int | None = None
        self.announce = announce
        self._saved: dict[int, object] = {}

    def _handler(self, signum, frame) -> None:
        self.received = signum
        self._restore()
        if self.announce:
            log.warning("%s received: stopping after this step and saving a checkpoint (send it again to stop "
                        "at once, losing the steps since the last checkpoint)", signal.Signals(signum).name)

    def _restore(self) -> None:
        for signum, handler in self._saved.items():
            signal.signal(signum, handler)
        self._saved = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._saved[signum] = signal.signal(signum, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()
