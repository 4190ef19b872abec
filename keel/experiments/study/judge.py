"""Judge a study's claims on its run records (:func:`judge`, the loss floor :func:`study_floor`) and write
its report: ``report.json``'s content (:func:`report_json`), ``report.md`` and the PNGs (:func:`write_report`)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from keel.config import override_text
from keel.experiments.analysis import LossFloor
from keel.experiments.record import RunRecord
from keel.experiments.study.claims import Claim
from keel.experiments.study.report import (claim_summary, group_tables, report_markdown, superseded_words,
                                          write_plots)
from keel.experiments.study.spec import Study
from keel.experiments.study.verdicts import LEVEL, ClaimVerdict, baseline_margins, loss_floor
from keel.io import atomic_write_text, make_dirs


def report_json(study: Study, runs: list[RunRecord], claims: list[tuple[Claim, ClaimVerdict]], floor: LossFloor,
                h1: float | None, command: str, restore, plots: list[str]) -> dict:
    """The content of ``report.json`` (see :func:`keel.experiments.study.run.execute`'s Returns)."""
    return {"study": study.name, "scale": study.scale, "note": study.note, "command": command,
            "sets": [override_text(x) for x in study.all_sets()],
            "unigram_entropy": h1, "min_effect": study.min_effect, "min_seeds": study.min_seeds,
            "floor": floor.to_dict(), "level": LEVEL, "summary": [c.summary for _, c in claims],
            "claims": [{"id": cl.id, "title": cl.title, **c.to_dict()} for cl, c in claims],
            "baseline_margins": [{"group": g.name, **r.to_dict()} for g in study.groups
                                 for r in baseline_margins(study, g, runs)],
            "group_sets": {g.name: [override_text(x) for x in g.sets] for g in study.groups},
            "restored_from": str(restore) if any(r.restored for r in runs) else None,
            "runs": [r.to_dict() for r in runs], "plots": plots}


def judge(study: Study, runs: list[RunRecord]) -> tuple[Study, LossFloor, list[tuple[Claim, ClaimVerdict]]]:
    """``(study with its floor as min_effect, the floor (:func:`study_floor`), [(claim, its
    verdict with its summary line)])``: every claim judged on ``runs``."""
    floor = study_floor(study, runs)
    study = replace(study, min_effect=floor.floor)
    claims = [(cl, cl.verdict(study, runs)) for cl in study.claims]
    for cl, c in claims:
        c.summary = claim_summary(cl, c)
    return study, floor, claims


def study_floor(study: Study, runs: list[RunRecord]) -> LossFloor:
    """The loss claims' noise floor (:func:`keel.experiments.study.verdicts.loss_floor`) over every
    (group, scheme, depth) cell a claim names (:meth:`Claim.floor_cells`: those a margin claim
    reads), each init's groups apart; with
    ``floor_from_spread`` false, ``study.min_effect`` as it is (a :class:`LossFloor` of ``floor`` and
    ``minimum`` only)."""
    if not study.floor_from_spread:
        return LossFloor(floor=study.min_effect, minimum=study.min_effect, stored=("floor", "minimum"))
    cells = [cell for c in study.claims for cell in c.floor_cells(study)]
    return loss_floor(runs, list(dict.fromkeys(cells)), study.min_effect)


def write_report(study: Study, runs: list[dict], out: Path, h1: float | None, command: str,
                 restore: str | Path | None, superseded: list[RunRecord], waiting: list[dict]) -> dict:
    """Judge the claims (:func:`judge`) and write ``report.json``, ``report.md`` and the PNGs into
    ``out`` (each atomically); returns the report (``report.json``'s content plus ``waiting`` and
    ``records``, every run record with its result).
    ``h1``: the training tokens' unigram entropy (nats), the plateau level of the tables."""
    study, floor, claims = judge(study, runs)
    make_dirs(out)
    plots = write_plots(study, runs, claims, out, h1)
    report = report_json(study, runs, claims, floor, h1, command, restore, plots)
    report["superseded_runs"] = list({(r.group, r.name): r.to_dict() for r in superseded}.values())
    tables = group_tables(study, runs, out, h1)
    if tables:  # a study without a grid group or a group asking for its table: report.json as it was
        report["group_tables"] = tables
    atomic_write_text(out / "report.json", json.dumps(report, indent=1, default=str))
    report["waiting"] = waiting
    report["records"] = runs  # with each run's result (report.json leaves those out)
    atomic_write_text(out / "report.md", report_markdown(study, claims, runs, command, waiting, restore, floor, tables)
                      + superseded_words(report["superseded_runs"]))
    return report
