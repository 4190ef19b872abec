"""Markdown cells of a study's numbers: a paired interval, LRs per seed, plateau exits, LR
windows, a margin's direction. Used by the claim kinds' tables (:mod:`.claims`) and the
report's other tables (:mod:`.report`)."""

from __future__ import annotations

from keel.errors import plural
from keel.experiments.analysis import PairedVerdict
from keel.experiments.study.verdicts import CONDITIONS, NOT_REPRODUCED, REPRODUCED, Condition

CONDITION_WORDS = {**CONDITIONS, "paper_ramp": "on the paper's ramp", "extended_ramp": "on the extended ramp"}


def upper_first(text: str) -> str:
    """``text`` with its first letter upper-cased and the rest as it is (``str.capitalize`` would
    lower-case the rest: "At n(0, 1) embeddings")."""
    return text[:1].upper() + text[1:]


def pm(v: PairedVerdict | None, fmt: str = "{:+.3f}") -> str:
    """``mean [90% CI lo, hi] (s0 x, s1 y, ...)`` of a :class:`PairedVerdict` (the interval:
    its two one-sided bounds; ``mean (s0 x)`` for one seed)."""
    if v is None or v.mean is None:
        return "–"
    per = ", ".join(f"s{seed} {fmt.format(x)}" for seed, x in v.diffs.items())
    if v.lo is None:
        return f"{fmt.format(v.mean)} ({per})"
    ci = round(100 * (2 * v.level - 1))
    return f"{fmt.format(v.mean)} [{ci}% CI {fmt.format(v.lo)}, {fmt.format(v.hi)}] ({per})"


def parts(c: Condition) -> str:
    """A condition's parts: ``name: numbers (verdict)``, or why it has none (also when no part has
    a seed yet: a list of "name: – (inconclusive)" hid what the condition waits for)."""
    if not c.parts or (c.why and not any(v.n for v in c.parts.values())):
        return c.why or "–"
    return "; ".join(f"{k}: {pm(v)} ({v.verdict})" for k, v in c.parts.items())


def short(v: PairedVerdict) -> str:
    """``+1.115 [90% CI +1.01, +1.22], 3 seeds`` of a :class:`PairedVerdict`; without a
    finite difference, why: no seed finished on both sides yet, or each paired seed lacks a loss."""
    if v.mean is None:
        k = len(v.diffs)
        return f"no finite paired difference ({plural(k, 'seed')} without a loss on a side)" if k \
            else "no paired seed yet"
    if v.lo is None:
        return f"{v.mean:+.3f}, {v.n} seed"
    ci = round(100 * (2 * v.level - 1))
    return f"{v.mean:+.3f} [{ci}% CI {v.lo:+.3f}, {v.hi:+.3f}], {v.n} seeds"


def lrs(d: dict, edge: dict | None = None) -> str:
    """``[s0 X, s1 Y*]``: one LR per seed (``none`` for a missing one; ``*`` where ``edge`` marks
    that seed's best LR as not bracketed by the LRs it trained)."""
    return "[" + ", ".join(f"s{seed} " + ("none" if x is None else f"{x:g}") + ("*" if (edge or {}).get(seed) else "")
                           for seed, x in d.items()) + "]"


def max_lr_cell(per: dict) -> str:
    """``[s0 0.01, s1 0.03+, s2 <0.0001]``: a max trained LR per seed (``{seed: (LR, how)}``,
    :func:`keel.experiments.study.claims.loop_max_lr.max_trained_lr`; + trained at its highest LR, a lower
    bound; < trained at none, one grid step below its lowest, an upper bound)."""
    return "[" + ", ".join(f"s{sd} " + ("<" if how == "none" else "") + f"{lr:.3g}" + ("+" if how == "top" else "")
                           for sd, (lr, how) in per.items()) + "]"


def exits(d: dict) -> str:
    """``[s0 317, s1 never]``: one plateau exit step per seed."""
    return "[" + ", ".join(f"s{seed} " + ("never" if x is None else str(x)) for seed, x in d.items()) + "]"


def window(w: dict) -> str:
    """A scheme's healthy-LR window per init group: ``lr-grid 0.001–0.01 (3 LRs)``."""
    return "; ".join(f"{g} " + (f"{x[0]:g}–{x[-1]:g} ({plural(len(x), 'LR')})" if x else "pending")
                     for g, x in w.items())


def direction(v: PairedVerdict, scheme: str, baseline: str) -> str:
    """What one depth's paired margin (:class:`PairedVerdict` of ``baseline - scheme``) says, in
    words that do not read as a verdict on the whole claim: ``{scheme} better`` (the interval
    clears the floor), ``{baseline} better`` (it lies below minus the floor), ``no {scheme}
    advantage`` (below the floor, not below minus it), ``undecided`` (it straddles the floor) or
    ``too few seeds``."""
    if v.verdict == REPRODUCED:
        return f"{scheme} better"
    if v.verdict == NOT_REPRODUCED:
        return f"{baseline} better" if v.hi < -v.min_effect else f"no {scheme} advantage"
    return "too few seeds" if v.n < 2 else "undecided"


def flagged(runs: int, n: int, k: int) -> str:
    """``4 of 4 (4 left the plateau later)``: of a margin row's ``runs`` finished baseline runs, the ``n``
    the divergence classifier flagged, ``k`` of which left the plateau later."""
    return f"{n} of {runs}" + (f" ({k} left the plateau later)" if k else "")
