"""settings: a TOML table turned into a frozen keyword-only config dataclass, every key checked.

A config file's table meets its dataclass here, one check per kind of mistake, each raising
ConfigError with where the key is and how to fix it:

    unknown keys       a typo gets "did you mean ...?" and the valid keys (and a key that
                       belongs elsewhere, what the class's KEY_NOTES say of it)
    missing settings   a field without a default that the table lacks, named
    TOML types         a quoted number, a string where a table belongs, an array of the wrong
                       elements
    the class's own    its `__post_init__` ValueError, prefixed with the table's name

`build_table` runs all four, and builds a field whose type is itself a config dataclass from its
sub-table the same way ([train.optimizer] inside [train]). Every TOML config is checked and built
by it (each caller opens and parses its own file): the agent's (agents/config.py, which uses the
pieces for its [agent] table and whole for its sub-tables; the engine registry for
[agent.engine]), the trainer's (trainer/config.py) and the training profiles
(app/training/profiles.py).

Not here: reading files, what any setting means (the config classes).
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any

from weightsync.errors import ConfigError

__all__ = [
    "build_table",
    "check_known_keys",
    "check_required",
    "check_type",
    "required_fields",
    "subsection",
    "toml_kind",
]


def build_table(
    cls: type, table: Mapping[str, Any], *, where: str, section: str, howto: Mapping[str, str] | None = None
) -> Any:
    """`cls(**table)` after every check of the module docstring; ConfigError naming the key.

    `where` is the file (or "agent settings"), `section` the table as a user writes it
    ("[agent.engine]"), `howto` a fix per required key for its "is missing" message. A field
    whose type is a config dataclass and whose value is a table is built from it first, as the
    section `[<section>.<key>]`."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: {section} must be a table, got {table!r} ({toml_kind(table)})")
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    check_known_keys(table, fields, where=where, section=section, notes=getattr(cls, "KEY_NOTES", None))
    check_required(table, required_fields(cls), where=where, section=section, howto=howto)
    hints = typing.get_type_hints(cls)
    built = dict(table)
    for key, value in table.items():
        nested = _dataclass_in(hints[key])
        if nested is not None and isinstance(value, Mapping):
            value = built[key] = build_table(nested, value, where=where, section=subsection(section, key))
        check_type(value, hints[key], where=where, name=f"{section} {key}")
    try:
        return cls(**built)
    except ValueError as e:
        raise ConfigError(f"{where}: {f'{section} ' if section else ''}{e}") from None


def subsection(section: str, key: str) -> str:
    """The table a key of `section` opens, as a user writes it: "[train]", "optimizer" -> "[train.optimizer]"."""
    inner = section.strip("[]")
    return f"[{inner}.{key}]" if inner else f"[{key}]"


def check_known_keys(
    table: Mapping[str, Any],
    fields: typing.Collection[str],
    *,
    where: str,
    section: str,
    notes: Mapping[str, str] | None = None,
) -> None:
    """ConfigError on the first key that is not one of `fields`, with the closest valid key, or
    what `notes` say of a key that belongs elsewhere."""
    for key in sorted(set(table) - set(fields)):
        named = f"{section} {key!r}" if section else repr(key)
        if notes and key in notes:
            raise ConfigError(f"{where}: unknown key {named}: {notes[key]}")
        close = difflib.get_close_matches(key, list(fields), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"{where}: unknown key {named}; {hint}valid keys: {sorted(fields)}")


def required_fields(cls: type) -> list[str]:
    """The fields of dataclass `cls` that have no default, in declaration order."""
    missing = dataclasses.MISSING
    return [f.name for f in dataclasses.fields(cls) if f.init and f.default is missing and f.default_factory is missing]


def check_required(
    table: Mapping[str, Any],
    required: typing.Iterable[str],
    *,
    where: str,
    section: str,
    howto: Mapping[str, str] | None = None,
) -> None:
    """ConfigError naming the first of `required` that the table lacks."""
    for key in required:
        if key not in table:
            fix = (howto or {}).get(key) or f"add {key} = ... to the {section or 'top-level'} table"
            raise ConfigError(f"{where}: {f'{section} {key}' if section else key} is missing: {fix}")


def check_type(value: Any, hint: Any, *, where: str, name: str) -> None:
    """TOML gives ints, floats, strings, bools, arrays and tables; refuse the wrong one for `hint`
    with the fix, e.g. a quoted number. `name` is the key as a user writes it ("[agent] workers")."""
    allowed = typing.get_args(hint) if _is_union(hint) else (hint,)
    if any(_accepts(kind, value) for kind in allowed):
        return
    names = " or ".join(_wanted(k) for k in allowed if k is not type(None) and _wanted(k)) or f"a {hint}"
    fix = ""
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
        if number is not None:
            fix = f"; write the number without quotes, e.g. {name.split()[-1]} = {value.strip()}"
    if isinstance(value, (list, tuple)) and _is_strings(hint) and any(not isinstance(v, str) for v in value):
        fix = '; every element must be a quoted string, e.g. ["10.0.0.2:7070"]'
    raise ConfigError(f"{where}: {name} must be {names}, got {value!r} ({toml_kind(value)}){fix}")


def toml_kind(value: Any) -> str:
    """What a value read from TOML is, in TOML's words ("a string", "a table", ...)."""
    for kind, name in (
        (bool, "a boolean"),
        (int, "an integer"),
        (float, "a number"),
        (str, "a string"),
        (dict, "a table"),
        ((list, tuple), "an array"),
    ):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _is_union(hint: Any) -> bool:
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union


def _dataclass_in(hint: Any) -> type | None:
    """The config dataclass a field's type names (alone or in a union with others), if any."""
    for kind in typing.get_args(hint) if _is_union(hint) else (hint,):
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            return kind
    return None


def _is_strings(hint: Any) -> bool:
    """Whether `hint` is (or allows) an array of strings."""
    kinds = typing.get_args(hint) if _is_union(hint) else (hint,)
    return any(typing.get_origin(k) is tuple and typing.get_args(k)[:1] == (str,) for k in kinds)


def _tuple_elements(kind: Any) -> tuple[Any, ...] | Any | None:
    """tuple[X, ...] -> X (any length); tuple[X, Y] -> (X, Y) (that length); bare tuple -> None."""
    args = typing.get_args(kind)
    if not args:
        return None
    if len(args) == 2 and args[1] is Ellipsis:
        return args[0]
    return args


def _accepts(kind: Any, value: Any) -> bool:
    origin = typing.get_origin(kind) or kind
    if kind is Any:
        return True
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (bool, str):
        return type(value) is origin
    if origin is type(None):
        return value is None
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        return isinstance(value, (str, origin))  # the class parses the string (and names the choices)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return False
        elements = _tuple_elements(kind)
        if elements is None:
            return True
        if isinstance(elements, tuple):
            return len(value) == len(elements) and all(_accepts(k, v) for k, v in zip(elements, value, strict=True))
        return all(_accepts(elements, v) for v in value)
    if origin in (dict, Mapping):
        return isinstance(value, Mapping)
    if origin is list:
        return isinstance(value, (list, tuple))
    # A class TOML cannot spell (ModelConfig): left to the config class's own checks.
    return not isinstance(value, (bool, int, float, str, list, tuple, dict))


def _wanted(kind: Any) -> str:
    origin = typing.get_origin(kind) or kind
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        return "a string"
    if origin is tuple:
        elements = _tuple_elements(kind)
        if isinstance(elements, tuple):
            kinds = {_PLURAL.get(k, _wanted(k)) for k in elements}
            return f"an array of {len(elements)} {kinds.pop()}" if len(kinds) == 1 else f"an array of {len(elements)}"
        if elements is not None and _wanted(elements):
            return "an array of " + _PLURAL.get(elements, _wanted(elements))
    if isinstance(origin, type) and dataclasses.is_dataclass(origin):
        return "a table"
    return {
        float: "a number",
        int: "an integer",
        bool: "true or false",
        str: "a string",
        tuple: "an array of strings",
        list: "an array",
        dict: "a table",
        Mapping: "a table",
    }.get(origin, "")


_PLURAL = {str: "strings", int: "integers", float: "numbers", bool: "booleans"}
