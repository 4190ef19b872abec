"""The local worker processes of a grid (``keel sweep`` / ``keel study --workers N``).

:class:`LocalPool` runs calls ``fn(*args)`` in ``N`` spawned processes, one call at a time
each, and tells its caller how each ended. Unlike ``concurrent.futures.ProcessPoolExecutor``
(which it replaces here), a worker that dies does not break the pool: a worker killed by
SIGKILL (as the kernel's out-of-memory killer does) or one that exits, ends *its* call only,
which is reported as failed with the reason (:func:`death_words`); a new worker takes its
place and the other workers' calls run on. The executor's broken pool failed every call,
sent SIGTERM to the other workers and left a ``BrokenProcessPool`` traceback.

A worker that cannot be started (``ulimit -n``: ``EMFILE``; a limit on processes) is one line:
the grid goes on with the workers it has, and stops with :class:`keel.errors.KeelError` when it
has none left for the calls still to run (:func:`start_failure`).

Stopping: each SIGINT / SIGTERM to the pool's process is passed on to every worker (workers put
themselves in their own process group, see :func:`keel.experiments.grid._init_worker`); calls
not started are dropped; a call stopped by the signal (``Interrupted`` / ``KeyboardInterrupt``)
is neither a value nor a failure. Workers are spawned with those signals blocked, so a Ctrl-C
while one imports torch waits until its initializer has its handlers in place.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.resource_tracker
import os
import signal
import time
from collections.abc import Callable, Sequence

from keel.errors import Interrupted, KeelError
from keel.io import STOP_SIGNALS, limit_failure, passing_on_stop_signals

_log = logging.getLogger(__name__)
_STOP_SIGNALS = set(STOP_SIGNALS)


def _worker_main(conn, initializer: Callable, initargs: tuple) -> None:
    """A worker process: ``initializer(*initargs)``, then for each ``(fn, args)`` received on
    ``conn`` send back ``("value", fn(*args))`` or ``("raised", the exception)``, until None or
    the pool's end of the pipe is closed."""
    initializer(*initargs)
    while True:
        try:
            item = conn.recv()
        except EOFError:  # the pool's process is gone
            return
        if item is None:
            return
        fn, args = item
        try:
            reply = ("value", fn(*args))
        except BaseException as e:  # noqa: BLE001 -- sent back: a stop request, or raised in the pool's process
            reply = ("raised", e)
        conn.send(reply)


def death_words(exitcode: int | None) -> str:
    """Why a worker process ended while running a call, from its exit code (negative: minus the
    signal that killed it), e.g. "its worker process was killed by SIGKILL (as the kernel's
    out-of-memory killer does)"."""
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        oom = " (as the kernel's out-of-memory killer does)" if -exitcode == signal.SIGKILL else ""
        return f"its worker process was killed by {name}{oom}"
    return f"its worker process exited with status {exitcode} before it returned a result"


def start_failure(e: OSError) -> str:
    """What stopped a worker process from starting, as words with the limit to raise, e.g.
    "Too many open files (the limit on open files, ulimit -n, is 12)" (:func:`keel.io.limit_failure`)."""
    return limit_failure(e) or e.strerror or str(e)


class _Worker:
    """One worker process, the pool's end of its pipe, and the call it runs (None: idle)."""

    def __init__(self, slot: int, proc, conn):
        self.slot, self.proc, self.conn = slot, proc, conn
        self.key: object = None
        self.t0 = 0.0


class LocalPool:
    """``workers`` spawned worker processes; worker slot ``i`` runs ``initializer(*initargs[i])``
    first (e.g. its own ``CUDA_VISIBLE_DEVICES``), and so does a worker that replaces it."""

    def __init__(self, workers: int, initializer: Callable, initargs: Sequence[tuple]):
        self.ctx = multiprocessing.get_context("spawn")
        self.n, self.initializer, self.initargs = workers, initializer, list(initargs)
        self.slots: list[_Worker | None] = [None] * workers
        self.queue: collections.deque = collections.deque()
        self.received: list[int] = []
        self.start_error: str | None = None  # why the last worker that failed to start did
        self.unstarted: set[int] = set()  # slots whose worker could not be started: not tried again

    def run(self, calls: Sequence[tuple[object, Callable, tuple]], done: Callable[[object, object], None],
            died: Callable[[object, str, float], None]) -> list[int]:
        """Run every ``(key, fn, args)`` of ``calls``: ``done(key, fn(*args))`` as each returns;
        ``died(key, why, seconds)`` for a call whose worker died (:func:`death_words`). Returns the
        stop signals received (empty: every call ran).

        Raises:
            KeelError: no worker process could be started for the calls left (:func:`start_failure`).
            BaseException: what a call raised, other than a stop request after a stop signal
                (the running calls are asked to stop first: SIGTERM).
        """
        self.queue.extend(calls)
        # Started on the first spawn, the resource tracker unblocks SIGINT / SIGTERM after starting itself: a
        # worker spawned next did not inherit them blocked (a Ctrl-C during its imports went unnoticed)
        try:
            multiprocessing.resource_tracker.ensure_running()
        except OSError as e:  # its pipe needs two descriptors: EMFILE as for a worker's own start
            self.start_error = start_failure(e)
            raise KeelError(self._no_worker_words()) from None
        with passing_on_stop_signals(self._stop) as received:
            self.received = received
            try:
                while self._dispatch():
                    self._collect(done, died)
            finally:
                self._close()
        return received

    def _start(self, slot: int) -> _Worker | None:
        """A new worker in ``slot`` (None, with :attr:`start_error`, where the OS refuses one)."""
        child = None
        try:
            conn, child = self.ctx.Pipe()
            proc = self.ctx.Process(target=_worker_main, args=(child, self.initializer, self.initargs[slot]))
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # inherited: see the module's docstring
            try:
                proc.start()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        except OSError as e:  # EMFILE (ulimit -n), EAGAIN (ulimit -u), ENOMEM
            self.start_error = start_failure(e)
            with contextlib.suppress(UnboundLocalError, OSError):
                conn.close()
            return None
        finally:
            if child is not None:
                child.close()
        return _Worker(slot, proc, conn)

    def _worker_for(self, slot: int) -> _Worker | None:
        """The live worker of ``slot``, started (again) where there is none."""
        w = self.slots[slot]
        if w is not None and not w.proc.is_alive():  # it died between calls: nothing of it is lost
            w.proc.join()
            w.conn.close()
            w = None
        if w is None:
            w = self.slots[slot] = self._start(slot)
            if w is None:
                self.unstarted.add(slot)
            if w is None and any(self.slots):
                _log.warning(f"grid: cannot start worker process {slot + 1}: {self.start_error}; going on with "
                             f"{sum(1 for s in self.slots if s is not None)}")
        return w

    def _dispatch(self) -> bool:
        """Hand the next calls to idle workers; True while a call runs.

        Raises:
            KeelError: calls are left and no worker can be started for them.
        """
        for _ in range(2):  # a second pass starts workers in place of any whose pipe broke
            self._hand_out()
            busy = any(w is not None and w.key is not None for w in self.slots)
            if busy or not self.queue or self.received:
                return busy
        raise KeelError(self._no_worker_words())

    def _no_worker_words(self) -> str:
        """The one line that says no worker process can be started, and why (:attr:`start_error`)."""
        return (f"cannot start a worker process for the grid: {self.start_error or 'each one died at once'}; "
                "raise the limit, or use fewer --workers (0 runs the jobs in this process)")

    def _hand_out(self) -> None:
        """Give the next calls to the idle workers (started where a slot has none)."""
        for slot in range(self.n):
            if not self.queue or self.received:
                break
            w = self.slots[slot]
            if w is not None and w.key is not None or slot in self.unstarted:
                continue
            w = self._worker_for(slot)
            if w is None:
                continue
            key, fn, args = self.queue[0]
            try:
                w.conn.send((fn, args))
            except OSError:  # its pipe is broken (it is dying): the call waits for the next worker
                w.proc.kill()
                w.proc.join()
                w.conn.close()
                self.slots[slot] = None
                continue
            self.queue.popleft()
            w.key, w.t0 = key, time.monotonic()

    def _collect(self, done: Callable, died: Callable) -> None:
        """Wait until a running call ends, then report each that did."""
        busy = [w for w in self.slots if w is not None and w.key is not None]
        ready = set(multiprocessing.connection.wait([w.conn for w in busy] + [w.proc.sentinel for w in busy]))
        for w in busy:
            if w.conn not in ready and w.proc.sentinel not in ready:
                continue
            key, w.key = w.key, None
            try:
                kind, value = w.conn.recv()
            except (EOFError, OSError):  # it died before it sent its reply
                w.proc.join()
                w.conn.close()
                self.slots[w.slot] = None
                died(key, death_words(w.proc.exitcode), time.monotonic() - w.t0)
                continue
            if kind == "value":
                done(key, value)
            elif not (self.received and isinstance(value, (Interrupted, KeyboardInterrupt))):
                raise value  # a stop request without a stop signal here (a worker signalled alone) included

    def _stop(self, signum: int) -> None:
        """A stop signal: no call starts any more; each worker gets the signal (a second one stops
        the running calls at once)."""
        self.queue.clear()
        for w in self.slots:
            if w is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, signum)

    def _close(self) -> None:
        """Let every worker exit: idle ones at once, busy ones (the pool is raising) after a stop
        request (SIGTERM: a training run checkpoints its step); wait for them."""
        workers = [w for w in self.slots if w is not None]
        for w in workers:
            with contextlib.suppress(OSError):
                w.conn.send(None)
            if w.key is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid, signal.SIGTERM)
        for w in workers:
            w.proc.join()
            w.conn.close()
        self.slots = [None] * self.n
