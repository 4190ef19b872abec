"""One declaration per config key: :func:`key` makes a ``dataclasses.field`` whose metadata holds
its default, help text, allowed range, resume policy and whether a callback implements it; its
type, and for a ``Literal[...]`` annotation its allowed values, are the annotation on the same
line. Everything else about a key is read from that declaration: the load-time check
(:func:`check_key`), the rule as words (:func:`key_rule`), the allowed values
(:func:`choices`), what a resume does with a changed value (:func:`resume_policy`) and whether
only a training callback honours it (:func:`callback_test`). A renamed key's old name is mapped
here too (:data:`RENAMED_KEYS`, :func:`current_key`), as is a renamed parameter's
(:data:`RENAMED_PARAMS`, :func:`current_param_name`). The sections themselves
(``[model]``, ``[data]``, ``[train]``) are in :mod:`keel.config`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Union, get_args, get_origin, get_type_hints

from keel.errors import KeelError

log = logging.getLogger(__name__)

# What a resume does when the key's value differs from the checkpoint's (keel.train.resume):
# "refuse" (the continuation would be another run: one-line error), "apply" (from the resumed
# step on, logged and recorded), "schedule" (applied, and the next step's LR reported).
ResumePolicy = Literal["refuse", "apply", "schedule"]


def key(default: Any, help: str, *, ge: float | None = None, gt: float | None = None, le: float | None = None,
        lt: float | None = None, nonempty: bool = False, note: str = "", on_resume: ResumePolicy | None = None,
        callback: Callable[[Any], bool] | None = None) -> Any:
    """Declare one config key: a ``dataclasses.field`` whose metadata holds everything about it.

    Args:
        default: the default value (a list is copied per instance; None = unset).
        help: one line for ``keel config``.
        ge, gt, le, lt: inclusive / exclusive bounds of a number (a float key must also be finite).
        nonempty: a string key must not be empty.
        note: said in parentheses after the rule in the error message and the help (``0 = off``).
        on_resume: what a resume does with a changed value (:data:`ResumePolicy`); None: the
            section's ``ON_RESUME`` (model and data: "refuse", train: "apply").
        callback: for a key only a training callback implements, the test of whether the section
            object asks for it (e.g. ``lambda t: t.gradflow_every > 0``); a trainer without that
            callback refuses such a config (:func:`keel.train.callbacks.unhonoured_keys`).
    Returns:
        a ``dataclasses.Field`` to assign to the key's annotated name.
    """
    meta = {"help": help, "ge": ge, "gt": gt, "le": le, "lt": lt, "nonempty": nonempty, "note": note,
            "on_resume": on_resume, "callback": callback}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class KeyType:
    """A key's type, read from its annotation: ``base`` (bool, int, float, str or list),
    ``values`` (the ``Literal[...]`` values, of the items for a list; () = any), ``optional``
    (None allowed = unset) and ``text`` (as ``keel config`` prints it)."""

    base: type
    values: tuple = ()
    optional: bool = False
    text: str = ""


@functools.lru_cache(maxsize=None)
def key_type(cls: type, name: str) -> KeyType:
    """The :class:`KeyType` of field ``name`` of the section class ``cls``."""
    hint = get_type_hints(cls)[name]
    text = str(next(f.type for f in dataclasses.fields(cls) if f.name == name))
    if get_origin(hint) is list:
        values = get_args(get_args(hint)[0])
        return KeyType(list, values, False, f"list of {choices_text(values)}" if values else text)
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


def key_rule(cls: type, name: str) -> str:
    """The rule of field ``name`` as words (``">= 1"``, ``"in [0, 1)"``, ``"'a' | 'b'"``,
    ``"a non-empty string"``, with its note), as the error message and ``keel config`` say it;
    "" for a key with no rule beyond its type."""
    m, t = key_field(cls, name).metadata, key_type(cls, name)
    rule = _bounds_text(m, t.base)
    if t.values:
        rule = choices_text(t.values) + (f" or {rule or 'an integer'}" if t.base is int else "")
        rule = f"a list of {rule}" if t.base is list else rule
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


def _ok(cls: type, name: str, value: Any) -> bool:
    """Whether one (already typed) value meets field ``name``'s declaration."""
    t, m = key_type(cls, name), key_field(cls, name).metadata
    if t.values and value in t.values:
        return True
    if t.values and t.base is not int:
        return False
    if t.base in (int, float):
        wanted = (int,) if t.base is int else (int, float)
        return isinstance(value, wanted) and not isinstance(value, bool) and _in_bounds(m, value)
    if t.base is str and not isinstance(value, str):
        return False
    return not (m["nonempty"] and not value)


def check_key(obj: Any, section: str, name: str) -> None:
    """Check the value of one key of a section object against its declaration (:func:`key`).

    Raises:
        KeelError: ``"{section}.{name} must be {rule}, got {value!r}"`` (for a list key, naming
            the first bad item); an unset optional key (None) passes.
    """
    value, t = getattr(obj, name), key_type(type(obj), name)
    if value is None and t.optional:
        return
    for item in value if t.base is list and isinstance(value, list) else [value]:
        if not _ok(type(obj), name, item):
            rule = key_rule(type(obj), name) or f"of type {t.text}"
            raise KeelError(f"{section}.{name} must be {rule}, got {item!r}")


def check_keys(obj: Any, section: str) -> None:
    """:func:`check_key` for every key of a section object, in declaration order."""
    for f in dataclasses.fields(obj):
        check_key(obj, section, f.name)


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
