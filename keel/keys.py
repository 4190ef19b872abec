"""One declaration per config key: :func:`key` makes a ``dataclasses.field`` whose metadata holds
its default, help text, allowed range, resume policy and whether a callback implements it; its
type, and for a ``Literal[...]`` annotation its allowed values, are the annotation on the same
line. Everything else about a key is read from that declaration: the load-time check
(:func:`check_key`), the rule as words (:func:`key_rule`), the allowed values
(:func:`choices`), what a resume does with a changed value (:func:`resume_policy`) and whether
only a training callback honours it (:func:`callback_test`). A renamed key's old name is mapped
here too (:data:`RENAMED_KEYS`, :func:`current_key`), as is a renamed parameter's
(:data:`RENAMED_PARAMS`, :func:`current_param_name`). The sections themselves (``[model]``,
``[data]``, ``[train]``) are in :mod:`keel.config`, a study group's keys in its ``Group``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Union, get_args, get_origin, get_type_hints

from keel.errors import KeelError

log = logging.getLogger(__name__)

# What a resume does when the key's value differs from the checkpoint's (keel.train.resume):
# "refuse" (the continuation would be another run: one-line error), "apply" (from the resumed
# step on, logged and recorded), "schedule" (applied, and the next step's LR reported).
ResumePolicy = Literal["refuse", "apply", "schedule"]


def key(default: Any, help: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
        lt: float | None = None, nonempty: bool = False, unique: bool = False, note: str = "",
        on_resume: ResumePolicy | None = None, callback: Callable[[Any], bool] | None = None,
        read_if: Callable[[Any], bool] | None = None) -> Any:
    """Declare one config key: a ``dataclasses.field`` whose metadata holds everything about it.

    Args:
        default: the default value (a list or dict is copied per instance; None = unset).
        help: one line for ``keel config``.
        ge, gt, le, lt: inclusive / exclusive bounds of a number, also of each number in a list or
            table key (``lrs: list[float]``, gt=0: every LR > 0); a float must also be finite.
        nonempty: a string key, a list key, each list of a table key (``dict[str, list[int]]``) is not empty.
        unique: the items of a list key (of each list of a table key) are distinct.
        note: said in parentheses after the rule in the error message and the help (``0 = off``).
        on_resume: what a resume does with a changed value (:data:`ResumePolicy`); None: the
            section's ``ON_RESUME`` (model and data: "refuse", train: "apply").
        callback: for a key only a training callback implements, the test of whether the section
            object asks for it (e.g. ``lambda t: t.gradflow_every > 0``); a trainer without that
            callback refuses such a config (:func:`keel.train.callbacks.unhonoured_keys`).
        read_if: for a key only some objects read, the test of whether one does (a ramp group's
            ``peak_lr``: is it one of its kind's keys); see :func:`unread_keys`.
    Returns:
        a ``dataclasses.Field`` to assign to the key's annotated name.
    """
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "nonempty": nonempty, "note": note,
            "unique": unique, "on_resume": on_resume, "callback": callback, "read_if": read_if}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class KeyType:
    """A key's type, read from its annotation: ``base`` (bool, int, float, str, list or dict),
    ``values`` (the ``Literal[...]`` values, of the items for a list; () = any), ``optional``
    (None allowed = unset), ``text`` (as ``keel config`` prints it), ``hint`` (of a list or table)."""

    base: type
    values: tuple = ()
    optional: bool = False
    text: str = ""
    hint: Any = None


@functools.lru_cache(maxsize=None)
def key_type(cls: type, name: str) -> KeyType:
    """The :class:`KeyType` of field ``name`` of the section class ``cls``."""
    hint = get_type_hints(cls)[name]
    text = str(next(f.type for f in dataclasses.fields(cls) if f.name == name))
    if get_origin(hint) in (list, dict):
        item = get_args(hint)[-1]
        values = get_args(item) if get_origin(item) is Literal else ()
        return KeyType(get_origin(hint), values, False, f"list of {choices_text(values)}" if values else text, hint)
    parts = get_args(hint) if get_origin(hint) in (Union, type(int | str)) else (hint,)
    optional = type(None) in parts
    values = tuple(v for p in parts if get_origin(p) is Literal for v in get_args(p))
    bases = [p for p in parts if p is not type(None) and get_origin(p) is not Literal]
    base = bases[0] if bases else str
    if values:
        text = " | ".join([b.__name__ for b in bases] + [repr(v) for v in values] + (["None"] if optional else []))
    return KeyType(base, values, optional, text)


def choices(cls: type, name: str) -> tuple | None:
    """The values a field may take, as declared by its ``Literal[...]`` annotation (for a
    ``list[Literal[...]]`` field, those of its items); None for a field without one."""
    return key_type(cls, name).values or None


def choices_text(values: tuple) -> str:
    return " | ".join(map(repr, values))


def _num(x: float) -> str:
    """A bound as text: ``2**32 - 1`` for 2**k - 1 (k >= 16), else ``%g``."""
    if isinstance(x, int) and x >= 2**16 - 1 and (x + 1) & x == 0:
        return f"2**{(x + 1).bit_length() - 1} - 1"
    return f"{x:g}"


def _bounds_text(m: Mapping[str, Any], base: type) -> str:
    lo = (">=", m["ge"]) if m["ge"] is not None else (">", m["gt"]) if m["gt"] is not None else None
    hi = ("<=", m["le"]) if m["le"] is not None else ("<", m["lt"]) if m["lt"] is not None else None
    if lo and hi:
        if lo[0] == ">" and hi[0] == "<":
            return f"between {_num(lo[1])} and {_num(hi[1])} (exclusive)"
        if lo[0] == ">=" and hi[0] == "<=":
            return f"between {_num(lo[1])} and {_num(hi[1])}"
        return f"in {'[' if lo[0] == '>=' else '('}{_num(lo[1])}, {_num(hi[1])}{']' if hi[0] == '<=' else ')'}"
    one = lo or hi
    if one is None:
        return ""
    return f"{'a finite number ' if base is float else ''}{one[0]} {_num(one[1])}"


_NOUNS = {int: "integers", float: "numbers", str: "strings"}


def _items_text(m: Mapping[str, Any], hint: Any, one: bool = False) -> str:
    """Values of type ``hint`` as words: ``numbers > 0``, ``lists of 'a' | 'b'`` (``one``: ``a list of ...``)."""
    a, s = ("a ", "") if one else ("", "s")
    if get_origin(hint) is dict:
        return f"{a}table{s} of {_items_text(m, get_args(hint)[1])}"
    if get_origin(hint) is list:
        return (f"{a}{'non-empty ' if m['nonempty'] else ''}list{s} of {'distinct ' if m['unique'] else ''}"
                f"{_items_text(m, get_args(hint)[0])}")
    if get_origin(hint) is Literal:
        return choices_text(get_args(hint))
    return f"{_NOUNS.get(hint, 'values')} {_bounds_text(m, None)}".strip()


def key_rule(cls: type, name: str) -> str:
    """The rule of field ``name`` as words (``">= 1"``, ``"in [0, 1)"``, ``"'a' | 'b'"``,
    ``"a non-empty string"``, ``"a list of numbers > 0"``, with its note), as the error message
    and ``keel config`` say it; "" for a key with no rule beyond its type."""
    m, t = key_field(cls, name).metadata, key_type(cls, name)
    rule = _bounds_text(m, t.base)
    if t.hint is not None:
        rule = _items_text(m, t.hint, one=True)
    elif t.values:
        rule = choices_text(t.values) + (f" or {rule or 'an integer'}" if t.base is int else "")
    elif m["nonempty"]:
        rule = "a non-empty string"
    return f"{rule} ({m['note']})" if rule and m["note"] else rule


@functools.lru_cache(maxsize=None)
def key_field(cls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def _in_bounds(m: Mapping[str, Any], x: Any) -> bool:
    if isinstance(x, float) and not math.isfinite(x):
        return False
    return ((m["ge"] is None or x >= m["ge"]) and (m["gt"] is None or x > m["gt"])
            and (m["le"] is None or x <= m["le"]) and (m["lt"] is None or x < m["lt"]))


def _ok(m: Mapping[str, Any], base: Any, value: Any, values: tuple = ()) -> bool:
    """Whether one (already typed) value of type ``base`` (a list or table: and its items) meets the declaration ``m``."""
    if get_origin(base) in (dict, list):
        return _ok_container(m, base, value)
    if get_origin(base) is Literal:
        return value in get_args(base)
    if values and value in values:
        return True
    if values and base is not int:
        return False
    if base is bool:  # "false" is truthy: the model read it as True where the trainer's coerce_key read False
        return isinstance(value, bool)
    if base in (int, float):
        wanted = (int,) if base is int else (int, float)
        return isinstance(value, wanted) and not isinstance(value, bool) and _in_bounds(m, value)
    if base is str and not isinstance(value, str):
        return False
    return not (m["nonempty"] and not value)


def _ok_container(m: Mapping[str, Any], base: Any, value: Any) -> bool:
    """:func:`_ok` of a table (``dict[str, T]``: each value meets ``m`` as a ``T``) or a list (``list[T]``: each
    item meets ``m`` as a ``T``, and the list is non-empty and its items unique where ``m`` asks)."""
    if get_origin(base) is dict:
        return isinstance(value, dict) and all(_ok(m, get_args(base)[1], v) for v in value.values())
    return (isinstance(value, list) and bool(value or not m["nonempty"])
            and all(_ok(m, get_args(base)[0], x) for x in value) and (not m["unique"] or len(set(value)) == len(value)))


def check_key(obj: Any, section: str, name: str, sep: str = ".") -> None:
    """Check the value of one key of a section object against its declaration (:func:`key`).

    Raises:
        KeelError: ``"{section}{sep}{name} must be {rule}, got {value!r}"`` (for a list key, naming
            the first bad item); an unset optional key (None) passes.
    """
    value, t, m = getattr(obj, name), key_type(type(obj), name), key_field(type(obj), name).metadata
    if value is None and t.optional:
        return
    if not _ok(m, t.hint or t.base, value, t.values):
        rule = key_rule(type(obj), name)
        if t.base is int and not t.values and (isinstance(value, bool) or not isinstance(value, int)):
            rule = f"an integer {rule}".strip()  # (a config's value is one by now: keel.config.coerce_key)
        if t.base is bool:
            rule = "True or False (a bool)"
        if t.base is list and isinstance(value, list):  # name the first bad item
            value = next((x for x in value if not _ok(m, get_args(t.hint)[0], x)), value)
        raise KeelError(f"{section}{sep}{name} must be {rule or f'of type {t.text}'}, got {value!r}")


def key_names(cls: type) -> list[str]:
    """The fields of ``cls`` declared by :func:`key` (its keys), in declaration order."""
    return [f.name for f in dataclasses.fields(cls) if "help" in f.metadata]


def check_keys(obj: Any, section: str, sep: str = ".") -> None:
    """:func:`check_key` for every key of a section object, in declaration order, but a key it does not
    read (its ``read_if`` test false for ``obj``) left at its default (a grid group's empty ``schemes``)."""
    for name in key_names(type(obj)):
        f = key_field(type(obj), name)
        if f.metadata["read_if"] is None or f.metadata["read_if"](obj) or getattr(obj, name) != (
                f.default if f.default is not dataclasses.MISSING else f.default_factory()):
            check_key(obj, section, name, sep)


def unread_keys(obj: Any, given: Iterable[str]) -> list[str]:
    """The keys among ``given`` (those a file sets) that ``obj`` does not read: declared with a
    ``read_if`` test that is false for it (a ramp group's ``peak_lr`` in a train group), sorted."""
    tests = {n: key_field(type(obj), n).metadata["read_if"] for n in key_names(type(obj))}
    return sorted(n for n in given if tests.get(n) is not None and not tests[n](obj))


def did_you_mean(name: str, names: Iterable[str]) -> str:
    """`` (did you mean lr?)``: the name among ``names`` closest to ``name`` (``difflib``); "" when none is close."""
    close = difflib.get_close_matches(name, sorted(names), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def resume_policy(cls: type, name: str) -> ResumePolicy:
    """What a resume does with a changed value of field ``name`` of the section class ``cls``:
    its declared ``on_resume``, else the section's ``ON_RESUME``."""
    return key_field(cls, name).metadata["on_resume"] or cls.ON_RESUME


def callback_test(cls: type, name: str) -> Callable[[Any], bool] | None:
    """The declared ``callback`` test of field ``name`` (None: the trainer itself honours it)."""
    return key_field(cls, name).metadata["callback"]


# Keys renamed since runs saved them (old "section.name" -> new): older config files, checkpoints and
# --set strings are read under the new name (current_key), the one place a rename is recorded.
RENAMED_KEYS = {"train.checkpoint_k": "train.activation_checkpoint_k"}  # beside checkpoint_every (saving)
_RENAMES_SAID: set[str] = set()  # old names whose deprecation line this process has logged (once per key)


def current_key(dotted: str, warn: bool = False) -> str:
    """The current name of the key ``"section.name"`` (:data:`RENAMED_KEYS`; itself if not renamed).

    With ``warn`` (the name comes from the user: a config file, ``--set``, a typed override), an old
    name logs one deprecation line the first time this process meets it, e.g. ``train.checkpoint_k
    is now train.activation_checkpoint_k; update your config``. What keel wrote itself (a run's
    ``config.toml``, a checkpoint's config) is read quietly: the user has nothing to update there.
    """
    new = RENAMED_KEYS.get(dotted, dotted)
    if warn and new != dotted and dotted not in _RENAMES_SAID:
        _RENAMES_SAID.add(dotted)
        log.warning("%s is now %s; update your config", dotted, new)
    return new


# Parameter names renamed since checkpoints stored them: the module a block holds, old -> new, so
# ``blocks.N.attn_res.norm.weight`` is now ``blocks.N.attn_residual.norm.weight``. The one place such a
# rename is recorded: every reader of stored weights maps through it (a Block's load_state_dict hook,
# keel.train.checkpoint for sharded checkpoints, keel.train.state_dict for name-keyed optimizer states,
# keel.hf.modeling for exported folders). A Block's residual-scheme units were ``attn_res`` / ``ffn_res``,
# which read as the AttnRes scheme; the scheme itself (``model.residual = "attn_res"``) keeps its name.
RENAMED_PARAMS = {"attn_res": "attn_residual", "ffn_res": "ffn_residual"}
_BLOCK_MODULE = re.compile(r"(?<![^.])(blocks\.\d+\.)(\w+)(?=\.|$)")  # "blocks.N.<module>", at a name boundary


def current_param_name(name: str, old: bool = False) -> str:
    """The current name of the parameter or state-dict key ``name`` (:data:`RENAMED_PARAMS`; itself
    if not renamed), whatever comes before ``blocks.`` (``model.``, ``_orig_mod.``, ``optim.state.``);
    with ``old``, the other way: the name a checkpoint saved before the rename stores.

    >>> current_param_name("model.blocks.3.attn_res.norm.weight")
    'model.blocks.3.attn_residual.norm.weight'
    """
    table = {new: was for was, new in RENAMED_PARAMS.items()} if old else RENAMED_PARAMS
    return _BLOCK_MODULE.sub(lambda m: m[1] + table.get(m[2], m[2]), name)
