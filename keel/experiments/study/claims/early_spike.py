"""Claim kind ``early_spike``: at the LRs where a scheme trains healthily, a baseline spikes early and
the scheme does not (Keel paper Figure 1a, Figure 4)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from keel.experiments.analysis import Runs, paired_verdict
from keel.experiments.record import RunRecord
from keel.experiments.study.claims.base import OneGroup, Paired
from keel.experiments.study.spec import Study
from keel.experiments.study.verdicts import ClaimVerdict, settled
from keel.experiments.table import markdown_table


@dataclass(kw_only=True)
class EarlySpike(Paired, OneGroup):
    """The keys of an ``early_spike`` claim (``group``: a train group whose runs read every step's loss,
    trained by this version), its verdict and table."""

    kind: ClassVar[str] = "early_spike"
    unit: ClassVar[str] = "nats/token"


    def verdict(self, study: Study, runs: Runs) -> ClaimVerdict:
        """At the LRs where {scheme} trains healthily, {baseline} spikes early and {scheme} does not:
        {baseline}'s largest early spike exceeds {scheme}'s. A run's spike is the largest rise of its
        10-step trailing-mean training loss over its earlier minimum in its early phase (the first
        half of the run, at most its first 1,000 steps; in a cpu run its LR stays above half its peak);
        per depth and seed d is the mean, over the LRs where {scheme}'s run of that seed is healthy,
        of spike({baseline}) − spike({scheme}) (nats/token).

        Per run the largest rise of the 10-step trailing-mean training loss over its earlier minimum
        in the first :func:`keel.experiments.study.records.spike_steps` steps (half the run, at most
        1,000; :func:`keel.experiments.study.records.early_spike`, nats/token; the rule was fixed
        before the spike group's runs were read, the early phase narrowed from 1,000 steps, the
        whole of a cpu run, before they were trained). Per depth and seed ``d = mean over the LRs where
        {scheme}'s run is healthy (divergence classifier) of spike(baseline) - spike(scheme)``;
        :func:`paired_verdict` with the study's loss floor. Keel paper Figure 1a/4: Pre-LN spikes at
        4.5e-3 in the first 1,000 steps at 1024 sub-layers, Keel converges smoothly."""
        s, b, g = self.scheme, self.baseline, self.group
        done = [r for r in runs if r.group == g and r.status == "done" and r.scheme in (s, b)]
        rs = [r for r in done if r.early_spike is not None]  # a run stopped before two windows has none
        seeds = sorted({r.seed for r in runs if r.group == g})
        parts, rows = {}, []
        for L in sorted({r.sublayers for r in runs if r.group == g}):
            at = {(r.scheme, r.seed, r.lr): r for r in rs if r.sublayers == L}
            parts[f"spike({b}) − spike({s}) at {L}, {s}'s healthy LRs"] = paired_verdict(
                _spike_diffs(at, seeds, s, b), study.min_effect, study.min_seeds)
            rows += _spike_rows(at, L, s, b)
        planned = sum(len(gr.scheme_seeds(x)) * len(gr.sublayers) * len(gr.lrs) for gr in study.groups if gr.name == g
                      for x in (s, b))
        if len(done) < planned:
            return ClaimVerdict.pending(f"{len(done)} of {planned} runs of group {g} ({s}, {b}) finished", parts=parts,
                                        rows=rows)
        return ClaimVerdict(verdict=settled(parts, 0, study.min_seeds), parts=parts, rows=rows)

    def tables(self, c: ClaimVerdict) -> list[str]:
        s, b = self.scheme, self.baseline
        if not c.rows:  # a header over no row read as a finished, empty table
            return [f"Pending: {c.why or 'no run of group ' + self.group + ' finished'}; no spike measured yet."]
        seeds = sorted({sd for r in c.rows for x in (s, b) for sd in r[x]})
        cell = lambda d: "[" + ", ".join(f"s{sd} pending" if sd not in d else f"s{sd} {d[sd][0]:.2f}" + (
            "" if d[sd][1] == "healthy" else f" ({d[sd][1]})") for sd in seeds) + "]"
        return ([f"Pending: {c.why}.", ""] if c.why else []) + markdown_table(
            ["sub-layers", "LR", f"largest early spike per seed (nats): {b}", s],
            [[r["sublayers"], f"{r['lr']:g}", cell(r[b]), cell(r[s])] for r in c.rows])


def _spike_diffs(at: dict[tuple, RunRecord], seeds: Sequence[int], scheme: str, baseline: str) -> dict[int, float]:
    """``{seed: d}`` of one depth of :meth:`EarlySpike.verdict` from its runs ``at`` (keyed ``(scheme, seed,
    lr)``): ``d`` the mean over the LRs where ``scheme``'s run is healthy and ``baseline`` ran too of
    spike(baseline) - spike(scheme); a seed with no such LR is left out."""
    diffs = {}
    for sd in seeds:
        ok = [lr for (x, seed, lr), r in at.items() if x == scheme and seed == sd and r.verdict == "healthy"
              and (baseline, sd, lr) in at]
        if ok:
            diffs[sd] = statistics.fmean(at[(baseline, sd, lr)].early_spike - at[(scheme, sd, lr)].early_spike
                                         for lr in ok)
    return diffs


def _spike_rows(at: dict[tuple, RunRecord], L: int, scheme: str, baseline: str) -> list[dict]:
    """The rows of one depth ``L`` of :meth:`EarlySpike.verdict`, one per LR of its runs ``at`` (keyed
    ``(scheme, seed, lr)``): per scheme ``{seed: (early spike, divergence verdict)}``."""
    return [{"sublayers": L, "lr": lr, **{x: {k[1]: (r.early_spike, r.verdict) for k, r in at.items()
                                              if k[0] == x and k[2] == lr} for x in (scheme, baseline)}}
            for lr in sorted({k[2] for k in at})]
