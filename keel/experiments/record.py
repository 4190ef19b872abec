"""One run's record, :class:`RunRecord`: what every grid, study table and verdict reads of a run
(its coordinates, status, losses, divergence verdict, thinned loss curve ...), declared once
with the check of each field, read and written in ``report.json``'s ``runs`` by
:meth:`RunRecord.from_dict` (the one validation) and :meth:`RunRecord.to_dict`.

Where a record comes from: a run folder and its ``result.json``
(:func:`keel.experiments.study.records.run_record`), or an earlier ``report.json`` (``keel study
--restore``: :meth:`RunRecord.from_dict`). A grid job's result itself, which keeps every
key its task returned, is :class:`keel.experiments.job_result.JobResult`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from keel.errors import KeelError
from keel.experiments.job_result import is_number

RUN_STATUSES = ("done", "superseded", "error", "pending")  # a report's run statuses; the first two are restored
CURVE_KEYS = ("step", "loss", "lr", "val_step", "val_loss")


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _curve_ok(x) -> bool:
    """A thinned loss curve: the five lists of numbers (or nulls), the training ones of one length and
    the validation ones of another."""
    if not isinstance(x, dict) or not all(isinstance(x.get(k), list) and all(v is None or is_number(v) for v in x[k])
                                          for k in CURVE_KEYS):
        return False
    return len(x["step"]) == len(x["loss"]) == len(x["lr"]) and len(x["val_step"]) == len(x["val_loss"])


def _ablation_ok(x) -> bool:
    return isinstance(x, dict) and is_number(x.get("ppl_full")) and isinstance(x.get("delta_ppl"), list) \
        and all(map(is_number, x["delta_ppl"]))


def _test_loops_ok(x) -> bool:
    return isinstance(x, dict) and all(isinstance(k, str) and k.isdigit() and int(k) >= 1 for k in x) \
        and all(v is None or (is_number(v) and 0 <= v < math.inf) for v in x.values())


def _field(default: Any = None, check: Callable[[Any], bool] | None = None, words: str = "", *,
           finished: bool = False, factory: Callable[[], Any] | None = None, stored: bool = True):
    """A :class:`RunRecord` field with its check (``check(value)``; ``words`` say what it must be).
    ``finished``: a finished (``done`` / ``superseded``) record read from a report must have it;
    ``stored``: the field is written in ``report.json`` (the run's ``result`` is not)."""
    meta = {"check": check, "words": words, "finished": finished, "stored": stored}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _null_or(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda x: x is None or check(x)


@dataclass(eq=False)
class RunRecord:
    """One planned run of a grid or study and what it measured.

    Coordinates: ``group``, ``name`` (the run folder's name), ``scheme`` (``model.residual``),
    ``sublayers`` (2 x ``model.n_layers``), ``seed``, ``lr`` (the peak LR; a ramp's peak),
    ``scheme_version`` (the scheme's implementation version), ``values`` (the grid values that
    named the run). ``status``: one of :data:`RUN_STATUSES`. Measures of a finished run: ``tokens``
    trained; ``final_val_loss`` / ``first_val_loss`` (nats/token; the step-0 loss for the latter);
    ``capped_loss`` (final, or the step-0 loss when the run has no finite final loss); ``verdict``,
    ``divergence`` (``{mode, step, evidence}``) and ``diverged`` of the divergence classifier;
    ``max_lr`` (a ramp's LR before divergence), ``peak_lr`` (a ramp's peak); ``wall_s`` (seconds);
    ``plateau_exit_step``; ``curve`` (the thinned loss curve: ``step``, ``loss``, ``lr``,
    ``val_step``, ``val_loss`` lists); ``early_spike`` (nats/token); ``ablation``
    (``{ppl_full, delta_ppl}``); ``test_loops`` (a looped run's validation loss, nats/token, per loop count
    R' as text: ``{"8": 4.1}``; null where not finite). ``restored``: read from an earlier report; ``message``: why a
    run failed; ``unigram_entropy`` (nats): kept with a restored run; ``result``: the run's
    ``result.json`` (not written in ``report.json``).

    ``stored`` (keyword, not a field of the report): the keys the record's ``report.json`` entry
    holds, in order; a record read from a report keeps the keys it had, so that a report written
    again is the same bytes (records of older reports lack ``scheme_version``, ``values``,
    ``early_spike``, ``ablation``, ``test_loops``). The read-only mapping view (``rec["lr"]``, ``rec.get``,
    ``rec.items()``, ``{**rec}``, ``rec.update``) serves modules that have not moved to attribute
    access yet.
    """

    group: str = _field(check=lambda x: isinstance(x, str) and bool(x), words="a group name", finished=True)
    name: str = _field(check=lambda x: isinstance(x, str) and bool(x), words="a run name", finished=True)
    scheme: str | None = _field(check=lambda x: isinstance(x, str), words="a scheme name", finished=True)
    sublayers: int = _field(0, _int, "an integer", finished=True)
    seed: int | None = _field(check=_int, words="an integer", finished=True)
    lr: float | None = _field(check=is_number, words="a number", finished=True)
    scheme_version: int = _field(1, lambda x: _int(x) and x >= 1, "an implementation version >= 1")
    values: dict = _field(check=lambda x: isinstance(x, dict), words="the grid values (an object)", factory=dict)
    status: str = _field("pending", lambda x: x in RUN_STATUSES, "one of " + ", ".join(RUN_STATUSES))
    tokens: int | None = _field(check=_null_or(lambda x: _int(x) and x >= 0), words="a token count or null",
                                finished=True)
    final_val_loss: float | None = _field(check=_null_or(lambda x: is_number(x) and x >= 0),
                                          words="a loss >= 0 or null", finished=True)
    first_val_loss: float | None = _field(check=_null_or(lambda x: is_number(x) and x >= 0),
                                          words="a loss >= 0 or null", finished=True)
    capped_loss: float | None = _field(check=lambda x: is_number(x) and 0 <= x < math.inf,
                                       words="a finite loss >= 0 (nats/token)", finished=True)
    verdict: str | None = _field(check=_null_or(lambda x: isinstance(x, str)), words="a string or null", finished=True)
    divergence: dict | None = _field(check=_null_or(lambda x: isinstance(x, dict) and isinstance(x.get("mode"), str)),
                                     words="a divergence verdict ({mode, step, evidence}) or null", finished=True)
    diverged: bool | None = _field(check=_null_or(lambda x: isinstance(x, bool)), words="true, false or null",
                                   finished=True)
    max_lr: float | None = _field(check=_null_or(is_number), words="a number or null", finished=True)
    peak_lr: float | None = _field(check=_null_or(is_number), words="a number or null", finished=True)
    wall_s: float | None = _field(check=_null_or(lambda x: is_number(x) and 0 <= x < math.inf),
                                  words="seconds >= 0 or null", finished=True)
    plateau_exit_step: int | None = _field(check=_null_or(_int), words="a step or null", finished=True)
    curve: dict | None = _field(check=_null_or(_curve_ok), finished=True,
                                words="a thinned loss curve or null (step, loss and lr lists of one length, "
                                      "val_step and val_loss of another)")
    early_spike: float | None = _field(check=_null_or(lambda x: is_number(x) and x >= 0),
                                       words="a rise >= 0 (nats/token) or null")
    ablation: dict | None = _field(check=_null_or(_ablation_ok), words="an ablation ({ppl_full, delta_ppl: [...]}) "
                                                                       "or null")
    test_loops: dict | None = _field(check=_null_or(_test_loops_ok), words="a looped run's validation loss per loop "
                                     "count ({\"R'\": loss or null}) or null")
    restored: bool = _field(False, lambda x: isinstance(x, bool), "true or false")
    message: str | None = _field(check=_null_or(lambda x: isinstance(x, str)), words="a string or null")
    unigram_entropy: float | None = _field(check=_null_or(is_number), words="a number or null")
    result: dict = _field(factory=dict, stored=False)
    stored: tuple[str, ...] = field(default=(), repr=False, kw_only=True)

    # ------------------------------------------------------------------ report.json
    def to_dict(self) -> dict:
        """The record's ``report.json`` entry: its :attr:`stored` keys, in order."""
        return {k: getattr(self, k) for k in self.stored}

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "run record") -> RunRecord:
        """A record from its ``report.json`` entry ``d``, checked: a finished record (``done``,
        ``superseded``) must have every field a verdict or table reads (the ``finished`` ones;
        ``early_spike``, ``ablation`` and ``test_loops``, which earlier reports lack, may be missing); every field
        it has must pass its check; its scheme, depth, seed and LR must be the ones its name spells
        (:func:`name_contradiction`). Keys that are not fields are left out.

        Raises:
            KeelError: one line, ``{where}, run NAME: KEY must be WORDS, got VALUE`` (or ``; the
                record has no KEY``), naming the first bad field.
        """
        if not isinstance(d, Mapping):
            raise KeelError(f"{where} must be a run record (a JSON object), got {json.dumps(d, default=str)[:80]}")
        who = f"{where}, run {d['name']}" if isinstance(d.get("name"), str) else where
        fields = {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("stored")}
        status = d.get("status")
        if status not in RUN_STATUSES:
            raise KeelError(f"{who}: status must be {fields['status'].metadata['words']}, got {status!r}")
        for k, f in fields.items():
            if k not in d:
                if f.metadata["finished"] and status in ("done", "superseded"):
                    raise KeelError(f"{who}: {k} must be {f.metadata['words']}; the record has no {k}")
            elif not f.metadata["check"](d[k]):
                raise KeelError(f"{who}: {k} must be {f.metadata['words']}, got {d[k]!r}")
        keys = tuple(k for k in d if k in fields)
        rec = cls(**{k: d[k] for k in keys}, stored=keys)
        wrong = name_contradiction(rec)
        if wrong:
            raise KeelError(f"{who}: {wrong}")
        return rec

    @staticmethod
    def trains_again(d: object) -> bool:
        """``d``, a ``report.json`` entry not checked yet, is a run that did not finish (``error``,
        ``pending``): ``--restore`` leaves it out and the study trains it again."""
        return isinstance(d, dict) and d.get("status") in ("error", "pending")

    @staticmethod
    def was_restored(d: object) -> bool:
        """``d``, a ``report.json`` entry not checked yet, is a run restored from an earlier report."""
        return isinstance(d, dict) and bool(d.get("restored"))

    # ------------------------------------------------------------------ the mapping view
    def __getitem__(self, key: str) -> Any:
        if key not in _FIELD_NAMES:
            raise KeyError(key)
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        """The field ``key`` (``default`` for a name that is not a field)."""
        return getattr(self, key) if key in _FIELD_NAMES else default

    def keys(self) -> tuple[str, ...]:
        """The keys of the record's ``report.json`` entry (:attr:`stored`)."""
        return self.stored

    def items(self) -> Iterator[tuple[str, Any]]:
        """``(key, value)`` of the record's ``report.json`` entry (:meth:`to_dict`)."""
        return iter(self.to_dict().items())

    def __contains__(self, key: str) -> bool:
        return key in self.stored

    def update(self, values: Mapping | None = None, /, **kw) -> None:
        """Set fields (``rec.update(status="error", message=...)``); a field not stored yet is
        added at the end of :attr:`stored`, as a dict would add a key."""
        for k, v in {**(values or {}), **kw}.items():
            if k not in _FIELD_NAMES:
                raise KeyError(k)
            setattr(self, k, v)
            if k not in self.stored and k != "result":
                self.stored = (*self.stored, k)


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(RunRecord) if f.name != "stored")
# the keys of a report.json entry, in the order keel writes them
PENDING_KEYS = ("group", "name", "scheme", "sublayers", "seed", "lr", "scheme_version", "values", "status")
MEASURE_KEYS = ("tokens", "final_val_loss", "first_val_loss", "capped_loss", "verdict", "divergence", "diverged",
                "max_lr", "peak_lr", "wall_s", "plateau_exit_step", "curve", "early_spike", "ablation")
OPTIONAL_KEYS = ("test_loops",)  # measures stored only by a run that has one (every other report keeps its bytes)

_TRAIN_NAME = re.compile(r"L(?P<sublayers>\d+)_seed(?P<seed>-?\d+)_(?P<scheme>.+)_lr(?P<lr>[^_]+)(?:_v\d+)?")
_RAMP_NAME = re.compile(r"(?P<scheme>.+)-(?P<sublayers>\d+)sl-seed(?P<seed>-?\d+)")


def name_contradiction(rec: RunRecord) -> str:
    """What in ``rec`` contradicts its name, in words (empty when nothing does): a study's run
    name spells its coordinates (``L16_seed0_keel_lr0.001[_v2]``: sub-layers, seed, scheme, LR as
    ``{lr:g}``; a ramp's ``keel-64sl-seed0``), and a record whose fields say otherwise (a hand edit,
    a merge of two reports) would be paired with the wrong runs. A name of another form (a sweep's)
    is not read."""
    m = _TRAIN_NAME.fullmatch(rec.name) or _RAMP_NAME.fullmatch(rec.name)
    if m is None:
        return ""
    spelt = m.groupdict()
    have = {"scheme": rec.scheme, "sublayers": str(rec.sublayers), "seed": str(rec.seed),
            "lr": f"{rec.lr:g}" if is_number(rec.lr) else rec.lr}
    for k in ("scheme", "lr", "sublayers", "seed"):
        if k in spelt and spelt[k] != have[k]:
            return f"{k} must be the one its name spells ({spelt[k]}), got {getattr(rec, k)!r}"
    return ""
