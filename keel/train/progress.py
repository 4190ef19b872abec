"""Training progress on stderr: a tqdm bar on a terminal, plain log lines otherwise.

When stderr is a terminal, :class:`ProgressReporter` draws the usual tqdm bar. When it is
not (a log file, a pipe, a batch job), a bar would write a line per refresh; instead the
reporter logs one plain line (``logging``, logger ``keel.train.progress``) every
``every_steps`` steps or every ``every_s`` seconds, whichever comes first, and at the last
step::

    step 120/1000 (12%) | loss 3.4121 | val_loss 3.5012 | lr 2.95e-03 | 12,345 tokens/s | ETA 4m05s

A step with a validation loss always gets a line (with ``val_loss``). tokens/s is measured
over the steps since the previous line (wall clock, so evaluation and checkpoint time count);
ETA = remaining steps x the wall time per step over those same recent steps (a run that sped
up or slowed down is not estimated from its whole-run average), until a line has been
logged: the mean since the start.
"""

from __future__ import annotations

import logging
import sys
import time

from tqdm.auto import tqdm

log = logging.getLogger(__name__)


def interactive(stream=None) -> bool:
    """Whether ``stream`` (default: stderr) is a terminal."""
    stream = stream if stream is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


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
        self.start_step = self.last_step = initial
        self.start_t = self.last_t = clock()
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
            self.bar.set_postfix(loss=f"{record.get('loss', float('nan')):.3f}",
                                 tok_s=f"{record.get('tokens_per_s', 0.0):,.0f}", refresh=False)
            return None
        now = self.clock()
        due = step % self.every_steps == 0 or now - self.last_t >= self.every_s or step >= self.total
        if not (due or record.get("val_loss") is not None):
            return None
        line = self.line(record, now)
        self.last_step, self.last_t = step, now
        log.info(line)
        return line

    def line(self, record: dict, now: float) -> str:
        """The plain progress line of ``record`` at time ``now`` (see the module docstring)."""
        step = int(record["step"])
        dt, steps = now - self.last_t, step - self.last_step
        tok_s = steps * self.tokens_per_step / dt if dt > 0 and steps > 0 else record.get("tokens_per_s", 0.0)
        if dt > 0 and steps > 0:  # the recent pace
            per_step = dt / steps
        else:
            per_step = (now - self.start_t) / max(1, step - self.start_step)
        parts = [f"step {step}/{self.total} ({100 * step // max(1, self.total)}%)"]
        if record.get("loss") is not None:
            parts.append(f"loss {record['loss']:.4f}")
        if record.get("val_loss") is not None:
            parts.append(f"val_loss {record['val_loss']:.4f}")
        if record.get("lr") is not None:
            parts.append(f"lr {record['lr']:.2e}")
        parts.append(f"{tok_s:,.0f} tokens/s")
        if record.get("mfu") is not None:  # the step's own (keel.train.trainer), beside the recent pace
            parts.append(f"MFU {100 * record['mfu']:.1f}%")
        parts.append(f"ETA {format_duration((self.total - step) * per_step)}")
        return " | ".join(parts)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
