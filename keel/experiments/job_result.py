"""A grid job's result, :class:`JobResult`: what :func:`keel.experiments.grid.run_grid` returns for
each job and stores as the job's ``result.json`` (the task's output with the grid's ``name``,
``values``, ``status`` and ``wall_s``; a failed job's ``status = "error"`` and ``message``), and what
a sweep's ``sweep.json`` and a stress test's ``stress.json`` list as their ``runs``. Declared once:
:data:`RESULT_KEYS` (the check of each key the reports compute with, :func:`check_result`) and the
attributes readers use (:meth:`JobResult.from_dict`; :meth:`JobResult.to_dict` is the content as it
was, key order kept, so every file written from it keeps its bytes).

A result is not a run's record (:class:`keel.experiments.record.RunRecord`, a study report's row):
a grid knows nothing of what its task does, a result keeps every key its task returned (a sweep's
``best_val_loss``, ``params`` ...), and a study reads the records it needs from it
(:func:`keel.experiments.study.records.run_record`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from keel.errors import KeelError


def is_number(x) -> bool:
    """True for an int or float that is not a bool (TOML/JSON ``true`` is not a number here)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _loss_or_null(x) -> bool:
    return x is None or (is_number(x) and not x < 0)  # NaN / inf: a diverged run's loss


def _count_or_null(x) -> bool:
    return x is None or (isinstance(x, int) and not isinstance(x, bool) and x >= 0)


# result.json, declared: key -> (check, what is expected). A key present is checked (a task may
# add keys of its own); these are the ones the reports of sweep, stress, lr-sensitivity and study
# compute with, where a wrong shape was a TypeError deep in a report.
RESULT_KEYS: dict[str, tuple[Callable[[object], bool], str]] = {
    "name": (lambda x: isinstance(x, str), "text"),
    "status": (lambda x: x in ("done", "error"), '"done" or "error"'),
    "values": (lambda x: isinstance(x, dict), "a table of the job's config values"),
    **{k: (_loss_or_null, "a loss >= 0 (nats/token) or null")
       for k in ("final_val_loss", "best_val_loss", "first_val_loss", "unigram_entropy")},
    **{k: (_count_or_null, "an integer >= 0 or null")
       for k in ("step", "steps", "tokens", "planned_tokens", "params", "non_embedding_params", "blocks", "sublayers")},
    **{k: (lambda x: x is None or (is_number(x) and x >= 0), "a number >= 0 or null")
       for k in ("elapsed_s", "wall_s", "max_lr")},
    "divergence": (lambda x: x is None or isinstance(x, dict), "a divergence verdict (a table) or null"),
    "diverged": (lambda x: x is None or isinstance(x, bool), "true, false or null"),
    "verdict": (lambda x: x is None or isinstance(x, str), "text or null"),
}


def check_result(path: str | Path, result) -> dict:
    """``result`` (the content of ``path``, a ``result.json``) if it has the declared shape
    (:data:`RESULT_KEYS`).

    Raises:
        KeelError: one line naming the file, the key and what was expected.
    """
    fix = "; delete the file to run the job again"
    if not isinstance(result, dict):
        raise KeelError(f"{path}: a job's result must be a JSON object, got {json.dumps(result)[:60]}{fix}")
    for key, (ok, expected) in RESULT_KEYS.items():
        if key in result and not ok(result[key]):
            raise KeelError(f"{path}: {key} must be {expected}, got {json.dumps(result[key])[:60]}{fix}")
    return result


def failed_result(name: str, message: str, wall_s: float = 0.0, values: dict | None = None) -> dict:
    """The result of a job that failed: ``{"name", "values" (where given), "status": "error",
    "message", "wall_s"}`` (``message``: one line on why; ``wall_s``: seconds it ran). The one
    place a failed job's result is spelled (the grid's task error and lost worker, the executor's
    killed or failed job)."""
    return {"name": name, **({} if values is None else {"values": values}), "status": "error", "message": message,
            "wall_s": wall_s}


@dataclass(frozen=True, eq=False)
class JobResult:
    """One grid job's result, read: the keys its readers use as attributes (the default where the
    result lacks the key), the whole content in :attr:`data`.

    The grid's keys: ``name``, ``values`` (the job's grid values), ``status`` (``done`` / ``error``;
    None where absent), ``message`` (why a job failed; ``""`` where absent), ``note`` (shown on the
    grid's progress line), ``wall_s`` (seconds in the task). A training task's (a run's summary,
    :func:`keel.experiments.sweep.run_summary`): ``step``, ``tokens``, ``params``,
    ``non_embedding_params``, ``sublayers``, ``final_val_loss``, ``best_val_loss``,
    ``first_val_loss`` (nats/token), ``unigram_entropy``, ``verdict``, ``divergence``, ``diverged``;
    a stress run's ``scheme`` and ``max_lr``; a study task's ``ablation`` and ``test_loops``.
    """

    data: Mapping = field(default_factory=dict, repr=False)
    name: str = ""
    values: dict = field(default_factory=dict)
    status: str | None = None
    message: str = ""
    note: str | None = None
    wall_s: float | None = None
    step: int | None = None
    tokens: int | None = None
    params: int | None = None
    non_embedding_params: int | None = None
    scheme: str | None = None
    sublayers: int | None = None
    final_val_loss: float | None = None
    best_val_loss: float | None = None
    first_val_loss: float | None = None
    unigram_entropy: float | None = None
    verdict: str | None = None
    divergence: dict | None = None
    diverged: bool | None = None
    max_lr: float | None = None
    ablation: dict | None = None
    test_loops: dict | None = None

    @classmethod
    def from_dict(cls, d: Mapping, where: str | Path | None = None) -> JobResult:
        """The result whose content is ``d``; with ``where`` (the file it was read from), checked first
        (:func:`check_result`, which raises KeelError)."""
        if where is not None:
            check_result(where, d)
        return cls(data=d, **{k: d[k] for k in _ATTRIBUTES if k in d})

    @property
    def done(self) -> bool:
        """The job finished (``status = "done"``)."""
        return self.status == "done"

    def to_dict(self) -> Mapping:
        """The result's content, as it was read (every key, in its order)."""
        return self.data


_ATTRIBUTES = tuple(f.name for f in dataclasses.fields(JobResult) if f.name != "data")
