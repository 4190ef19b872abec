"""The diagnostics as training callbacks (:class:`keel.train.Callback`): the online
divergence monitor and per-sub-layer gradient-norm logging. ``keel.experiments.training``
attaches them to a run according to its config."""

from __future__ import annotations

import logging

from keel.data.stats import dataset_unigram_entropy
from keel.diagnostics.divergence import HEALTHY, build_monitor, read_reference
from keel.diagnostics.gradflow import sublayer_grad_norms
from keel.train.callbacks import Callback, StepState
from keel.train.trainer import TrainingStopped

log = logging.getLogger(__name__)


class DivergenceCallback(Callback):
    """Feeds every step's loss and LR (non-finite losses included) to the run's
    :class:`keel.diagnostics.divergence.OnlineDivergenceMonitor`, built at the start by
    :func:`keel.diagnostics.divergence.build_monitor` with the reference run (if any) and the
    unigram entropy of the run's training tokens; so the online verdict equals the offline
    one on the logged curve. The first verdict is logged as a warning and written as the
    step's ``divergence`` field; with ``stop`` the run then stops
    (``train.stop_on_divergence``). At the end of the run (:meth:`on_train_end`) the
    monitor's :meth:`~keel.diagnostics.divergence.OnlineDivergenceMonitor.finalize` reports a
    spike still open at the last step the same way. On resume the logged history is replayed first.

    Args:
        reference_dir: ``train.divergence_reference`` (a finished run), or "" for none.
        stop: stop the run at the verdict.
    Raises:
        KeelError: ``reference_dir`` is not a run with a finite training loss
            (:func:`keel.diagnostics.divergence.read_reference`), here, before the run folder is made.
    """

    config_keys = ("train.stop_on_divergence", "train.divergence_warnings", "train.divergence_reference")

    def __init__(self, reference_dir: str = "", stop: bool = False):
        self.reference_dir, self.stop, self.monitor = reference_dir, stop, None
        if reference_dir:  # a bad reference: refused now, not after the run's folder and step-0 eval
            read_reference(reference_dir)

    def on_train_start(self, state: StepState) -> None:
        entropy = dataset_unigram_entropy(state.data_dir) if state.data_dir is not None else None
        self.monitor = build_monitor(self.reference_dir or None, entropy)
        for r in state.history:
            if "loss" in r and r["step"] <= state.step:
                loss = r["loss"] if r["loss"] is not None else float("nan")  # null: a non-finite loss
                verdict = self.monitor.update(r["step"], loss, r.get("lr"))
                if verdict is not None and self.stop:
                    raise TrainingStopped(f"already diverged before step {state.step}: {verdict.summary()} "
                                          "(train.stop_on_divergence)")

    def on_step_end(self, state: StepState) -> dict | None:
        verdict = self.monitor.update(state.step, state.loss, state.lr)  # same inputs on every rank
        if verdict is None:
            return None
        if state.dist.is_main:
            log.warning("step %d: divergence detected: %s", state.step, verdict.summary())
        if self.stop:
            state.stop = f"{verdict.summary()} (train.stop_on_divergence)"
        return {"divergence": verdict.to_dict()}

    def on_train_end(self, state: StepState) -> dict | None:
        """A loss spike still open at the last step (``end_open_steps`` long) is a divergence
        (what the offline :func:`keel.diagnostics.divergence.classify` says of the curve): log
        it and return it as a ``divergence`` field. None when a verdict came earlier (it is
        already in the metrics) or the curve ends healthy."""
        if self.monitor.verdict is not None:
            return None
        verdict = self.monitor.finalize()
        if verdict.mode == HEALTHY:
            return None
        if state.dist.is_main:
            log.warning("step %d: divergence detected at the end of the run: %s", state.step, verdict.summary())
        return {"divergence": verdict.to_dict()}


class GradflowCallback(Callback):
    """Every ``every`` steps, logs ``sublayer_grad_norm``: the per-sub-layer parameter
    gradient norms before clipping (:func:`keel.diagnostics.gradflow.sublayer_grad_norms`,
    one float per sub-layer, paper order)."""

    config_keys = ("train.gradflow_every",)

    def __init__(self, every: int):
        self.every = every

    def on_gradients(self, state: StepState) -> dict | None:
        if self.every and (state.step + 1) % self.every == 0:
            return {"sublayer_grad_norm": sublayer_grad_norms(state.model)}
        return None
