"""Divergence classifier: is a loss curve healthy, or did it fail in one of the Keel paper's
three ways (Chen & Wei 2026, arXiv 2601.19895, Sec. 5.1 and Figure 3)?

Modes (``Verdict.mode``):

``healthy``
    none of the below.
``instability`` (irrecoverable instability)
    a spike after which the loss never returns to its pre-spike baseline; also any
    non-finite (NaN/inf) loss, at the step where it first occurs.
``stagnation`` (loss stagnation)
    the loss plateaus far earlier / higher than expected: at small scale, on the
    *unigram plateau* (the loss of a model that has learnt token frequencies only).
``degradation`` (optimisation degradation)
    no spike, no plateau, but the loss falls anomalously slowly compared with a
    reference curve (this "silent" mode needs a reference; without one it is never
    reported).

Quantities, all updated once per step in O(1) (losses in nats per token, steps are
optimiser steps):

* ``ema``: exponential moving average of the loss, ``ema_t = b * ema_{t-1} + (1 - b) * loss_t``
  with ``b = ema_beta`` (0.9, i.e. about 10 steps), started at the first loss.
* ``L0``: the first loss seen; ``baseline``: the running minimum of ``ema``;
  ``progress = L0 - baseline`` (nats removed so far).
* ``noise``: an EMA (same ``b``) of ``|loss - ema|``, the step-to-step scatter of the loss,
  not updated while a spike is open.

Criteria, checked in this order every step (defaults of :class:`Thresholds` in brackets):

1. Non-finite loss -> ``instability`` at that step, at once.
2. Spike: a loss above ``baseline + margin`` with ``margin = max(spike_abs [0.1],
   spike_rel [0.1] * baseline, spike_noise [6] * noise)`` opens a spike at that step (its
   onset), with the baseline frozen at its value just before (the noise term counts only
   after ``warmup_steps`` [10] losses, once its estimate has settled; before that the
   margin is the first two terms). The spike has recovered once ``recover_steps`` [5]
   losses in a row are at most ``baseline_0 + recover_frac [0.5] * margin_0``; a recovered
   spike is forgotten (it is *not* a divergence). If it has not recovered ``recovery_window``
   [50] steps after its onset -> ``instability`` at the onset step. This is decided online,
   ``recovery_window`` steps late, or sooner for a blow-up: ``blowup_steps`` [5] losses in a
   row above ``blowup_factor [2] * L0`` while the spike is open (a model twice as bad as
   untrained has lost everything it learnt; the loss of an untrained model, ``L0``, is
   about ``log V``). At the end of the curve (:meth:`OnlineDivergenceMonitor.finalize`, which
   :func:`classify` calls and a trainer should call after its last step), a spike still open that
   has lasted ``end_open_steps`` [5] steps also counts (the loss never
   came back within the curve).
3. Behind: with the unigram entropy ``H1`` of the training tokens (nats; measured by
   ``keel prepare``, :func:`keel.data.stats.dataset_unigram_entropy`), ``baseline >=
   (1 - stagnation_margin [0.05]) * H1``: the run has not (yet) got below the unigram
   plateau. The 5% margin: on a plateau the EMA-minimum baseline sits within ~0.5% of ``H1``
   (12 stress runs at BPE 1024: 5.949-5.993 nats against ``H1`` = 5.97), while models
   that learn from context go far below it (BPE 512, ``H1`` = 5.36: 4.1-4.7 nats after 65k
   tokens at 64 sub-layers for Post-LN and Keel), so 5% leaves the noise and the first
   few learnt bigrams inside the plateau and is independent of the vocabulary size. Without
   ``H1`` and without a reference, the older rule ``progress < min_progress [0.3] * L0``
   (which does depend on the vocabulary through ``L0 ~ log V``). With a reference
   (same EMA rule applied to it, read at the same step), ``progress < behind_frac [0.5] *
   ref_progress``, only once ``ref_progress >= min_ref_progress [0.1] * ref_L0``.
   With both a reference and ``H1``, "behind" for stagnation is either test, and the ``H1``
   test counts only at steps where the reference's own baseline (same EMA rule) is already
   below the level: a run still on the plateau while its reference is too is where the
   reference says it should be, not stagnating (Pre-LN at init std 0.02 on the 1,000-step
   stress ramp at 64 sub-layers sat at 5.2-5.4 nats, above the level, from step ~40 to ~250,
   then learnt: stagnation was reported at step 122 against its own reference curve).
4. Plateau: for ``plateau_steps`` [100] steps the baseline has not dropped by more than
   ``plateau_tol`` [0.1] times the progress made up to the last such drop (an improvement
   is a drop below ``anchor - plateau_tol * (L0 - anchor)``, where ``anchor`` is the
   baseline at the previous improvement; early on, any drop counts). Plateau while
   behind -> ``stagnation`` at the step where the plateau began (the last improvement).
   Checks 3-5 are skipped while a spike is open.
5. With a reference only: behind (but not on a plateau and with no spike open) for
   ``degrade_steps`` [50] steps in a row -> ``degradation`` at the first step of that streak.

Names used in ``Verdict.evidence``: ``baseline``, ``margin``, ``spike_loss``, ``open_steps``,
``open_at_end``, ``non_finite``, ``l0``, ``progress``, ``expected_progress``,
``plateau_steps``, ``ref_progress``, ``streak_steps``, and, when LRs are given,
``lr_at_step`` / ``lr_before_step`` (the LR at the failure's step and at the step before).

Only the first failure is reported. The online monitor returns its :class:`Verdict`
once, on the step where it becomes certain, and ``None`` on every later step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from keel.errors import KeelError
from keel.rundir import RunDir

HEALTHY, STAGNATION, INSTABILITY, DEGRADATION = "healthy", "stagnation", "instability", "degradation"
MODES = (HEALTHY, STAGNATION, INSTABILITY, DEGRADATION)


@dataclass
class Thresholds:
    """The classifier's parameters (see the module docstring for how each is used).

    Losses in nats/token, windows in optimiser steps, the rest dimensionless.
    """

    ema_beta: float = 0.9
    warmup_steps: int = 10
    spike_abs: float = 0.1
    spike_rel: float = 0.1
    spike_noise: float = 6.0
    recover_frac: float = 0.5
    recover_steps: int = 5
    recovery_window: int = 50
    end_open_steps: int = 5
    min_progress: float = 0.3
    behind_frac: float = 0.5
    min_ref_progress: float = 0.1
    plateau_tol: float = 0.1
    plateau_steps: int = 100
    degrade_steps: int = 50
    blowup_factor: float = 2.0
    blowup_steps: int = 5
    stagnation_margin: float = 0.05

    def plateau_level(self, h1: float | None) -> float | None:
        """The unigram plateau's level, ``(1 - stagnation_margin) * h1`` nats/token (``h1``: the
        training tokens' unigram entropy; None without one): a training loss at or above it has
        learnt no more than token frequencies (stagnation, the Keel paper's Sec. 5.1). The one
        place the level is computed (the classifier, a study's plateau exit, lr-sensitivity)."""
        return None if h1 is None else (1 - self.stagnation_margin) * h1


@dataclass
class Verdict:
    """The classifier's answer.

    Attributes:
        mode: ``healthy``, ``stagnation``, ``instability`` or ``degradation``.
        step: optimiser step where the failure began (spike onset, plateau start, first
            step of the slow streak, first non-finite loss); for ``healthy`` the last step seen.
        evidence: numbers behind the decision (losses in nats, LRs absolute, steps).
    """

    mode: str
    step: int
    evidence: dict = field(default_factory=dict)

    @property
    def diverged(self) -> bool:
        return self.mode != HEALTHY

    def to_dict(self) -> dict:
        """Plain dict (JSON-safe: non-finite numbers become strings)."""
        ev = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in self.evidence.items()}
        return {"mode": self.mode, "step": self.step, "evidence": ev}

    @classmethod
    def from_dict(cls, d: dict) -> Verdict:
        return cls(d["mode"], int(d["step"]), dict(d.get("evidence", {})))

    def summary(self) -> str:
        """One line, e.g. ``instability from step 412: loss 7.81 vs baseline 4.02, not back within 50 steps``."""
        e = self.evidence
        if self.mode == HEALTHY:
            return f"healthy through step {self.step}"
        if self.mode == INSTABILITY and e.get("non_finite"):
            return f"instability at step {self.step}: non-finite loss"
        if self.mode == INSTABILITY and "spike_loss" not in e:
            return f"instability at step {self.step}"
        if self.mode == INSTABILITY:
            return (f"instability from step {self.step}: loss {e['spike_loss']:.3f} vs baseline {e['baseline']:.3f}, "
                    f"not back within {int(e['open_steps'])} steps")
        if self.mode == STAGNATION and "unigram_entropy" in e:
            return (f"stagnation from step {self.step}: loss plateau at {e['baseline']:.3f} "
                    f"({int(e['plateau_steps'])} steps flat, not below the unigram level "
                    f"{e['stagnation_level']:.3f} = (1 - margin) x unigram entropy {e['unigram_entropy']:.3f})")
        if self.mode == STAGNATION:
            return (f"stagnation from step {self.step}: loss plateau at {e['baseline']:.3f} "
                    f"({int(e['plateau_steps'])} steps flat, progress {e['progress']:.3f} of "
                    f"{e['expected_progress']:.3f} expected)")
        return (f"degradation from step {self.step}: progress {e['progress']:.3f} vs reference "
                f"{e['ref_progress']:.3f} for {int(e['streak_steps'])} steps")


class _ReferenceTrack:
    """The reference curve's EMA progress ``ref_L0 - min(ema)``, read at increasing steps (amortised O(1))."""

    def __init__(self, steps: Sequence[int], losses: Sequence[float], beta: float):
        pts = [(int(s), float(v)) for s, v in zip(steps, losses) if math.isfinite(v)]
        if not pts:
            raise ValueError("reference curve has no finite loss")
        self.steps = [s for s, _ in pts]
        self.l0 = pts[0][1]
        self.progress = []
        ema = best = pts[0][1]
        for _, v in pts:
            ema = beta * ema + (1 - beta) * v
            best = min(best, ema)
            self.progress.append(self.l0 - best)
        self._i = 0

    def at(self, step: int) -> float:
        while self._i + 1 < len(self.steps) and self.steps[self._i + 1] <= step:
            self._i += 1
        return self.progress[self._i] if self.steps[self._i] <= step else 0.0


class OnlineDivergenceMonitor:
    """Step-by-step classifier, O(1) per :meth:`update` (the trainer calls it every step).

    Args:
        thresholds: :class:`Thresholds` (default: the documented defaults).
        reference: optional reference curve ``(steps, losses)`` (e.g. a healthy run of the
            same shape), which enables the degradation mode and a relative stagnation test.
        unigram_entropy: optional ``H1`` of the training tokens (nats), for the
            vocabulary-independent stagnation test (module docstring, criterion 3).

    ``update(step, loss, lr)`` returns a :class:`Verdict` the first time a failure becomes
    certain (with ``step`` = where it began, possibly earlier than the current step), and
    ``None`` otherwise, including every call after a verdict. :meth:`finalize` closes the
    curve (offline use). Raises ValueError for an empty reference.
    """

    def __init__(self, thresholds: Thresholds | None = None, reference: tuple[Sequence[int], Sequence[float]] | None = None,
                 unigram_entropy: float | None = None):
        self.t = thresholds or Thresholds()
        self.h1 = None if unigram_entropy is None else float(unigram_entropy)
        self.ref = _ReferenceTrack(reference[0], reference[1], self.t.ema_beta) if reference is not None else None
        self.verdict: Verdict | None = None
        self.n = 0
        self.last_step = 0
        self.l0 = self.ema = self.baseline = None
        self.noise = 0.0
        self.prev_lr: float | None = None
        # open spike: (onset step, frozen baseline, margin, spike loss, lr at onset, lr before)
        self.spike: tuple | None = None
        self.spike_low_run = 0
        self.blowup_run = 0
        self.anchor = None  # baseline at the last improvement
        self.improve_step = 0
        self.improve_lrs = (None, None)
        self.streak_start: int | None = None
        self.streak_lrs = (None, None)

    @staticmethod
    def _lrs(evidence: dict, lr_at, lr_before) -> dict:
        if lr_at is not None:
            evidence["lr_at_step"] = float(lr_at)
        if lr_before is not None:
            evidence["lr_before_step"] = float(lr_before)
        return evidence

    def _fire(self, mode: str, step: int, evidence: dict) -> Verdict:
        self.verdict = Verdict(mode, int(step), evidence)
        return self.verdict

    def update(self, step: int, loss: float, lr: float | None = None) -> Verdict | None:
        """Feed the loss (nats/token) of optimiser step ``step`` and its LR; see the class doc."""
        if self.verdict is not None:
            return None
        loss = float(loss)
        lr_before, self.prev_lr = self.prev_lr, (None if lr is None else float(lr))
        self.last_step = step
        if not math.isfinite(loss):
            ev = {"non_finite": 1.0}
            if self.baseline is not None:
                ev["baseline"] = self.baseline
            return self._fire(INSTABILITY, step, self._lrs(ev, lr, lr_before))
        self.n += 1
        if self.ema is None:
            self.l0 = self.ema = self.baseline = self.anchor = loss
            self.improve_step = step
            self.improve_lrs = (lr, lr_before)
            return None
        verdict = self._track_spikes(step, loss, lr, lr_before)
        if verdict is not None or self.spike is not None:
            return verdict
        return self._judge_progress(step, lr, lr_before)

    def _track_spikes(self, step: int, loss: float, lr, lr_before) -> Verdict | None:
        """Open, close or decide a loss spike (against the baseline before this step), then
        update the EMA, the noise level and the baseline."""
        t = self.t
        if self.spike is None:
            noise = self.noise if self.n > t.warmup_steps else 0.0
            margin = max(t.spike_abs, t.spike_rel * self.baseline, t.spike_noise * noise)
            if loss > self.baseline + margin:
                self.spike = (step, self.baseline, margin, loss, lr, lr_before)
                self.spike_low_run = self.blowup_run = 0
        if self.spike is not None:
            onset, base0, margin0, spike_loss, lr_on, lr_prev = self.spike
            self.spike = (onset, base0, margin0, max(spike_loss, loss), lr_on, lr_prev)
            self.spike_low_run = self.spike_low_run + 1 if loss <= base0 + t.recover_frac * margin0 else 0
            self.blowup_run = self.blowup_run + 1 if loss > t.blowup_factor * self.l0 else 0
            if self.spike_low_run >= t.recover_steps:
                self.spike = None
            elif step - onset >= t.recovery_window or self.blowup_run >= t.blowup_steps:
                return self._spike_verdict()
        else:
            self.noise = t.ema_beta * self.noise + (1 - t.ema_beta) * abs(loss - self.ema)
        self.ema = t.ema_beta * self.ema + (1 - t.ema_beta) * loss
        self.baseline = min(self.baseline, self.ema)
        if self.baseline < self.anchor - t.plateau_tol * (self.l0 - self.anchor):
            self.anchor, self.improve_step, self.improve_lrs = self.baseline, step, (lr, lr_before)
        return None

    def _judge_progress(self, step: int, lr, lr_before) -> Verdict | None:
        """Stagnation (a plateau while behind) or degradation (slow against the reference)."""
        t = self.t
        # 3. behind what was expected?
        progress = self.l0 - self.baseline
        behind = False  # behind the reference (degradation and stagnation)
        expected = t.min_progress * self.l0
        if self.ref is not None:
            ref_p = self.ref.at(step)
            expected = t.behind_frac * ref_p
            behind = ref_p >= t.min_ref_progress * self.ref.l0 and progress < expected
        level = t.plateau_level(self.h1)
        if level is not None:
            on_plateau = self.baseline >= level
            if on_plateau and self.ref is not None and self.ref.l0 - self.ref.at(step) >= level:
                on_plateau = False  # the reference is on the plateau at this step too: as expected
            stuck = behind or on_plateau
        else:
            stuck = behind if self.ref is not None else progress < expected
        # 4. plateau while behind -> stagnation
        flat = step - self.improve_step
        if stuck and flat >= t.plateau_steps:
            ev = {"baseline": self.baseline, "l0": self.l0, "progress": progress, "expected_progress": expected,
                  "plateau_steps": float(flat)}
            if level is not None and on_plateau:
                ev.update(unigram_entropy=self.h1, stagnation_level=level)
            return self._fire(STAGNATION, self.improve_step, self._lrs(ev, *self.improve_lrs))
        # 5. slow but moving, against a reference -> degradation
        if not behind:
            self.streak_start = None
            return None
        if self.streak_start is None:
            self.streak_start, self.streak_lrs = step, (lr, lr_before)
        if step - self.streak_start + 1 >= t.degrade_steps:
            ev = {"baseline": self.baseline, "progress": progress, "ref_progress": self.ref.at(step),
                  "streak_steps": float(step - self.streak_start + 1)}
            return self._fire(DEGRADATION, self.streak_start, self._lrs(ev, *self.streak_lrs))
        return None

    def _spike_verdict(self) -> Verdict:
        onset, base0, margin0, spike_loss, lr_on, lr_prev = self.spike
        ev = {"baseline": base0, "margin": margin0, "spike_loss": spike_loss,
              "open_steps": float(self.last_step - onset)}
        return self._fire(INSTABILITY, onset, self._lrs(ev, lr_on, lr_prev))

    def finalize(self) -> Verdict:
        """End of the curve: the verdict so far, or a spike still open for ``end_open_steps``
        steps (instability), else ``healthy`` at the last step seen."""
        if self.verdict is not None:
            return self.verdict
        if self.spike is not None and self.last_step - self.spike[0] + 1 >= self.t.end_open_steps:
            v = self._spike_verdict()
            v.evidence["open_at_end"] = 1.0
            return v
        ev = {}
        if self.baseline is not None:
            ev = {"baseline": self.baseline, "l0": self.l0, "progress": self.l0 - self.baseline}
        return Verdict(HEALTHY, int(self.last_step), ev)


def classify(steps: Sequence[int], losses: Sequence[float], lrs: Sequence[float] | None = None,
             reference: tuple[Sequence[int], Sequence[float]] | None = None,
             thresholds: Thresholds | None = None, unigram_entropy: float | None = None) -> Verdict:
    """Classify a whole loss curve (see the module docstring for the criteria).

    Args:
        steps: increasing optimiser steps (ints), same length as ``losses``.
        losses: training loss per step, nats/token; NaN/inf allowed (-> instability there).
        lrs: optional learning rate per step (absolute); reported in the evidence.
        reference: optional ``(steps, losses)`` of a reference run (enables degradation).
        thresholds: :class:`Thresholds`; default the documented values.
        unigram_entropy: optional unigram entropy of the training tokens (nats), for the
            stagnation test (module docstring, criterion 3).
    Returns:
        :class:`Verdict` (``healthy`` at the last step when nothing failed; step 0 for an
        empty curve).
    Raises:
        ValueError: ``steps``/``losses``/``lrs`` of different lengths, ``steps`` not increasing, or an
            empty reference.
    """
    if len(steps) != len(losses) or (lrs is not None and len(lrs) != len(steps)):
        raise ValueError("steps, losses and lrs must have the same length")
    back = next((i for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), None)
    if back is not None:  # a spike's length, a plateau's patience and the reference are read in steps
        raise ValueError(f"steps must increase: step {steps[back]} (position {back}) follows step {steps[back - 1]}")
    mon = OnlineDivergenceMonitor(thresholds, reference, unigram_entropy)
    for i, (s, v) in enumerate(zip(steps, losses)):
        if mon.update(int(s), v, None if lrs is None else lrs[i]) is not None:
            break
    return mon.finalize()


def classify_metrics(records: Iterable[dict], reference: Iterable[dict] | None = None,
                     thresholds: Thresholds | None = None, unigram_entropy: float | None = None) -> Verdict:
    """:func:`classify` on the records of a run's ``metrics.jsonl`` (``step``, ``loss``, ``lr``).

    Records without a ``loss`` (the step-0 evaluation) are ignored; a skipped non-finite
    step keeps its non-finite loss and so counts as instability.
    """
    recs = [r for r in records if "loss" in r]
    ref = reference_curve(reference) if reference is not None else None
    return classify([r["step"] for r in recs], [float(r["loss"]) for r in recs],
                    [r.get("lr", float("nan")) for r in recs], reference=ref, thresholds=thresholds,
                    unigram_entropy=unigram_entropy)


def reference_curve(records: Iterable[dict]) -> tuple[list[int], list[float]]:
    """``(steps, losses)`` of the training-loss records (``step``, ``loss``) of a run's
    ``metrics.jsonl``: the reference curve of :class:`OnlineDivergenceMonitor`. A ``null`` loss (how the
    trainer writes a non-finite one; :func:`keel.train.metrics.read_metrics` reads it so too) is NaN."""
    rr = [r for r in records if "loss" in r]
    return [int(r["step"]) for r in rr], [math.nan if r["loss"] is None else float(r["loss"]) for r in rr]


def read_reference(run_dir: str | Path) -> tuple[list[int], list[float]]:
    """The reference curve of the run in ``run_dir`` (its ``metrics.jsonl``).

    Raises:
        KeelError: no ``metrics.jsonl`` there, or no finite training loss in it.
    """
    path = RunDir(run_dir).metrics
    if not path.is_file():
        raise KeelError(f"divergence reference {run_dir} is not a run directory (no {RunDir.METRICS})")
    try:
        records = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    except ValueError as e:
        raise KeelError(f"cannot read {path}: {e}") from None
    steps, losses = reference_curve(records)
    if not any(math.isfinite(v) for v in losses):
        raise KeelError(f"divergence reference {run_dir} has no finite training loss")
    return steps, losses


def build_monitor(reference_dir: str | Path | None = None, unigram_entropy: float | None = None,
                  thresholds: Thresholds | None = None) -> OnlineDivergenceMonitor:
    """The online monitor of a training run (the trainer's divergence hook).

    Args:
        reference_dir: ``train.divergence_reference``: a finished run whose training-loss
            curve is the reference (enables degradation), or None / ``""`` for none.
        unigram_entropy: ``H1`` of the run's training tokens (nats), e.g.
            :func:`keel.data.stats.dataset_unigram_entropy` of its dataset; None disables the
            unigram stagnation test.
        thresholds: :class:`Thresholds` (default: the documented ones).
    Returns:
        An :class:`OnlineDivergenceMonitor`. For the online verdict to equal the offline one
        (:func:`classify_metrics` on the logged records), feed it every step (non-finite
        losses included) and call ``finalize()`` after the last step.
    Raises:
        KeelError: see :func:`read_reference`.
    """
    ref = read_reference(reference_dir) if reference_dir not in (None, "") else None
    return OnlineDivergenceMonitor(thresholds, ref, unigram_entropy)


def run_verdict(records: Sequence[dict], reference: Iterable[dict] | None = None,
                unigram_entropy: float | None = None, stopped: str | None = None,
                thresholds: Thresholds | None = None) -> Verdict:
    """The verdict of a finished (or stopped) training run, in the classifier's vocabulary
    (``healthy``, ``stagnation``, ``instability``, ``degradation``): the one verdict that
    ``keel sweep``, ``keel stress`` and ``keel lr-sensitivity`` report.

    :func:`classify_metrics` on the run's ``metrics.jsonl`` records (with the reference
    run's records and the unigram entropy, when given), except that a run cannot be
    ``healthy`` if it was ``stopped`` by the trainer (then: its logged online verdict, else
    ``instability`` at its last step) or if a validation loss was non-finite
    (``instability`` at that step, ``evidence["non_finite"] = 1``).

    Args:
        records: the run's metrics records (``step``, ``loss``, ``lr``, ``val_loss``, ``divergence``).
        reference: the reference run's records, or None.
        unigram_entropy: nats, or None.
        stopped: the trainer's stop message (``TrainingStopped``), or None.
    """
    v = classify_metrics(records, reference, thresholds, unigram_entropy)
    if v.diverged:
        return v
    bad_val = [r for r in records if "val_loss" in r and not math.isfinite(r["val_loss"])]
    if bad_val:
        return Verdict(INSTABILITY, int(bad_val[0]["step"]), {"non_finite": 1.0})
    if stopped:
        logged = [r["divergence"] for r in records if "divergence" in r]
        last = max((int(r["step"]) for r in records if "step" in r), default=0)
        return Verdict.from_dict(logged[0]) if logged else Verdict(INSTABILITY, last, {})
    return v
