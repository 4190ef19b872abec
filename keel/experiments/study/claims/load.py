"""Reading a study's claims: :func:`check_claim` checks one ``[[claims]]`` table against its
kind (:data:`keel.experiments.study.claims.base.CLAIMS`) and turns it into an instance of the
kind's class; :func:`load_study` reads a study file and checks every claim before anything
trains."""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING
from typing import Sequence

from keel.errors import KeelError
from keel.experiments.study.claims.base import CLAIMS, Claim
from keel.experiments.study.spec import Group, Study, read_study
from keel.keys import check_keys, key_names, key_rule, key_type
from keel.model import SCHEMES


def _check_types(cls: type[Claim], c: dict) -> None:
    """Raise KeelError naming a key whose TOML type is not its declared one: a name given as a
    list or a number (``scheme = ["keel"]``), a list of names given as one string."""
    for f in dataclasses.fields(cls):
        if f.name not in c:
            continue
        v, base = c[f.name], key_type(cls, f.name).base
        if base is str and not isinstance(v, str):
            raise KeelError(f"study claim {c.get('id')!r}: {f.name} must be a string, got {v!r}")
        if base is list and not (isinstance(v, list) and all(isinstance(x, str) for x in v)
                                 and (v or not f.metadata["nonempty"])):
            raise KeelError(f"study claim {c.get('id')!r}: {f.name} must be a list of {f.metadata['note'] or 'names'}, "
                            f"got {v!r}")


def _missing_keys(c: dict, cls: type[Claim]) -> list[str]:
    """The keys of kind ``cls`` without a default that claim ``c`` does not give, sorted."""
    return sorted(f.name for f in dataclasses.fields(cls) if f.name not in c and f.default is MISSING
                  and f.default_factory is MISSING)


def _check_key_names(c: dict, cls: type[Claim]) -> None:
    """Raise KeelError naming the missing keys of claim ``c`` (the fields of its kind ``cls`` without a
    default), else its unknown ones (keys ``cls`` does not declare)."""
    missing = _missing_keys(c, cls)
    unknown = sorted(set(c) - {f.name for f in dataclasses.fields(cls)})
    if missing or unknown:
        raise KeelError(f"study claim {c['id']!r} ({cls.kind}): " + (f"missing {', '.join(missing)}" if missing
                                                                      else f"unknown key(s) {', '.join(unknown)}"))


def _check_groups_read(claim: Claim, groups: dict[str, Group]) -> None:
    """Raise KeelError for the first group ``claim`` reads that is not a group of the study at this
    scale (one of its :meth:`Claim.optional_groups` may be missing, e.g. an extended ramp) or is of
    another kind than its kind reads (train / ramp)."""
    for g in claim.groups_read():
        if g not in groups and g not in claim.optional_groups():
            raise KeelError(f"study claim {claim.id!r}: group {g!r} is not a group of the study "
                            f"(declare it as [groups.{g}])")
        if g in groups and groups[g].kind != claim.group_kind:
            raise KeelError(f"study claim {claim.id!r}: {claim.kind} cannot read {groups[g].kind} group {g!r}")


def check_claim(c: object, groups: dict[str, Group]) -> Claim:
    """One ``[[claims]]`` entry as an instance of its kind's class (:data:`CLAIMS`), checked.

    Raises:
        KeelError: naming the first problem: not a table, no id / title / known test, a key of
            the wrong type, missing or unknown, a group this scale does not size or of the other
            kind (train / ramp), an unknown scheme or one the groups do not train, and what the kind checks
            itself (:meth:`Claim.check`).
    """
    if not isinstance(c, dict) or not c.get("id") or not c.get("title"):
        raise KeelError("every [[claims]] entry needs an id and a title")
    _check_types(Claim, c)
    cls = CLAIMS.get(c.get("test"))
    if cls is None:
        raise KeelError(f"study claim {c['id']!r}: test must be one of {', '.join(CLAIMS)}, got {c.get('test')!r}")
    _check_types(cls, c)
    _check_key_names(c, cls)
    claim = cls(**c)
    check_keys(claim, f"study claim {claim.id!r}", sep=": ")
    _check_groups_read(claim, groups)
    claim.check(groups)
    unknown = sorted(set(claim.schemes_read()) - set(SCHEMES))
    if unknown:
        raise KeelError(f"study claim {claim.id!r}: unknown scheme(s) {', '.join(unknown)} (available: "
                        f"{', '.join(SCHEMES)})")
    untrained = set(claim.schemes_read()) - set().union(*(groups[g].schemes for g in claim.groups_read() if g in groups))
    if untrained:
        raise KeelError(f"study claim {claim.id!r}: scheme(s) {', '.join(sorted(untrained))} not trained by its group(s)")
    return claim


def _unchecked(c: object) -> Claim | None:
    """Claim ``c`` as its kind's instance before :func:`check_claim` (the groups it names, to tell
    whether this scale sizes them): built from the keys its kind declares; None when ``c`` is not a
    table, its kind is unknown or a key without a default is missing."""
    cls = CLAIMS.get(c.get("test")) if isinstance(c, dict) else None
    if cls is None or _missing_keys(c, cls):
        return None
    declared = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in c.items() if k in declared})


def load_study(name: str, scale: str, user_sets: Sequence[str] = ()) -> Study:
    """Read study ``name`` at ``scale`` (:func:`keel.experiments.study.spec.read_study`) and check
    every claim against its kind (:func:`check_claim`): the whole file is checked before anything
    trains, and ``study.claims`` holds each judged claim as its kind's instance (:class:`Claim`).

    A claim that reads a group the file declares but ``scale`` does not size is not judged at
    that scale (moved to ``study.unjudged``; e.g. the test-suite scale sizes a few groups only).

    Raises:
        KeelError: everything :func:`read_study` raises; a bad claim (naming it and the key),
            including one naming a group the file does not declare.
    """
    study = read_study(name, scale, user_sets)
    groups = {g.name: g for g in study.groups}
    judged = []
    for c in study.claims:
        draft = _unchecked(c)
        unsized = [g for g in (draft.groups_read() if draft else []) if isinstance(g, str) and g not in groups
                   and g in study.declared and g not in draft.optional_groups()]
        if unsized:
            study.unjudged.append({"id": c.get("id"), "groups": unsized})
            continue
        judged.append(check_claim(c, groups))
    study.claims = judged
    ids = [c.id for c in study.claims]
    if len(set(ids)) != len(ids):
        raise KeelError(f"study claims repeat an id: {', '.join(ids)}")
    return study


def describe_study_keys() -> dict[str, list[dict]]:
    """Every key of a study file's tables, from its one declaration (:func:`keel.keys.key`), in
    declaration order: ``{"group": [...], "claim": [...], KIND: [...]}``. ``group``: a group's keys
    (``[groups.NAME]``, sized per scale in ``[scales.S.groups.NAME]``); ``claim``: the keys every
    ``[[claims]]`` entry has; ``KIND``: the further keys of a claim with ``test = KIND`` (each kind of
    :data:`~keel.experiments.study.claims.base.CLAIMS`). Each key ``{"key", "type", "default",
    "rule", "help"}``; ``default`` None where the key is required (no default)."""
    def rows(cls: type, names: list[str]) -> list[dict]:
        out = []
        for f in (f for f in dataclasses.fields(cls) if f.name in names):
            default = (f.default if f.default is not MISSING else
                       f.default_factory() if f.default_factory is not MISSING else None)
            out.append({"key": f.name, "type": key_type(cls, f.name).text, "default": default,
                        "rule": key_rule(cls, f.name), "help": f.metadata["help"]})
        return out
    common = key_names(Claim)
    return {"group": rows(Group, key_names(Group)), "claim": rows(Claim, common),
            **{kind: rows(cls, [k for k in key_names(cls) if k not in common]) for kind, cls in CLAIMS.items()}}
