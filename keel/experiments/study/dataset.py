"""A study's shared dataset: prepared once, before any run starts, with every planned run's
``model.vocab_size`` checked against its tokenizer (:func:`study_dataset`); or only checked, for
``--dry-run`` (:func:`check_study_data`)."""

from __future__ import annotations

import json
from collections.abc import Sequence

from keel.config import Config, config_from_dict, resolve_vocab_size
from keel.data import check_data, read_meta, resolve_data
from keel.errors import KeelError
from keel.experiments.grid import GridJob
from keel.experiments.study.spec import Group, Study

NO_DATA = "<data>"  # the data.path of a planned run on the shared dataset before it is prepared

Planned = Sequence[tuple[Group, list[GridJob], list[GridJob]]]  # (group, reference jobs, jobs) per group


def shares_data(study: Study, report_only: bool) -> bool:
    """Whether the runs of ``study`` need the one dataset its config names: not for a report
    (it trains nothing), nor when every group is a grid over ``data.*`` keys (each run prepares its own)."""
    return not report_only and not all(g.kind_class.own_data(g) for g in study.groups)


def study_dataset(base: Config, planned: Planned) -> str:
    """Prepare (or find) the dataset ``base`` names (:func:`keel.data.resolve_data`) and check every
    planned run on it (``planned``: planned with ``data.path`` :data:`NO_DATA`) against its
    tokenizer's vocabulary, so that none of them fails on it later; return its folder.

    Raises:
        KeelError: preparing fails; a run's ``model.vocab_size`` is smaller than the tokenizer's
            vocabulary (:func:`keel.config.resolve_vocab_size`; the message names the run).
    """
    data_dir = str(resolve_data(base, progress=False))
    vocab = read_meta(data_dir)["vocab_size"]
    for g, refs, jobs in planned:
        for job in (*refs, *jobs):
            model = job.config.get("model", {})
            if job.config.get("data", {}).get("path") != NO_DATA or model.get("vocab_size", "auto") == "auto":
                continue
            try:
                resolve_vocab_size(model["vocab_size"], vocab, model.get("vocab_multiple", 64))
            except KeelError as e:
                raise KeelError(f"group {g.name}, run {job.name}: {e}") from None
    return data_dir


def check_study_data(study: Study, base: Config, planned: Planned) -> None:
    """For ``--dry-run``: what can be checked of the datasets without preparing one
    (:func:`keel.data.check_data`): the shared one, and each that a run of a grid over ``data.*``
    keys prepares for itself.

    Raises:
        KeelError: a ``data.path`` that is not a prepared dataset, a bad tokenizer spec or source.
    """
    if shares_data(study, False):
        check_data(base)
    own = {json.dumps(j.config["data"], sort_keys=True, default=str): j.config for _, refs, jobs in planned
           for j in (*refs, *jobs) if j.config.get("data", {}).get("path") != NO_DATA}
    for config in own.values():
        check_data(config_from_dict(config))
