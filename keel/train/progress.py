"""Training progress on stderr: a tqdm bar on a terminal, plain log lines otherwise.

When stderr is a terminal, :class:`ProgressReporter` draws the usual tqdm bar. When it is
not (a log file, a pipe, a batch job), a bar would write a line per refresh; instead the
reporter logs one plain line (``logging``, logger ``keel.train.progress``) every
``every_steps`` steps or every ``every_s`` seconds, whichever comes first, and at the last
step::

    step 120/1000 (12%) | loss 3.4121 | val_loss 3.5012 | lr 2.95e-03 | 12,345 tokens/s | ETA 4m05s

A step with a validation loss always gets a line (with ``val_loss``). tokens/s is the training
throughput over a window of recent steps: the steps since the previous line (wall clock, so
evaluation and checkpoint time count), where the first window starts when the first step of
this process ends, so that start-up (data, model build, ``torch.compile``, the first step's
warm-up) is never counted. ETA = remaining steps x the wall time per step over that same
window (a run that sped up or slowed down is not estimated from its whole-run average). A line
of that first step itself has no window yet: it says how long the step took (``first step
12s``) instead of tokens/s and an ETA. MFU is the step's own (``mfu`` of the record, see
:mod:`keel.train.trainer`), with 2 significant digits (``MFU 0.011%``, ``MFU 42%``). A run with
loss scaling (``train.precision = "fp16-autocast"``) also says how many updates were skipped so
far (``skipped 3``, the record's ``skipped_steps``; the bar's ``skipped=3``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import threading
import time

from tqdm.auto import tqdm

log = logging.getLogger(__name__)


def interactive(stream=None) -> bool:
    """Whether ``stream`` (default: stderr) is a terminal."""
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def format_percent(fraction: float) -> str:
    """``fraction`` as a percentage with 2 significant digits: ``"42%"``, ``"4.2%"``, ``"0.011%"``
    (a tiny model's MFU is not ``0.0%``); ``"0%"`` for 0."""
    pct = float(f"{100 * fraction:.2g}")  # rounded first, so 9.96 is "10", not "10.0"
    if pct == 0 or not math.isfinite(pct):
        return f"{pct:g}%"
    return f"{pct:.{max(0, 1 - math.floor(math.log10(abs(pct))))}f}%"


def format_duration(seconds: float) -> str:
    """``"1h02m"``, ``"4m05s"`` or ``"12s"`` for a duration in seconds (>= 0)."""
    s = max(0, int(round(seconds)))
    if s >= 3600:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


class ProgressReporter:
    """Reports training steps: tqdm on a terminal, else a log line every N steps / M seconds.

    Args:
        total: the last step (``train.steps``).
        initial: the step training starts from (a resumed run's checkpoint step).
        tokens_per_step: tokens per optimiser step (global), for tokens/s.
        enabled: False = report nothing (``train.progress = false``, or not rank 0).
        every_steps: steps between plain lines (``train.log_every``).
        every_s: seconds between plain lines, at most.
        use_bar: draw a tqdm bar; default: when stderr is a terminal.
        clock: seconds, monotonic (``time.perf_counter``; a test passes its own).
    """

    def __init__(self, total: int, initial: int, tokens_per_step: int, enabled: bool = True, every_steps: int = 10,
                 every_s: float = 30.0, use_bar: bool | None = None, clock=time.perf_counter):
        self.total, self.tokens_per_step, self.enabled = total, tokens_per_step, enabled
        self.every_steps, self.every_s, self.clock = max(1, every_steps), every_s, clock
        self.use_bar = interactive() if use_bar is None else use_bar
        self.start_t = clock()  # the first step of this process starts
        # where the tokens/s window starts (step, time): the end of the first step, then each line's step
        self.last_step: int | None = None
        self.last_t = self.start_t
        self.bar = None
        if enabled and self.use_bar:
            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)

    def update(self, record: dict) -> str | None:
        """Report the step of ``record`` (keys ``step``, ``loss``, ``lr``); returns the plain
        line logged, if one was."""
        if not self.enabled:
            return None
        step = int(record["step"])
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            extra = {"skipped": record["skipped_steps"]} if record.get("skipped_steps") is not None else {}
            self.bar.set_postfix(loss=f"{record.get('loss', float('nan')):.3f}",
                                 tok_s=f"{record.get('tokens_per_s', 0.0):,.0f}", **extra, refresh=False)
            return None
        now = self.clock()
        due = step % self.every_steps == 0 or now - self.last_t >= self.every_s or step >= self.total
        line = self.line(record, now) if due or record.get("val_loss") is not None else None
        if line is not None or self.last_step is None:  # the next window starts here (or at the first step's end)
            self.last_step, self.last_t = step, now
        if line is not None:
            log.info(line)
        return line

    def line(self, record: dict, now: float) -> str:
        """The plain progress line of ``record`` at time ``now`` (see the module docstring)."""
        step = int(record["step"])
        parts = [f"step {step}/{self.total} ({100 * step // max(1, self.total)}%)"]
        if record.get("loss") is not None:
            parts.append(f"loss {record['loss']:.4f}")
        if record.get("val_loss") is not None:
            parts.append(f"val_loss {record['val_loss']:.4f}")
        if record.get("lr") is not None:
            parts.append(f"lr {record['lr']:.2e}")
        if record.get("skipped_steps") is not None:  # fp16 loss scaling: updates skipped so far
            parts.append(f"skipped {record['skipped_steps']}")
        if self.last_step is None:  # the first step: start-up and warm-up, no training throughput yet
            return " | ".join(parts + [f"first step {format_duration(now - self.start_t)}"])
        steps, dt = max(1, step - self.last_step), max(now - self.last_t, 1e-9)
        parts.append(f"{steps * self.tokens_per_step / dt:,.0f} tokens/s")
        if record.get("mfu") is not None:  # the step's own (keel.train.trainer), beside the recent pace
            parts.append(f"MFU {format_percent(record['mfu'])}")
        parts.append(f"ETA {format_duration((self.total - step) * dt / steps)}")
        return " | ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def heartbeat(logger: logging.Logger, what: str, every_s: float = 15.0):
    """While the block runs, log ``"{what}: still working, N s so far"`` every ``every_s`` seconds
    (from a thread): a long step that reports nothing itself (building a model of 100,000
    sub-layers, its first forward pass) does not look like a hang. Nothing is logged for a block
    that ends sooner."""
    done = threading.Event()
    t0 = time.perf_counter()

    def beat() -> None:
        while not done.wait(every_s):
            logger.info("%s: still working, %s so far", what, format_duration(time.perf_counter() - t0))

    thread = threading.Thread(target=beat, daemon=True, name="keel-heartbeat")
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
