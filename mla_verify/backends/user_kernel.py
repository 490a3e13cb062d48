"""``--kernel MODULE:ATTR`` or ``--kernel path/to/file.py:ATTR``: any Contract-1 callable becomes a backend,
held to trtllm-gen's envelope.

A kernel may declare another envelope with an attribute holding Envelope field overrides::

    my_decode.mla_verify_envelope = {"page_sizes": [16, 64], "devices": ["cpu"], "q_len": [1, 4]}

Lists stand for tuples; ``archs`` and ``dims`` are lists of pairs. Unknown fields or ill-typed values are a
UsageError (exit 2), never a silent fallback to the default envelope. See docs/backends.md.
"""
from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import os
import pkgutil
import re
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..core.errors import UsageError, did_you_mean
from ..core.tracebacks import exception_line
from ..problems.generate import DTYPES
from ..problems.layouts import CACHE_DIMS, TABLE_WIDTHS
from .base import Backend, Envelope
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
    "dims_by_dtype": (lambda v: isinstance(v, (list, tuple)) and all(
        isinstance(x, (list, tuple)) and len(x) == 2 and x[0] in DTYPES and _pairs(x[1]) for x in v),
        'a list of [dtype, [[kv_lora_rank, qk_rope_head_dim], ...]] pairs, e.g. [["fp8", [[512, 64]]]]'),
    "heads": (lambda v: v is None or (_ints(v) and all(x >= 1 for x in v)), "null or a list of ints >= 1"),
    "max_heads": (lambda v: _int(v) and v >= 1, "an int >= 1"),
    "dtypes": (_among(tuple(DTYPES)), f"a non-empty list of {sorted(DTYPES)}"),
    "q_len": (lambda v: _ints(v) and len(v) == 2 and 1 <= v[0] <= v[1], "[min, max] with 1 <= min <= max"),
    "q_lens": (lambda v: v is None or (_ints(v) and all(x >= 1 for x in v)), "null or a list of ints >= 1"),
    "ragged_q": (lambda v: v is False, "false: Contract 1's callable takes one q_len for every request"),
    "batch_sizes": (lambda v: v is None or (_ints(v) and all(x >= 1 for x in v)), "null or a list of ints >= 1"),
    "windows": (lambda v: isinstance(v, (list, tuple)) and len(v) > 0
                and all(x is None or (_int(x) and x >= 0) for x in v),
                "a non-empty list of window_left values (null: plain causal, or an int >= 0)"),
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
        raise UsageError(f"{owner}: unknown envelope field(s) {unknown}{did_you_mean(unknown[0], _FIELDS)}; "
                         f"known: {', '.join(_FIELDS)}")
    for name, value in overrides.items():
        check, expected = _FIELDS[name]
        if not check(value):
            raise UsageError(f"{owner}: envelope field '{name}' must be {expected}, got {value!r}")
    return base.narrowed(**{k: _tupled(v) for k, v in overrides.items()})


def load_kernel(target: str, flag: str = "--kernel", recorded: Any = None) -> Backend:
    """``"pkg.mod:attr"`` or ``"path/to/file.py:attr"`` (attr may be dotted) -> a backend calling that callable,
    or the ``Backend`` instance it names (a copy, named ``target``).

    A module is found as ``python -m`` finds it: the current directory first, then sys.path. A file is run as
    a module of its own, its directory first on sys.path (as ``python path/to/file.py`` has it), so it can
    import the files beside it. ``recorded`` is a reproducer's ``Backend.source``: the recorded file, and the
    module's recorded folder first on sys.path, so a replay finds the kernel from any directory. Every error
    is a one-line UsageError naming ``flag``.
    """
    module, _, obj = resolve_kernel(target, flag, recorded)
    if isinstance(obj, Backend):  # named as the run names it, so that a worker or a replay loads it by that name
        backend = copy.copy(obj)
        backend.name = target
    else:
        backend = kernel_backend(obj, target)
    backend.source = _source_of(target.rpartition(":")[0], module)
    return backend


def resolve_kernel(target: str, flag: str = "--kernel", recorded: Any = None) -> tuple[ModuleType, str, Any]:
    """(module imported, dotted attribute path, the object) for ``target`` as ``load_kernel`` reads it."""
    source, _, attr_path = target.rpartition(":")  # rpartition: a Windows path has a drive colon
    if not source or not _ATTR_PATH.fullmatch(attr_path):
        raise UsageError(f"{flag} expects MODULE:ATTR or path/to/file.py:ATTR "
                         f"(e.g. my_pkg.kernels:decode or kernels.py:decode), got {target!r}")
    # a hand-edited reproducer may hold anything: only strings are taken from it
    where = {k: v for k, v in recorded.items() if isinstance(v, str)} if isinstance(recorded, dict) else {}
    obj: Any
    if _is_path(source):
        obj = _import_file(where["file"] if os.path.isfile(where.get("file", "")) else source, flag)
    elif _MODULE.fullmatch(source):
        obj = _import_module(source, flag, where.get("sys_path"))
    else:
        raise UsageError(f"{flag}: {source!r} is neither a module name nor a path to a .py file")
    module, owner = obj, source
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("__")]
            raise UsageError(f"kernel '{target}': '{owner}' has no attribute '{part}'{did_you_mean(part, names)}")
        obj, owner = getattr(obj, part), part
    return module, attr_path, obj


def _source_of(source: str, module: ModuleType) -> dict[str, str] | None:
    """Where a kernel's module was loaded from (Backend.source); None for a module without a file."""
    file = getattr(module, "__file__", None)
    if not file:
        return None
    path = os.path.abspath(file)
    if _is_path(source):
        return {"file": path}
    package = os.path.dirname(path) if os.path.basename(path) == "__init__.py" else path
    root = package
    for _ in source.split("."):  # pkg.mod from ROOT/pkg/mod.py: up one folder per dotted part
        root = os.path.dirname(root)
    return {"file": path, "sys_path": root}


def kernel_backend(fn: Any, name: str) -> TrtllmStyleBackend:
    """A backend named ``name`` calling the Contract-1 callable ``fn``, held to its declared envelope (or
    trtllm-gen's); its description is the first line of its docstring."""
    if not callable(fn):
        raise UsageError(f"kernel '{name}' is a {type(fn).__name__}, not a callable")
    declared = getattr(fn, ENVELOPE_ATTR, None)
    envelope = TRTLLM_ENVELOPE if declared is None else envelope_from_overrides(declared, owner=f"kernel '{name}'")
    doc = (getattr(fn, "__doc__", None) or "").strip().splitlines()
    return TrtllmStyleBackend(name, fn, envelope, doc[0] if doc else f"user kernel {name}")


_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_ATTR_PATH = _MODULE  # attributes are dotted identifiers too


def _is_path(source: str) -> bool:
    return source.endswith(".py") or "/" in source or os.sep in source


def _first_on_sys_path(directory: str) -> None:
    """Put ``directory`` first on sys.path unless it is already there (``""`` stands for the current one)."""
    here = os.path.abspath(directory)
    if not any(os.path.abspath(p or os.curdir) == here for p in sys.path):
        sys.path.insert(0, here)


def _import_module(name: str, flag: str, recorded_dir: str | None = None) -> ModuleType:
    _first_on_sys_path(os.curdir)
    if recorded_dir is not None and sys.path[0] != recorded_dir:
        sys.path.insert(0, recorded_dir)  # before the current directory: the recorded kernel, not a namesake
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            recorded = f", in {recorded_dir} (where the reproducer recorded it)" if recorded_dir else ""
            nearby = did_you_mean(name, (m.name for m in pkgutil.iter_modules([os.curdir])))
            raise UsageError(f"{flag}: kernel module '{name}'{nearby} not found in the current directory "
                             f"({os.getcwd()}){recorded} or on sys.path; a file is given as path/to/file.py:ATTR"
                             ) from None
        raise UsageError(f"{flag}: importing kernel module '{name}' failed: {exception_line(exc)}") from None
    except (Exception, SystemExit) as exc:  # a module that fails (or exits) while importing: one line
        raise UsageError(f"{flag}: importing kernel module '{name}' failed: {exception_line(exc)}") from None


def _import_file(path_text: str, flag: str) -> ModuleType:
    path = os.path.abspath(os.path.expanduser(path_text))
    if not os.path.isfile(path):
        raise UsageError(f"{flag}: kernel file {path_text} " + ("is not a file" if os.path.exists(path)
                                                              else "does not exist"))
    if not path.endswith(".py"):
        raise UsageError(f"{flag}: kernel file {path_text} is not a .py file")
    # one module per file, under a name no other module has: loading the same file again reuses it
    name = "mla_verify_user_kernel_" + hashlib.sha256(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    _first_on_sys_path(os.path.dirname(path))
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py path always has a source loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it, as import does: dataclasses and pickling look it up
    try:
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[name]
        raise UsageError(f"{flag}: running kernel file {path_text} failed: {exception_line(exc)}") from None
    return module
