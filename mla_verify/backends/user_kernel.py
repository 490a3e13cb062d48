"""``--kernel MODULE:ATTR``: any Contract-1 callable becomes a backend, held to trtllm-gen's envelope.

A kernel may declare another envelope with an attribute holding Envelope field overrides::

    my_decode.mla_verify_envelope = {"page_sizes": [16, 64], "devices": ["cpu"], "q_len": [1, 4]}

Lists stand for tuples; ``archs`` and ``dims`` are lists of pairs. Unknown fields or ill-typed values are a
UsageError (exit 2), never a silent fallback to the default envelope. See docs/backends.md.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

from ..errors import UsageError
from ..generate import DTYPES
from ..layouts import CACHE_DIMS, TABLE_WIDTHS
from .base import Envelope
from .trtllm_style import TRTLLM_ENVELOPE, TrtllmStyleBackend

ENVELOPE_ATTR = "mla_verify_envelope"


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(_int(x) for x in v)


def _pairs(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(_ints(x) and len(x) == 2 for x in v)


def _among(allowed: Any) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, (list, tuple)) and len(v) > 0 and all(x in allowed for x in v)


# field -> (value check, what a valid value looks like)
_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "devices": (_among(("cpu", "cuda")), 'a non-empty list of "cpu"/"cuda"'),
    "archs": (lambda v: v is None or _pairs(v), "null or a list of [major, minor] pairs"),
    "page_sizes": (lambda v: v is None or (_ints(v) and all(x >= 1 for x in v)), "null or a list of ints >= 1"),
    "dims": (_pairs, "a list of [kv_lora_rank, qk_rope_head_dim] pairs"),
    "heads": (lambda v: v is None or (_ints(v) and all(x >= 1 for x in v)), "null or a list of ints >= 1"),
    "max_heads": (lambda v: _int(v) and v >= 1, "an int >= 1"),
    "dtypes": (_among(tuple(DTYPES)), f"a non-empty list of {sorted(DTYPES)}"),
    "q_len": (lambda v: _ints(v) and len(v) == 2 and 1 <= v[0] <= v[1], "[min, max] with 1 <= min <= max"),
    "cache_dims": (_among(CACHE_DIMS), f"a non-empty list of {list(CACHE_DIMS)}"),
    "page_strided": (lambda v: isinstance(v, bool), "true or false"),
    "table_widths": (_among(TABLE_WIDTHS), f"a non-empty list of {list(TABLE_WIDTHS)}"),
    "pass_out": (_among((True, False)), "a non-empty list of true/false"),
    "lse": (lambda v: isinstance(v, bool), "true or false"),
    "lse_base": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 1, "a number > 1"),
    "max_batch": (lambda v: _int(v) and v >= 1, "an int >= 1"),
    "max_seq_len": (lambda v: _int(v) and v >= 1, "an int >= 1"),
    "notes": (lambda v: isinstance(v, str), "a string"),
}


def _tupled(v: Any) -> Any:
    return tuple(_tupled(x) for x in v) if isinstance(v, (list, tuple)) else v


def envelope_from_overrides(overrides: Any, base: Envelope = TRTLLM_ENVELOPE, owner: str = "kernel") -> Envelope:
    """``base`` with a kernel's declared field overrides applied; UsageError naming the first bad field."""
    if not isinstance(overrides, dict):
        raise UsageError(f"{owner}: {ENVELOPE_ATTR} must be a dict of Envelope fields, "
                         f"got {type(overrides).__name__}")
    unknown = sorted(set(overrides) - set(_FIELDS))
    if unknown:
        raise UsageError(f"{owner}: unknown envelope field(s) {unknown}; known: {', '.join(_FIELDS)}")
    for name, value in overrides.items():
        check, expected = _FIELDS[name]
        if not check(value):
            raise UsageError(f"{owner}: envelope field '{name}' must be {expected}, got {value!r}")
    return base.narrowed(**{k: _tupled(v) for k, v in overrides.items()})


def load_kernel(target: str) -> TrtllmStyleBackend:
    """``"pkg.mod:attr"`` (attr may be dotted) -> a backend calling that Contract-1 callable."""
    module_name, sep, attr_path = target.partition(":")
    if not sep or not module_name or not attr_path:
        raise UsageError(f"--kernel expects MODULE:ATTR (e.g. my_pkg.kernels:decode), got {target!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise UsageError(f"kernel module '{module_name}' not found ({exc})") from None
    except (Exception, SystemExit) as exc:  # a module that fails (or exits) while importing: one line
        raise UsageError(f"importing kernel module '{module_name}' failed: {type(exc).__name__}: {exc}") from None
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"kernel '{target}': '{getattr(obj, '__name__', obj)}' has no attribute '{part}'")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"kernel '{target}' is a {type(obj).__name__}, not a callable")
    declared = getattr(obj, ENVELOPE_ATTR, None)
    envelope = TRTLLM_ENVELOPE if declared is None else envelope_from_overrides(declared, owner=f"kernel '{target}'")
    doc = (getattr(obj, "__doc__", None) or "").strip().splitlines()
    return TrtllmStyleBackend(target, obj, envelope, doc[0] if doc else f"user kernel {target}")
