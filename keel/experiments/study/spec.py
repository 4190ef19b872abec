"""A study as data: its groups, claims and scales, loaded from TOML and checked
(:func:`load_study`); the file format is described in :mod:`keel.experiments.study`."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from keel.config import Override, max_loops, max_loops_words, override_text, read_toml, resolve_config_path
from keel.errors import KeelError
from keel.experiments.job_result import is_number
from keel.experiments.study.kinds import GROUP_KINDS, TrainKind
from keel.keys import check_key, check_keys, did_you_mean, key, key_names, key_rule, unread_keys
from keel.model import SCHEMES


def _own(name: str):
    return lambda g: name in g.kind_class.keys  # the read_if of a key only some kinds of group read (their keys)


def _axes(g) -> bool:
    return g.kind_class.axes  # the read_if of schemes, sublayers, seeds, ...: not a grid group's (its grid names them)


# ----------------------------------------------------------------------------- the study as data
GroupKind = Literal[tuple(GROUP_KINDS)]  # the names of the kinds of group registered in keel.experiments.study.kinds


@dataclass
class Group:
    """One group of runs of a study at one scale (see the module docstring): a study file's group
    keys are declared below (:func:`keel.keys.key`); its ``set`` table is ``sets``, typed
    ``(section.key, value)`` pairs (:func:`keel.config.apply_overrides`). Python sets the rest."""

    name: str
    schemes: list[str] = key([], "the residual schemes it trains (keel.model.SCHEMES).", nonempty=True, unique=True,
                              read_if=_axes)
    sublayers: list[int] = key([], "its depths, in sub-layers.", ge=2, nonempty=True, unique=True, note="even",
                               read_if=_axes)
    seeds: list[int] = key([], "the seeds each scheme trains (but those of seeds_for).", ge=0, le=2**32 - 1,
                           nonempty=True, unique=True, note="train.seed's range", read_if=_axes)
    lrs: list[float] = key([], "a train group's peak LRs (absolute), or lr_from.", gt=0, unique=True, read_if=_own("lrs"))
    kind: GroupKind = key("train", "the kind of group: " + "; ".join(f"{n}, {c.summary}" for n, c in GROUP_KINDS.items())
                          + ".")
    sets: list[Override] = field(default_factory=list)
    peak_lr: float = key(5e-2, "a ramp group's last LR.", gt=0, read_if=_own("peak_lr"))
    ramp_steps: int = key(1000, "a ramp group's steps to peak_lr.", ge=1, read_if=_own("ramp_steps"))
    lr_from: str = key("", "a train group whose optimal LR per scheme it trains.", read_if=_own("lr_from"))
    lr_from_sublayers: int = key(0, "the depth of lr_from's optimum.", read_if=_own("lr_from_sublayers"))
    lr_from_steps: list[int] = key([0], "the LRs it trains, in grid steps from lr_from's optimum.", nonempty=True,
                                   unique=True, note="from the transferred optimum, e.g. [0, -1]",
                                   read_if=_own("lr_from_steps"))
    note: str = key("", "text printed with the group in the report.")
    baselines_from: str = key("", "a train group whose baselines runs pair with this group's.",
                              read_if=_own("baselines_from"))
    baselines: list[str] = key([], "the schemes of baselines_from that pair.", unique=True, read_if=_own("baselines"))
    seeds_for: dict[str, list[int]] = key({}, "a scheme's own seeds.", ge=0, le=2**32 - 1, nonempty=True, unique=True,
                                       note="scheme = [seeds], in train.seed's range", read_if=_axes)
    widen: int = key(2, "LRs a cell a claim reads may gain beyond the planned ones on each side (to bracket its "
                        "optimum).", ge=0, note="LRs added per side", read_if=_own("widen"))
    ablate: bool = key(False, "a train group: after each run, ΔPPL of removing each sub-layer (keel ablate, paper "
                              "Appendix A) on its validation split, kept in its record.", read_if=_own("ablate"))
    reference: str = key("pre_ln", "a ramp group's reference scheme (the divergence classifier's baseline run).",
                         read_if=_own("reference"))
    loop: list[int] = key([], "a looped model of P prelude, C core and Q coda blocks (docs/looped.md): sublayers are "
                              "then effective depths, 2 (P + R C + Q), R = (L/2 - P - Q) / C per depth.", ge=0,
                          note="[P, C, Q], C >= 1; empty = no loop", read_if=_axes)
    test_loops: list[float] = key([], "a looped train group: after each run, its final validation loss with the core "
                                      "applied round(f R) times for each factor f, kept in its record; 1 <= "
                                      "round(f R) <= max(64, 16 R), the cap of --loops.", gt=0,
                                  unique=True, note="factors of R, e.g. [0.5, 2.0]", read_if=_own("test_loops"))
    table: bool = key(False, "report.md shows the group's own table: a ramp group's stress table, a train group's "
                             "LR-sensitivity table (a grid group's sweep table is always shown).")
    grid: dict[str, list] = field(default_factory=dict)  # a grid group's axes: {section.key: [values]} (checked by
    match_params: int | str | None = None  # its parameter target (keel sweep --match-params)     GridKind.check)
    best_over: str | None = None  # its grid key whose best value per other keys' values the sweep table shows
    folder: str | None = None  # its runs' folder under the study's out: the name by default, "" = out itself

    @property
    def kind_class(self) -> type[TrainKind]:
        """The class of this group's ``kind`` (:data:`keel.experiments.study.kinds.GROUP_KINDS`): its jobs,
        task, LR plan words, record, plot and the keys only it reads."""
        return GROUP_KINDS[self.kind]

    @property
    def dir_name(self) -> str:
        """The folder of this group's runs under the study's ``--out`` (``""``: ``--out`` itself, as
        ``keel sweep``, ``stress`` and ``lr-sensitivity`` lay out their runs)."""
        return self.name if self.folder is None else self.folder

    def loop_repeats(self, sublayers: int) -> int:
        """R of a looped group (``loop = [P, C, Q]``) at effective depth ``sublayers`` = 2 (P + R C + Q):
        ``(sublayers / 2 - P - Q) / C`` (checked at load to be a whole number >= 1)."""
        p, c, q = self.loop
        return (sublayers // 2 - p - q) // c

    def loop_sets(self, sublayers: int) -> list[Override]:
        """The config keys of a looped group's run at effective depth ``sublayers`` (after the study's
        and group's ``set``): ``n_layers`` = P + C + Q blocks of weights, ``loop_prelude`` P, ``loop_core`` C,
        ``loop_repeats`` R (:meth:`loop_repeats`); [] for a group without ``loop``."""
        if not self.loop:
            return []
        p, c, q = self.loop
        return [("model.n_layers", p + c + q), ("model.loop_prelude", p), ("model.loop_core", c),
                ("model.loop_repeats", self.loop_repeats(sublayers))]

    def test_counts(self, sublayers: int) -> list[int]:
        """The loop counts R' = round(f R) a ``test_loops`` group evaluates its runs at, at ``sublayers``."""
        return [round(f * self.loop_repeats(sublayers)) for f in self.test_loops]

    def scheme_seeds(self, scheme: str) -> list[int]:
        """The seeds ``scheme`` trains in this group: its ``seeds_for`` entry, else ``seeds`` (e.g. a
        scheme no verdict reads kept at fewer seeds than the ones the verdicts read)."""
        return self.seeds_for.get(scheme, self.seeds)


@dataclass
class Study:
    """A loaded study at one scale: ``groups`` in run order, ``claims`` (the ``[[claims]]`` tables as
    :func:`read_study` reads them; :func:`keel.experiments.study.claims.load_study` checks each and
    keeps it as its kind's instance, a :class:`keel.experiments.study.claims.Claim`),
    ``sets`` (the scale's config keys as typed pairs), ``user_sets`` (the user's ``--set``
    strings: applied last, after a group's own ``set``), ``min_effect`` (nats/token) and
    ``min_seeds`` of the verdict rule."""

    name: str
    scale: str
    description: str
    note: str
    base: str
    sets: list[Override]
    groups: list[Group]
    claims: list  # of Claim once load_study has checked them (claims import this module)
    min_effect: float = 0.02
    min_seeds: int = 3
    floor_from_spread: bool = False
    user_sets: list[str] = field(default_factory=list)
    declared: list[str] = field(default_factory=list)  # every group the file declares, sized at this scale or not
    unjudged: list[dict] = field(default_factory=list)  # claims whose groups this scale does not size (not judged)

    def all_sets(self, group: Group | None = None) -> list[Override]:
        """The config keys of a run of ``group`` (or of the study's base run): the scale's, the
        group's own ``set``, then the user's ``--set``, later ones winning."""
        return self.sets + (group.sets if group else []) + list(self.user_sets)

    def base_sets(self) -> list[Override]:
        """The config keys of the study's base run (its data, prepared once): :meth:`all_sets` less the
        ``model.loop_*`` keys (:func:`without_loop_keys`)."""
        return without_loop_keys(self.all_sets())


def without_loop_keys(sets: Sequence[Override]) -> list[Override]:
    """``sets`` less its ``model.loop_*`` keys, which need the loop (``model.loop_core``) that only a looped
    group's runs have (:meth:`Group.loop_sets`): a study's base config, and a report's base settings read
    back by ``--restore``, are read without them (e.g. ``--set model.loop_sampling=uniform``)."""
    return [x for x in sets if not override_text(x).split("=", 1)[0].strip().startswith("model.loop_")]


def lr_ladder(groups: Sequence[Group], g: Group) -> list[float]:
    """The LR grid (absolute peak LRs, ascending) that train group ``g``'s LRs are points of: its
    own ``lrs``, or for an ``lr_from`` group its source's ladder (followed through a chain of
    ``lr_from`` groups, e.g. a token-budget group transferring from the deepest depth's group);
    an empty list for a chain that ends nowhere (a cycle, or a group that is not in ``groups``)."""
    seen: set[str] = set()
    while g.lr_from and g.name not in seen:
        seen.add(g.name)
        g = next((x for x in groups if x.name == g.lr_from), g)
    return [] if g.lr_from else sorted(g.lrs)


def _group(name: str, spec: dict, sized: dict) -> Group:
    """The group ``name`` of a study file (its ``[groups.NAME]`` table ``spec``, the scale's ``sized``),
    checked against the declarations of :class:`Group`: one-line errors ``study group 'g': ...``."""
    plain = [k for c in GROUP_KINDS.values() for k in c.keys if k not in key_names(Group)]  # grid, best_over, ...
    where, d, known = f"study group {name!r}", {**spec, **sized}, key_names(Group) + ["set"] + plain
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise KeelError(f"{where}: unknown key(s) {', '.join(k + did_you_mean(k, known) for k in unknown)}")
    sets = d.pop("set", {})
    if not isinstance(sets, dict):
        raise KeelError(f"{where}: set must be a table of config keys, e.g. set = {{ \"model.embed_init_std\" = 1.0 }}")
    g = Group(name=name, sets=list(sets.items()), **d)
    check_key(g, where, "kind", sep=": ")  # first: which keys the group reads depends on it
    varied = sorted(k for k in sets if k in GRID_KEYS)
    if varied and g.kind_class.axes:  # a grid group's set may fix the base its grid varies (match_params = "auto")
        raise KeelError(f"{where}: set {', '.join(varied)}: the group's schemes, sublayers, lrs and "
                        "seeds set it per run; change those instead")
    _refuse_shared_data(g, sets, where)
    check_keys(g, where, sep=": ")
    _refuse_unread(g, where, unread_keys(g, d) + [k for k in plain if k in d and k not in g.kind_class.keys])
    odd = [L for L in g.sublayers if L % 2]
    if odd:
        raise KeelError(f"{where}: sublayers must be {key_rule(Group, 'sublayers')}, got {odd[0]}")
    g.kind_class.check(g, where)
    _check_lr_from(g, d, where)
    _check_loop(g, where)
    return g


def _refuse_shared_data(g: Group, sets: dict, where: str) -> None:
    """Raise KeelError (one line) for ``data.*`` keys in the ``set`` of a group whose runs share the study's one
    dataset, prepared without them (every kind but a grid group, whose runs prepare their own)."""
    data = sorted(k for k in sets if k.startswith("data."))
    if data and not g.kind_class.own_data(g):
        raise KeelError(f"{where}: set {', '.join(data)}: the runs of a {g.kind} group share the study's one dataset; "
                        "set data keys in the scale's set or with --set (a grid group's runs prepare their own)")


def _check_lr_from(g: Group, given: dict, where: str) -> None:
    """Raise KeelError (one line) for ``lrs`` given beside ``lr_from``, or ``lr_from_sublayers`` /
    ``lr_from_steps`` given without it (``given``: the keys the file gives the group)."""
    if g.lr_from and "lrs" in given:
        raise KeelError(f"{where}: lrs is ignored with lr_from (the group trains lr_from's optimum and its "
                        "lr_from_steps); give one")
    stray = [k for k in ("lr_from_sublayers", "lr_from_steps") if k in given and not g.lr_from]
    if stray:
        raise KeelError(f"{where}: {', '.join(stray)} need(s) lr_from (the train group whose optimal LR it trains)")


def _refuse_unread(g: Group, where: str, other: list[str]) -> None:
    """Raise KeelError naming the keys ``other`` that group ``g`` was given but its kind does not read,
    and the kind of group that reads the first (none given: nothing to say)."""
    if other:
        owner = next((k for k, c in GROUP_KINDS.items() if other[0] in c.keys), None)
        whose = f"a {owner} group" if owner else "a group of schemes x sub-layers x seeds (a grid group's grid " \
                                                   "sets each run's values)"
        raise KeelError(f"{where}: {', '.join(other)} belong(s) to {whose}, not to this {g.kind} group")


LOOP_KEYS = ("model.n_layers", "model.loop_prelude", "model.loop_core", "model.loop_repeats")  # a loop group's own


def _check_loop(g: Group, where: str) -> None:
    """Raise KeelError (one line) for a group's ``loop`` that is not ``[P, C, Q]`` with C >= 1, an
    effective depth it does not reach with a whole R >= 1, a ``set`` of the keys the loop sets per run,
    ``test_loops`` without ``loop``, a factor giving R' < 1 or R' above ``--loops``' cap
    (:func:`keel.config.max_loops` of R), or ``test_loops`` beside ``ablate``."""
    if g.test_loops and not g.loop:
        raise KeelError(f"{where}: test_loops needs loop = [P, C, Q] (a looped model)")
    if g.test_loops and g.ablate:
        raise KeelError(f"{where}: ablate and test_loops are two tasks after training; give one per group")
    if not g.loop:
        return
    if len(g.loop) != 3 or g.loop[1] < 1:
        raise KeelError(f"{where}: loop must be [P, C, Q] (prelude, core, coda blocks) with C >= 1, got {g.loop}")
    p, c, q = g.loop
    for L in g.sublayers:
        if L // 2 - p - q < c or (L // 2 - p - q) % c:
            raise KeelError(f"{where}: sublayers {L} is not an effective depth of loop {g.loop}: 2 (P + R C + Q) "
                            f"with a whole R >= 1 (R = (L/2 - P - Q) / C = {(L / 2 - p - q) / c:g})")
        low = [f for f, n in zip(g.test_loops, g.test_counts(L)) if n < 1]
        if low:
            raise KeelError(f"{where}: test_loops {low[0]:g} x R = {low[0] * g.loop_repeats(L):g} at {L} sub-layers "
                            "rounds below 1 loop")
        cap = max_loops(g.loop_repeats(L))
        high = [(f, n) for f, n in zip(g.test_loops, g.test_counts(L)) if n > cap]
        if high:
            raise KeelError(f"{where}: test_loops {high[0][0]:g} x R = {high[0][1]} at {L} sub-layers is above {cap}, "
                            f"the cap of --loops ({max_loops_words(g.loop_repeats(L), 'R')}): "
                            f"each validation token would apply the core {high[0][1]} times")
    owned = sorted(k for k, _ in g.sets if k in LOOP_KEYS)
    if owned:
        raise KeelError(f"{where}: set {', '.join(owned)}: loop = {g.loop} sets it per run; change loop or sublayers")


def read_study(name: str, scale: str, user_sets: Sequence[str] = ()) -> Study:
    """Read study ``name`` (a packaged preset or a TOML path) at ``scale``; its claims are checked
    against their kinds by :func:`keel.experiments.study.claims.load_study`, which calls this.

    Raises:
        KeelError: unknown study or scale, unparsable or non-UTF-8 TOML, a malformed group,
            claim or ``[verdict]``, an unknown scheme, a claim naming a group that the scale
            does not size, a ``--set`` of a key the groups set per run.
    """
    path = resolve_config_path(name, kind="studies")
    return study_from_dict(path.stem, read_toml(path, "study"), scale, user_sets)


ONE_SIZE = "default"  # the scale of a study file without [scales] when none is given


def study_scale(name: str, scale: str | None) -> str:
    """The scale to read study ``name`` (a packaged preset or a TOML path) at: ``scale`` where given;
    otherwise :data:`ONE_SIZE` for a file without ``[scales]`` (one size, its groups sized in place).

    Raises:
        KeelError: no ``scale`` for a file that declares scales (naming them), or what reading the
            file raises (unknown study, unparsable TOML).
    """
    if scale is not None:
        return scale
    path = resolve_config_path(name, kind="studies")
    scales = read_toml(path, "study").get("scales")
    if scales is None:
        return ONE_SIZE
    if not scales or not isinstance(scales, dict):
        raise KeelError(f"study {path.stem!r} has a [scales] table with no scale in it: add [scales.NAME] tables "
                        "(and give --scale NAME), or remove [scales] for a study of one size")
    raise KeelError(f"study {path.stem!r} has scales ({', '.join(scales)}): give one with --scale")


def study_from_dict(name: str, d: dict, scale: str, user_sets: Sequence[str] = ()) -> Study:
    """The study ``name`` of a study file's content ``d`` (its TOML as a dict) at ``scale``: what
    :func:`read_study` reads (and ``keel sweep --preset``, :mod:`keel.experiments.presets`). A file
    without ``[scales]`` has one size: its groups are sized in their own tables, at any ``scale``
    (the name its report gives). Raises KeelError as :func:`read_study`."""
    unknown = set(d) - {"description", "base", "verdict", "groups", "claims", "scales"}
    if unknown:
        raise KeelError(f"study {name!r}: unknown top-level key(s) {', '.join(sorted(unknown))}")
    _check_tables(name, d, scale)
    _check_names(name, d)
    scales = d.get("scales", {})
    if "scales" not in d:  # one size: each group as its own table gives it
        scales = {scale: {"groups": dict.fromkeys(d.get("groups", {}), {})}}
    if scale not in scales:
        raise KeelError(f"study {name!r} has no scale {scale!r} (scales: {', '.join(scales)})")
    sc = scales[scale]
    sized = sc.get("groups", {})
    extra = set(sized) - set(d.get("groups", {}))
    if extra:
        raise KeelError(f"study scale {scale!r} sizes undeclared group(s) {', '.join(sorted(extra))}")
    if d.get("groups") and isinstance(sized, dict) and not sized:  # it would train nothing and judge nothing
        raise KeelError(f"study scale {scale!r} sizes none of the groups ({', '.join(d['groups'])}): a study with "
                        f"[scales] trains a group at a scale only with a [scales.{scale}.groups.NAME] table")
    groups = [_group(g, spec, sized[g]) for g, spec in d.get("groups", {}).items() if g in sized]
    for g in groups:
        _check_group_in_study(g, groups)
    claims = d.get("claims", [])
    if not isinstance(claims, list) or not (claims or groups):
        raise KeelError("a study needs groups, and its claims are [[claims]] entries (an array of tables; none: "
                        "a study of groups only, e.g. a bench with baselines_from)")
    min_effect, min_seeds, spread = _verdict_settings(d.get("verdict", {}))
    _check_sets(scale, sc.get("set", {}), user_sets, any(g.loop for g in groups))
    return Study(name=name, scale=scale, description=d.get("description", "").strip(), note=sc.get("note", ""),
                 base=d.get("base", "demo"), sets=list(sc.get("set", {}).items()), groups=groups, claims=claims,
                 min_effect=min_effect, min_seeds=min_seeds, floor_from_spread=spread,
                 user_sets=list(user_sets), declared=list(d.get("groups", {})))


def _check_sets(scale: str, scale_set, user_sets: Sequence[str], looped: bool) -> None:
    """Raise KeelError naming a key that the scale's ``set`` or the user's ``--set`` gives but the
    groups set per run, where it would be silently overridden: the grid keys (scheme, depth, LR,
    seed) always, the loop keys when a group is looped (``looped``: its ``loop = [P, C, Q]`` and
    sublayers set them). Also a scale ``set`` that is not a table."""
    refuse_sets(user_sets, dict.fromkeys(GRID_KEYS, " is set by the study's groups; change the study file instead"))
    if looped:  # each looped group's loop_sets come after the --set: it was silently overridden
        refuse_sets(user_sets, dict.fromkeys(LOOP_KEYS, " is set by the study's looped groups (loop = [P, C, Q] and "
                                                        "sublayers); change the study file instead"))
    if not isinstance(scale_set, dict):
        raise KeelError(f"study scale {scale!r}: set must be a table of config keys, got {scale_set!r}")
    varied = sorted(k for k in scale_set if k in GRID_KEYS)
    if varied:  # they were silently overridden by every group's own values
        raise KeelError(f"study scale {scale!r}: set {', '.join(varied)}: the groups' schemes, sublayers, lrs and "
                        "seeds set it per run; change those instead")
    loop_keys = sorted(k for k in scale_set if k in LOOP_KEYS) if looped else []
    if loop_keys:  # as silently overridden by each looped group's loop_sets
        raise KeelError(f"study scale {scale!r}: set {', '.join(loop_keys)}: the looped groups' loop = [P, C, Q] and "
                        "sublayers set it per run; change those instead")


def _check_tables(name: str, d: dict, scale: str) -> None:
    """Raise KeelError naming the first key of a study file whose TOML shape is wrong: a table
    given as a value (``scales = 5``, ``[groups] x = 5``, ``[scales.S.groups] init = 5``), text
    given as a number (``description = 5``, a scale's ``note = 7``, which used to pass the dry
    run and fail only when the report was written, after every run had trained)."""
    def table(x, where):
        if not isinstance(x, dict):
            raise KeelError(f"study {name!r}: {where} must be a table, got {x!r}")
    table(d.get("scales", {}), "scales")
    table(d.get("groups", {}), "groups")
    for g, spec in d.get("groups", {}).items():
        table(spec, f"[groups.{g}]")
    for k in ("description", "base"):
        if k in d and not isinstance(d[k], str):
            raise KeelError(f"study {name!r}: {k} must be text, got {d[k]!r}")
    sc = d.get("scales", {}).get(scale)
    if sc is None:
        return
    table(sc, f"[scales.{scale}]")
    table(sc.get("groups", {}), f"[scales.{scale}.groups]")
    for g, sized in sc.get("groups", {}).items():
        table(sized, f"[scales.{scale}.groups.{g}]")
    if not isinstance(sc.get("note", ""), str):
        raise KeelError(f"study {name!r}: [scales.{scale}] note must be text, got {sc['note']!r}")


GROUP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")  # a group's name is the folder of its runs under --out
SCALE_KEYS = ("note", "set", "groups")  # the keys of a [scales.S] table


def _check_names(name: str, d: dict) -> None:
    """Raise KeelError naming the first name of a (table-shaped) study file that would be
    ignored or misread: a group name that is not a simple folder name (``"../escape"``, ``"a/b"``,
    ``"."``: its runs would leave ``--out``), an unknown key of a ``[scales.S]`` table (``sett``,
    ``seeds`` outside ``groups``), a claim's ``extended_group`` that names no group of the study."""
    for g in d.get("groups", {}):
        if not GROUP_NAME.fullmatch(g):
            raise KeelError(f"study {name!r}: group name {g!r} must be a simple name (letters, digits, _ . -, "
                            "starting with a letter or digit): it names the folder of its runs under --out")
    for s, sc in d.get("scales", {}).items():
        unknown = sorted(set(sc) - set(SCALE_KEYS)) if isinstance(sc, dict) else []
        if unknown:
            raise KeelError(f"study {name!r}: [scales.{s}] unknown key(s) "
                            f"{', '.join(k + did_you_mean(k, SCALE_KEYS) for k in unknown)} (it takes note, set, groups)")
    claims = d.get("claims", [])
    for c in claims if isinstance(claims, list) else []:
        ext = c.get("extended_group") if isinstance(c, dict) else None
        if isinstance(ext, str) and ext and ext not in d.get("groups", {}):
            raise KeelError(f"study {name!r}: claim {c.get('id')!r}: extended_group {ext!r} names no group of the "
                            f"study (groups: {', '.join(d.get('groups', {})) or 'none'})")


def _check_group_in_study(g: Group, groups: list[Group]) -> None:
    """Raise KeelError for a group's unknown scheme, or an ``lr_from`` that names no fitting train
    group or steps past its LR grid."""
    bad = [s for s in g.kind_class.schemes_named(g) if s not in SCHEMES]
    if bad:
        raise KeelError(f"study group {g.name!r}: unknown scheme(s) {', '.join(bad)} (available: {', '.join(SCHEMES)})")
    if set(g.seeds_for) - set(g.schemes):
        raise KeelError(f"study group {g.name!r}: seeds_for names scheme(s) the group does not train: "
                        f"{', '.join(sorted(set(g.seeds_for) - set(g.schemes)))}")
    _check_baselines(g, groups)
    if not g.lr_from:
        return
    src = next((x for x in groups if x.name == g.lr_from and x is not g and x.kind_class.lr_grid), None)
    if src is None or g.lr_from_sublayers not in src.sublayers or set(g.schemes) - set(src.schemes):
        raise KeelError(f"study group {g.name!r}: lr_from must name another train group of this scale that "
                        f"has lr_from_sublayers ({g.lr_from_sublayers}) and every scheme of this group")
    ladder = lr_ladder(groups, src)
    if not ladder:
        raise KeelError(f"study group {g.name!r}: lr_from {g.lr_from!r} leads to no group with its own lrs "
                        "(a chain of lr_from groups must end in a group that gives lrs)")
    far = [k for k in g.lr_from_steps if abs(k) >= len(ladder)]
    if far:
        raise KeelError(f"study group {g.name!r}: lr_from_steps {far} reach past group {src.name!r}'s "
                        f"{len(ladder)}-point LR grid (at most {len(ladder) - 1} steps from its optimum)")


def _check_baselines(g: Group, groups: list[Group]) -> None:
    """Raise KeelError, naming the first problem, unless ``baselines_from`` and ``baselines`` come
    together and name another train group of this scale (with its own ``lrs``) that trains every
    baseline scheme at every depth, LR and seed of ``g`` with the same ``set``: the pairs of
    :func:`keel.experiments.study.verdicts.baseline_margins` train the same model, data and tokens."""
    if not (g.baselines_from or g.baselines):
        return
    where = f"study group {g.name!r}"
    if not (g.baselines_from and g.baselines):
        raise KeelError(f"{where}: baselines_from (a train group) and baselines (its schemes) come together, "
                        f"e.g. baselines_from = \"lr-grid\", baselines = [\"keel\", \"pre_ln\"]")
    src = _baselines_source(g, groups, where)
    unknown = [s for s in g.baselines if s not in SCHEMES]
    if unknown:
        raise KeelError(f"{where}: baselines name an unknown scheme ({', '.join(unknown)}; available: {', '.join(SCHEMES)})")
    for what, xs in _baselines_lacking(g, src).items():
        if xs:
            raise KeelError(f"{where}: group {src.name!r} (baselines_from) trains no {what} "
                            f"{', '.join(map(str, xs))}; the pairs need them")
    if dict(g.sets) != dict(src.sets):
        raise KeelError(f"{where}: its set ({_sets_text(g)}) differs from group {src.name!r}'s ({_sets_text(src)}); "
                        "paired runs must train the same model, data and tokens")


def _baselines_source(g: Group, groups: list[Group], where: str) -> Group:
    """The group ``g.baselines_from`` names: another train group of this scale with its own ``lrs``.

    Raises:
        KeelError: no such group, or ``g`` takes its LRs from another group (``lr_from``).
    """
    trains = [x.name for x in groups if x.kind_class.lr_grid and x is not g and not x.lr_from]
    src = next((x for x in groups if x.name == g.baselines_from and x.name in trains), None)
    if src is None or g.lr_from:
        raise KeelError(f"{where}: baselines_from {g.baselines_from!r} must name another train group of this scale "
                        f"with its own lrs ({', '.join(trains) or 'none'}), and this group needs lrs, not lr_from")
    return src


def _baselines_lacking(g: Group, src: Group) -> dict[str, list]:
    """``{what: [items]}``: the baseline schemes, depths, LRs (``%g``) and seeds of ``g`` that its
    ``baselines_from`` group ``src`` does not train (each list empty when it trains them all)."""
    return {"schemes": [x for x in g.baselines if x not in src.schemes],
            "sub-layers": [L for L in g.sublayers if L not in src.sublayers],
            "LRs": [f"{lr:g}" for lr in g.lrs if not any(math.isclose(lr, x) for x in src.lrs)],
            "seeds": sorted({sd for b in g.baselines for sd in g.seeds if sd not in src.scheme_seeds(b)})}


def _sets_text(g: Group) -> str:
    """A group's ``set`` pairs as ``KEY=VALUE`` words for a message (``none`` when it sets nothing)."""
    return ", ".join(override_text(x) for x in g.sets) or "none"


def _verdict_settings(v) -> tuple[float, int, bool]:
    """``(min_effect, min_seeds, floor_from_spread)`` of a study's ``[verdict]`` table (defaults
    0.02 nats, 3 seeds, false).

    Raises:
        KeelError: not a table, an unknown key, ``min_effect`` not a finite number > 0,
            ``min_seeds`` not an integer >= 2 (a paired interval needs two), ``floor_from_spread``
            not a boolean.
    """
    known = ["min_effect", "min_seeds", "floor_from_spread"]
    unknown = sorted(set(v) - set(known)) if isinstance(v, dict) else []
    if unknown:
        raise KeelError(f"study [verdict]: unknown key(s) {', '.join(k + did_you_mean(k, known) for k in unknown)} "
                        f"(it takes {', '.join(known)})")
    ok = isinstance(v, dict)
    effect, seeds, spread = (v.get("min_effect", 0.02), v.get("min_seeds", 3), v.get("floor_from_spread", False)) \
        if ok else (None, None, None)
    if not ok or not (is_number(effect) and 0 < effect < math.inf) \
            or not (is_number(seeds) and isinstance(seeds, int) and seeds >= 2) or not isinstance(spread, bool):
        raise KeelError("study [verdict] takes min_effect (a number > 0, nats), min_seeds (an integer >= 2) and "
                        f"floor_from_spread (true or false) only, got {v!r}")
    return float(effect), seeds, spread


GRID_KEYS = {"model.residual", "model.n_layers", "train.lr", "train.seed"}  # set per run by the groups


def refuse_sets(user_sets: Sequence[Override], owned: dict[str, str]) -> None:
    """Raise KeelError ``--set KEY<owned[KEY]>`` for the first of the user's ``--set`` strings whose
    key is in ``owned``: a key the runs set themselves, which would silently win over the ``--set``.
    Typed pairs (a sweep preset's ``[set]`` table, which may fix the base its grid varies) pass."""
    for x in user_sets:
        k = x.split("=", 1)[0].strip() if isinstance(x, str) else None
        if k in owned:
            raise KeelError(f"--set {k}{owned[k]}")
