"""The tasks of a study group that measures its final models after training: ``ablate = true``
(the layer importance, claim (g), paper Appendix A) and ``test_loops`` (a looped model's validation
loss at other loop counts: test-time depth); each keeps its numbers in the run's result."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from keel.config import config_from_dict
from keel.data import validation_tokens
from keel.diagnostics.ablate import ablate_run
from keel.experiments.grid import GridJob
from keel.experiments.job_result import JobResult
from keel.experiments.sweep import train_task
from keel.run import Run
from keel.train.device import autocast_context
from keel.train.nll import eval_batch_size, mean_nll


def train_and_ablate(job: GridJob, run_dir: Path, resume: bool) -> dict:
    """:func:`keel.experiments.sweep.train_task`, then, for a run that reached its last step,
    ``ablation``: ``{"tokens", "seq_len", "ppl_full", "delta_ppl": [ΔPPL_0, ..., ΔPPL_{L-1}]}``,
    ΔPPL_i = PPL(model without sub-layer i) − PPL(full model) on the first ``train.eval_tokens``
    validation tokens (the ones its validation loss reads) in windows of the run's
    ``train.seq_len`` (Keel paper, Appendix A; :func:`keel.diagnostics.ablate.ablate_run`, which
    says what removing a sub-layer means for each scheme). A run stopped early (diverged) has no
    ablation. Raises what ``train_task`` and ``ablate_run`` raise."""
    out = train_task(job, run_dir, resume)
    if JobResult.from_dict(out).final_val_loss is not None:
        train = config_from_dict(job.config).train
        tokens = max(train.eval_tokens, train.seq_len)  # one window at least, as its val_loss reads
        res = ablate_run(run_dir, tokens=tokens)
        out["ablation"] = {"tokens": res.get("tokens", tokens), "seq_len": res.get("seq_len"),
                           "ppl_full": res["ppl_full"], "delta_ppl": [u["delta_ppl"] for u in res["units"]]}
    return out


def train_and_test_loops(job: GridJob, run_dir: Path, resume: bool, factors: Sequence[float] = ()) -> dict:
    """:func:`keel.experiments.sweep.train_task`, then, for a looped run that reached its last step,
    ``test_loops``: ``{str(R'): loss}`` with R' = round(f R) for each factor f of ``factors`` (R =
    ``model.loop_repeats``): the final model's mean validation loss (nats/token) with its core applied R'
    times (:meth:`keel.model.Transformer.set_loops`; its depth constants stay those of R), by the one loss
    evaluator (:func:`keel.train.nll.mean_nll`) on the windows, batch and precision of the run's
    ``val_loss`` (the first ``train.eval_tokens`` validation tokens in ``train.seq_len`` windows,
    :func:`keel.train.nll.eval_batch_size`), so that loss(R') − final_val_loss is the effect of the count
    alone. A non-finite loss is kept as null. A run stopped early (diverged) has none.
    Raises what ``train_task`` and :meth:`keel.run.Run.load_model` raise."""
    out = train_task(job, run_dir, resume)
    if JobResult.from_dict(out).final_val_loss is None:
        return out
    cfg = config_from_dict(job.config)
    tc, model = cfg.train, Run(run_dir).load_model(device=cfg.train.device)
    device = next(model.parameters()).device
    windows = validation_tokens(Run(run_dir).data_dir(), tc.seq_len, tc.eval_tokens)
    losses = {}
    for n in dict.fromkeys(round(f * cfg.model.loop_repeats) for f in factors):
        model.set_loops(n)
        loss = mean_nll(model, windows, eval_batch_size(tc.batch_size, tc.seq_len, tc.eval_batch_tokens), device,
                        autocast_context(device, tc.precision))
        losses[str(n)] = loss if math.isfinite(loss) else None
    out["test_loops"] = losses
    return out
