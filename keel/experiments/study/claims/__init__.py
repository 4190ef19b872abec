"""The kinds of claim a study makes, one module per kind: its class (the keys of its
``[[claims]]`` entry, declared with :func:`keel.keys.key`, as attributes), its verdict (a method
whose docstring is the rule the report states; statistics from :mod:`keel.experiments.analysis`,
helpers several kinds share from :mod:`keel.experiments.study.verdicts`), the groups and schemes
it reads, and its tables in the report. :mod:`.base` holds :class:`Claim`, the key sets several
kinds share and the registry :data:`CLAIMS` (a claim's ``test`` names one kind), which each
kind's class joins as it is defined; this package imports every module in it, so a new kind of
claim is one module here (and a ``[[claims]]`` block). :func:`load_study` (:mod:`.load`) reads a
study file and checks every claim against its kind before anything trains.
"""

from __future__ import annotations

import importlib
import pkgutil

from keel.experiments.study.claims.base import CLAIMS, Claim, InitGroups, OneGroup, Paired
from keel.experiments.study.claims.load import check_claim, load_study

for _module in pkgutil.iter_modules(__path__):  # each kind's module registers its class in CLAIMS
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["CLAIMS", "Claim", "InitGroups", "OneGroup", "Paired", "check_claim", "load_study"]
