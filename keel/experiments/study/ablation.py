"""The task of a study group with ``ablate = true``: train the run, then measure the layer
importance of its final model (claim (g), paper Appendix A) and keep it in the run's result."""

from __future__ import annotations

from pathlib import Path

from keel.config import config_from_dict
from keel.diagnostics.ablate import ablate_run
from keel.experiments.grid import GridJob
from keel.experiments.sweep import train_task


def train_and_ablate(job: GridJob, run_dir: Path, resume: bool) -> dict:
    """:func:`keel.experiments.sweep.train_task`, then, for a run that reached its last step,
    ``ablation``: ``{"tokens", "seq_len", "ppl_full", "delta_ppl": [ΔPPL_0, ..., ΔPPL_{L-1}]}``,
    ΔPPL_i = PPL(model without sub-layer i) − PPL(full model) on the first ``train.eval_tokens``
    validation tokens (the ones its validation loss reads) in windows of the run's
    ``train.seq_len`` (Keel paper, Appendix A; :func:`keel.diagnostics.ablate.ablate_run`, which
    says what removing a sub-layer means for each scheme). A run stopped early (diverged) has no
    ablation. Raises what ``train_task`` and ``ablate_run`` raise."""
    out = train_task(job, run_dir, resume)
    if out.get("final_val_loss") is not None:
        tokens = config_from_dict(job.config).train.eval_tokens
        res = ablate_run(run_dir, tokens=tokens)
        out["ablation"] = {"tokens": res.get("tokens", tokens), "seq_len": res.get("seq_len"),
                           "ppl_full": res["ppl_full"], "delta_ppl": [u["delta_ppl"] for u in res["units"]]}
    return out
