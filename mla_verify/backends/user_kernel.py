"""``--kernel MODULE:ATTR`` or ``--kernel path/to/file.py:ATTR``: any callable with one of the calling conventions
of Contract 1 (docs/contracts.md) becomes a backend, of the problem kind its convention computes:

- ``trtllm`` -- FlashInfer's ``trtllm_batch_decode_with_kv_cache_mla``, dense decode, held to trtllm-gen's
  envelope (``USER_ENVELOPE``: ``TRTLLM_ENVELOPE`` with no bit-level claims);
- ``trtllm-sparse`` -- the same function with ``sparse_mla_top_k``: sparse top-k decode, its block tables the
  ``[B, q_len, topk]`` token slots (``USER_TRTLLM_SPARSE_ENVELOPE``);
- ``flashmla-sparse`` -- FlashMLA's ``flash_mla_with_kvcache(..., indices=...)``: sparse decode over a packed
  FP8 cache (``USER_FLASHMLA_SPARSE_ENVELOPE``).

The convention is read from the function's signature (a parameter ``indices``: flashmla-sparse; one named
``sparse_mla_top_k``: trtllm-sparse; else trtllm) unless named (``--convention``, ``kernel_backend``'s
``convention``), and recorded where it was named, with where the kernel was loaded from (``Backend.source``),
so that a worker process or a replay calls it the same way. A kernel may declare another envelope with an
attribute holding field overrides of its convention's envelope (an ``Envelope``'s, or for sparse conventions a
``SparseEnvelope``'s -- the packed formats it reads among them)::

    my_decode.mla_verify_envelope = {"page_sizes": [16, 64], "devices": ["cpu"], "q_len": [1, 4],
                                     "split_sizes": [256]}
    my_sparse_decode.mla_verify_envelope = {"devices": ["cpu"], "formats": ["V32"]}

Lists stand for tuples; ``archs`` and ``dims`` are lists of pairs. Unknown fields or ill-typed values are a
UsageError (exit 2), never a silent fallback to the default envelope. See docs/backends.md.

A user's kernel claims no bit-level invariance by default: its metamorphic relations (the batch reversed, pages
moved, ...) are judged by the tolerance model, and bits that move within it are a note. ``"bit_invariant":
true`` claims every relation of its kind bit for bit, a list (e.g. ``["pages", "pool"]``; a sparse kernel's
``["pages"]``) those named (docs/contracts.md); a sparse relation that reorders a row's sum is judged within
tolerance whatever is claimed.
"""
from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import pkgutil
import re
import sys
from collections.abc import Callable
from dataclasses import replace
from types import ModuleType
from typing import Any

from ..core.errors import UsageError, did_you_mean
from ..core.tracebacks import exception_line
from ..problems.envelope import SparseEnvelope
from ..problems.generate import DTYPES
from ..problems.layouts import CACHE_DIMS, TABLE_WIDTHS
from ..problems.metamorphic import RELATIONS
from ..problems.packed import SCALE_CONVENTIONS
from ..problems.sparse import SPARSE_FORMATS, SPARSE_TRANSFORMS
from .base import AnyEnvelope, Backend
from .flashinfer_trtllm import TRTLLM_GEN_SPARSE_ENVELOPE, FlashInferSparseBackend
from .flashmla_api import FlashMLAApi
from .flashmla_sparse import FLASHMLA_SPARSE_ENVELOPE, FlashMLASparseBackend
from .trtllm_style import TRTLLM_ENVELOPE, TrtllmStyleBackend

ENVELOPE_ATTR = "mla_verify_envelope"
TRTLLM, TRTLLM_SPARSE, FLASHMLA_SPARSE = "trtllm", "trtllm-sparse", "flashmla-sparse"
CONVENTIONS = (TRTLLM, TRTLLM_SPARSE, FLASHMLA_SPARSE)
# what a user's kernel is held to unless it declares otherwise: its convention's envelope with no bit-level
# claims; a sparse one runs anywhere it says, by default on CPU and any GPU, within its library's limits
USER_ENVELOPE = TRTLLM_ENVELOPE.narrowed(bit_invariant=())
USER_TRTLLM_SPARSE_ENVELOPE = replace(TRTLLM_GEN_SPARSE_ENVELOPE, devices=("cuda", "cpu"), archs=None,
                                      pass_out=(True, False), bit_invariant=(),
                                      notes="trtllm-sparse convention (a user kernel)")
USER_FLASHMLA_SPARSE_ENVELOPE = replace(FLASHMLA_SPARSE_ENVELOPE, devices=("cuda", "cpu"), archs=None,
                                        bit_invariant=(), notes="flashmla-sparse convention (a user kernel)")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ints(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(_int(x) for x in v)


def _pairs(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(_ints(x) and len(x) == 2 for x in v)


def _among(allowed: Any) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, (list, tuple)) and len(v) > 0 and all(x in allowed for x in v)


def _claim(relations: tuple[str, ...]) -> tuple[Callable[[Any], bool], str]:
    """The check of a declared ``bit_invariant`` among ``relations``."""
    return (lambda v: isinstance(v, bool) or v == [] or _among(relations)(v),
            f"true (every relation bit for bit), false, or a list of {list(relations)}")


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
    "empty_lse": (lambda v: v is None or (isinstance(v, float) and math.isinf(v)),
                  "null (kv_len 0 not taken), or the LSE of their rows: -math.inf or math.inf"),
    "split_sizes": (lambda v: _ints(v) and all(x >= 1 for x in v), "a list of ints >= 1 (KV tokens per tile or split)"),
    "special_lengths": (lambda v: _ints(v) and all(x >= 1 for x in v), "a list of ints >= 1 (KV lengths)"),
    "notes": (lambda v: isinstance(v, str), "a string"),
    "bit_invariant": _claim(RELATIONS),
}


# a SparseEnvelope's fields, as _FIELDS an Envelope's
_SPARSE_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    **{k: _FIELDS[k] for k in ("devices", "archs", "page_sizes", "heads", "max_heads", "q_len", "pass_out",
                               "lse_base", "notes")},
    "formats": (_among(SPARSE_FORMATS), f"a non-empty list of {list(SPARSE_FORMATS)}"),
    "scales": (_among(SCALE_CONVENTIONS), f"a non-empty list of {list(SCALE_CONVENTIONS)}"),
    "topk_multiple": (lambda v: _int(v) and v >= 1, "an int >= 1"),
    "max_topk": (lambda v: _int(v) and v >= 1, "an int >= 1"),
    "topk_length_formats": (lambda v: isinstance(v, (list, tuple)) and all(x in SPARSE_FORMATS for x in v),
                            f"a list of {list(SPARSE_FORMATS)}"),
    "sinks": (lambda v: isinstance(v, bool), "true or false"),
    "bit_invariant": _claim(tuple(SPARSE_TRANSFORMS)),
}


def _tupled(v: Any) -> Any:
    return tuple(_tupled(x) for x in v) if isinstance(v, (list, tuple)) else v


def _field(name: str, value: Any, relations: tuple[str, ...]) -> Any:
    """A declared value as the envelope field holds it (``relations``: the envelope kind's, for bit_invariant)."""
    if name == "bit_invariant" and isinstance(value, bool):
        return relations if value else ()
    return _tupled(value)


def envelope_from_overrides(overrides: Any, base: AnyEnvelope = USER_ENVELOPE, owner: str = "kernel") -> Any:
    """``base`` (an Envelope or a SparseEnvelope) with a kernel's declared field overrides applied; UsageError
    naming the first bad field."""
    kind = type(base).__name__
    sparse = isinstance(base, SparseEnvelope)
    fields = _SPARSE_FIELDS if sparse else _FIELDS
    if not isinstance(overrides, dict):
        raise UsageError(f"{owner}: {ENVELOPE_ATTR} must be a dict of {kind} fields, "
                         f"got {type(overrides).__name__}")
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise UsageError(f"{owner}: unknown envelope field(s) {unknown}{did_you_mean(unknown[0], fields)}; "
                         f"known: {', '.join(fields)}")
    for name, value in overrides.items():
        check, expected = fields[name]
        if not check(value):
            raise UsageError(f"{owner}: envelope field '{name}' must be {expected}, got {value!r}")
    relations = tuple(SPARSE_TRANSFORMS) if sparse else RELATIONS
    return replace(base, **{k: _field(k, v, relations) for k, v in overrides.items()})


def load_kernel(target: str, flag: str = "--kernel", recorded: Any = None, convention: str | None = None) -> Backend:
    """``"pkg.mod:attr"`` or ``"path/to/file.py:attr"`` (attr may be dotted) -> a backend calling that callable,
    or the ``Backend`` instance it names (a copy, named ``target``).

    A module is found as ``python -m`` finds it: the current directory first, then sys.path. A file is run as
    a module of its own, its directory first on sys.path (as ``python path/to/file.py`` has it), so it can
    import the files beside it. ``recorded`` is a reproducer's ``Backend.source``: the recorded file, and the
    module's recorded folder first on sys.path, so a replay finds the kernel from any directory. Every error
    is a one-line UsageError naming ``flag``. ``convention`` names the callable's calling convention (else
    the recorded one, else its signature's); it is recorded in ``source``.
    """
    module, _, obj = resolve_kernel(target, flag, recorded)
    if convention is None and isinstance(recorded, dict) and isinstance(recorded.get("convention"), str):
        convention = recorded["convention"]
    if isinstance(obj, Backend):  # named as the run names it, so that a worker or a replay loads it by that name
        backend = copy.copy(obj)
        backend.name = target
    else:
        backend = kernel_backend(obj, target, convention, flag)
    backend.source = _source_of(target.rpartition(":")[0], module)
    if convention is not None and backend.source is not None:
        backend.source["convention"] = convention
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


def kernel_convention(fn: Any) -> str:
    """The calling convention ``fn``'s signature shows (the module docstring's rule)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: Contract 1's first convention
        return TRTLLM
    return FLASHMLA_SPARSE if "indices" in params else TRTLLM_SPARSE if "sparse_mla_top_k" in params else TRTLLM


def kernel_backend(fn: Any, name: str, convention: str | None = None, flag: str = "--convention") -> Backend:
    """A backend named ``name`` calling ``fn`` by its calling convention (``convention``, else its signature's),
    held to its declared envelope (or its convention's, with no bit-level claims); its description is the first
    line of its docstring."""
    if not callable(fn):
        raise UsageError(f"kernel '{name}' is a {type(fn).__name__}, not a callable")
    if convention is not None and convention not in CONVENTIONS:
        raise UsageError(f"{flag}: unknown calling convention '{convention}'{did_you_mean(convention, CONVENTIONS)}; "
                         f"known: {', '.join(CONVENTIONS)}")
    convention = convention or kernel_convention(fn)
    base: Any = {TRTLLM: USER_ENVELOPE, TRTLLM_SPARSE: USER_TRTLLM_SPARSE_ENVELOPE,
            FLASHMLA_SPARSE: USER_FLASHMLA_SPARSE_ENVELOPE}[convention]
    declared = getattr(fn, ENVELOPE_ATTR, None)
    envelope = base if declared is None else envelope_from_overrides(declared, base, owner=f"kernel '{name}'")
    doc = (getattr(fn, "__doc__", None) or "").strip().splitlines()
    description = doc[0] if doc else f"user kernel {name} ({convention} convention)"
    if convention == TRTLLM_SPARSE:
        return FlashInferSparseBackend(name, envelope, None, description, fn=fn)
    if convention == FLASHMLA_SPARSE:
        return FlashMLASparseBackend(name, FlashMLAApi(_no_schedule, _taking_its_own(fn)), envelope, description,
                                     own_kernel=True)
    return TrtllmStyleBackend(name, fn, envelope, description)


def _no_schedule(*args: Any, **kwargs: Any) -> tuple[None, None]:
    """A user's FlashMLA-convention kernel schedules itself: its tile_scheduler_metadata and num_splits are None."""
    return None, None


def _taking_its_own(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` called with the keyword arguments its signature takes only: FlashMLA's interfaces differ in a few
    (``kv_format``, ``use_legacy``), and a kernel of one's own may take fewer."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn
    if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return fn

    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **{k: v for k, v in kwargs.items() if k in params})
    return call


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
