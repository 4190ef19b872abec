"""The diagnostics as training callbacks (:class:`keel.train.Callback`): the online
divergence monitor and per-sub-layer gradient-norm logging. ``keel.experiments.training``
attaches them to a run according to its config."""

from __future__ import annotations

import logging

from keel.train.callbacks import Callback, StepState
from keel.train.trainer import TrainingStopped

log = logging.getLogger(__name__)


class DivergenceCallback(Callback):
    """Feeds every applied step's loss and LR to an
    :class:`keel.diagnostics.divergence.OnlineDivergenceMonitor`; the first verdict is
    logged as a warning and written as the step's ``divergence`` field. With ``stop`` the
    run then stops (``train.stop_on_divergence``). On resume the logged history is replayed
    through the monitor first, so the verdict does not depend on where a run was resumed.

    Args:
        monitor: the monitor to feed (built by the caller, with its reference curve if any).
        stop: stop the run at the verdict.
    """

    def __init__(self, monitor, stop: bool = False):
        self.monitor, self.stop = monitor, stop

    def on_train_start(self, state: StepState) -> None:
        for r in state.history:
            if r.get("loss") is not None and not r.get("skipped") and r["step"] <= state.step:
                verdict = self.monitor.update(r["step"], r["loss"], r["lr"])
                if verdict is not None and self.stop:
                    raise TrainingStopped(f"already diverged before step {state.step}: {verdict.summary()} "
                                          "(train.stop_on_divergence)")

    def on_step_end(self, state: StepState) -> dict | None:
        if not state.finite:
            return None
        verdict = self.monitor.update(state.step, state.loss, state.lr)  # same inputs on every rank
        if verdict is None:
            return None
        if state.dist.is_main:
            log.warning("step %d: divergence detected: %s", state.step, verdict.summary())
        if self.stop:
            state.stop = f"{verdict.summary()} (train.stop_on_divergence)"
        return {"divergence": verdict.to_dict()}


class GradflowCallback(Callback):
    """Every ``every`` steps, logs ``sublayer_grad_norm``: the per-sub-layer parameter
    gradient norms before clipping (:func:`keel.diagnostics.gradflow.sublayer_grad_norms`,
    one float per sub-layer, paper order)."""

    def __init__(self, every: int):
        self.every = every

    def on_gradients(self, state: StepState) -> dict | None:
        from keel.diagnostics.gradflow import sublayer_grad_norms

        if self.every and (state.step + 1) % self.every == 0:
            return {"sublayer_grad_norm": sublayer_grad_norms(state.model)}
        return None
