"""Checking a spec read back from JSON (a reproducer, a fixture) field by field, so that a hand-edited or
damaged file is one line naming the field, not a traceback from deep inside the problem's construction."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ..core.errors import ProblemError

# what a field may hold: (check, what the error says it should be)
FieldCheck = tuple[Callable[[Any], bool], str]


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_ints(v: Any) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(is_int(n) for n in v)


def is_number(v: Any) -> bool:
    return is_int(v) or isinstance(v, float)


def checked_fields(d: Any, fields: Mapping[str, FieldCheck], what: str, required: bool = False) -> dict[str, Any]:
    """``d`` when it is an object of ``fields`` (all of them when ``required``), each of its type; else a
    ProblemError naming the first field that is not."""
    if not isinstance(d, dict):
        raise ProblemError(f"{what}: expected an object of fields, got {type(d).__name__}")
    unknown = set(d) - set(fields)
    if unknown:
        raise ProblemError(f"{what}: unknown field(s) {sorted(unknown)}")
    missing = sorted(set(fields) - set(d)) if required else []
    if missing:
        raise ProblemError(f"{what}: missing field(s) {missing}")
    for name, value in d.items():
        check, expected = fields[name]
        if not check(value):
            raise ProblemError(f"{what}: field {name!r} = {value!r} is not {expected}")
    return d
