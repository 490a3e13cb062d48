"""A user's own cases (``check --cases DIR``, ``pytest --mla-cases DIR``): problems a kernel engineer knows
matter, judged first in every profile, on every backend of their problem kind (dense or sparse,
mla_verify/kinds) that the run checks (run/engine.py).

A case is a ``*.json`` file in DIR (not its subfolders), in one of two forms (docs/cli.md, "Your own cases"):

- a spec: ``{"spec": {"seq_lens": [257], "q_len": 2}}`` -- its kind's spec fields (dense: ProblemSpec's,
  ``seq_lens`` the one required; ``"problem_kind": "sparse"``: SparseSpec's), optionally ``"layout"``
  (LayoutSpec's fields) and ``"metamorphic"`` (one of the kind's relations, default "none"). Its problem is
  built from the spec, as a drawn case's is.
- a fixture (``"format": "mla-verify-fixture"``, records/fixtures.py, or a sparse reproducer of the format
  before): a reproducer from an earlier run dropped in as a regression case, a golden fixture, a shadow
  reproducer, or tensors saved with ``save_case``. One that stores its problem's tensors is judged on them, with
  or without a spec: tensors and scalars say everything (a spec only names the case; ``describing_spec`` writes
  one). One that stores none is rebuilt from its spec.

A file that is neither, or a case no backend could be given (a field that does not exist or has the wrong
type, lengths no problem can have), is refused with one line naming the file, before any case runs.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..core.dims import MLADims
from ..core.errors import FixtureError, MLAVerifyError, UsageError
from ..kinds import KINDS, kind_named
from ..problems.envelope import DENSE, SPARSE
from ..problems.generate import describing_spec
from ..problems.json_fields import FieldCheck, checked_fields, is_int
from ..problems.layouts import CACHE_DIMS, TABLE_WIDTHS, LayoutSpec, canonical_cache
from ..problems.problem import DecodeProblem
from ..problems.sparse import SPARSE_LAYOUT, SparseSpec
from .fixtures import FORMAT, LEGACY_SPARSE, Fixture, load_fixture, save_fixture

STORED_VALUES = "stored"  # the describing spec's ``values`` of stored tensors: "stored:<their sha256, cut>"
_CASE_FIELDS: dict[str, FieldCheck] = {  # a hand-written case's (its spec's and layout's are checked on their own)
    "problem_kind": (lambda v: v in KINDS, f"one of {list(KINDS)}"),
    "spec": (lambda v: True, "a spec"),
    "layout": (lambda v: True, "a layout"),
    "metamorphic": (lambda v: isinstance(v, str), "a relation's name"),
}
# what a hand-written case of each kind starts from, before its own "spec" and "layout" fields (a dense spec's
# record may leave out any field that has a default; a sparse one's names every field)
_SPEC_DEFAULTS = {SPARSE: SparseSpec().to_json()}
_LAYOUTS = {DENSE: LayoutSpec(), SPARSE: SPARSE_LAYOUT}
_LAYOUT_FIELDS: dict[str, FieldCheck] = {
    "cache_dims": (lambda v: v in CACHE_DIMS, f"one of {list(CACHE_DIMS)}"),
    "page_stride_pad": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "table_width": (lambda v: v in TABLE_WIDTHS, f"one of {list(TABLE_WIDTHS)}"),
    "pass_out": (lambda v: isinstance(v, bool), "true or false"),
    "return_lse": (lambda v: isinstance(v, bool), "true or false"),
}


@dataclass(frozen=True)
class UserCase:
    """One case of the user's (run/engine.py's ``GivenCase``)."""

    origin: str  # the file it came from
    spec: Any  # its kind's spec: rebuilds the problem, or (with ``problem``) describes it
    layout: LayoutSpec
    transform: str = "none"
    problem: Any = None  # the stored tensors (on CPU), where the spec does not rebuild them


def load_cases(directory: str | os.PathLike, flag: str = "--cases") -> list[UserCase]:
    """Every case in ``directory``, in file-name order; UsageError or FixtureError (one line) on the first that
    cannot be one, and on a directory that holds none."""
    folder = Path(directory)
    if not folder.is_dir():
        raise UsageError(f"{flag}: {folder} " + ("is not a directory" if folder.exists() else "does not exist"))
    paths = sorted(folder.glob("*.json"))
    if not paths:
        raise UsageError(f"{flag}: {folder} holds no case (*.json files; docs/cli.md, \"Your own cases\")")
    return [load_case(path) for path in paths]


def load_case(path: Path) -> UserCase:
    """The case in ``path``: a hand-written spec or a fixture (the module docstring)."""
    try:
        meta = json.loads(path.read_bytes())
    except OSError as e:
        raise FixtureError(f"{path}: cannot read: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FixtureError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None
    if isinstance(meta, dict) and ("format" in meta or meta.get("kind") == LEGACY_SPARSE):
        return _from_fixture(path)
    if not isinstance(meta, dict) or "spec" not in meta:
        raise FixtureError(f"{path}: neither a case ({{\"spec\": {{\"seq_lens\": [...], ...}}}}) nor an mla-verify "
                           f"fixture (\"format\": \"{FORMAT}\")")
    try:
        kind = kind_named(checked_fields(meta, _CASE_FIELDS, "case").get("problem_kind", DENSE))
        fields = meta["spec"]
        spec = kind.spec_from_json({**_SPEC_DEFAULTS.get(kind.name, {}), **fields} if isinstance(fields, dict)
                                   else fields)
        layout = replace(_LAYOUTS[kind.name], **checked_fields(meta.get("layout", {}), _LAYOUT_FIELDS, "layout"))
        kind.build(spec, "cpu")  # its lengths, dtype, values and scales, checked now rather than in a case
    except MLAVerifyError as e:
        raise FixtureError(f"{path}: {e}") from None
    except KeyError as e:  # a required spec field left out
        raise FixtureError(f"{path}: spec: {e.args[0]!r} is required") from None
    relations = ["none", *kind.relations]
    transform = meta.get("metamorphic", "none")
    if transform not in relations:
        raise FixtureError(f"{path}: metamorphic {transform!r} is not one of {relations} ({kind.name} decode)")
    return UserCase(str(path), spec, layout, transform)


def _from_fixture(path: Path) -> UserCase:
    fx = load_fixture(path)  # its own one-line errors
    return UserCase(str(path), fixture_spec(fx), fx.layout, fx.meta.get("metamorphic", "none"), fx.problem)


def fixture_spec(fx: Fixture) -> Any:
    """The spec of a fixture's case: the one it records, else (its tensors stored, no spec) one describing
    them, its ``values`` naming their hash so that two such cases have two ids."""
    if fx.spec is not None:
        return fx.spec
    assert fx.problem is not None  # load_fixture refuses a fixture with neither
    return describing_spec(fx.problem, f"{STORED_VALUES}:{str(fx.meta.get('tensors_sha256'))[:16]}")


def save_case(directory: str | os.PathLike, name: str, *, query: torch.Tensor, kv_cache: torch.Tensor,
              block_tables: torch.Tensor, seq_lens: torch.Tensor, kv_lora_rank: int, bmm1_scale: float,
              bmm2_scale: float = 1.0, qk_nope_head_dim: int = 128, layout: LayoutSpec | None = None,
              extra: dict[str, Any] | None = None) -> Path:
    """Tensors of a call of yours as a case: ``<directory>/<name>.json`` and ``.safetensors``, the arguments
    named as Contract 1 names them (a 4-D or page-strided cache is stored as its 3-D pages). ``layout``
    (default: the cache's rank, out passed, LSE asked) is how the case is laid out for each kernel; ``extra``
    goes into the JSON (a note, where the call came from). Returns the JSON's path; ProblemError (one line)
    when the tensors are not a decode problem."""
    cache = canonical_cache(kv_cache)
    dims = MLADims(kv_lora_rank, cache.shape[-1] - kv_lora_rank, qk_nope_head_dim, num_heads=query.shape[2])
    problem = DecodeProblem(query, cache.contiguous(), block_tables, seq_lens, dims, float(bmm1_scale),
                            float(bmm2_scale)).validate()
    layout = layout or LayoutSpec(cache_dims=kv_cache.dim())
    meta = {**(extra or {}), "kind": "case", "layout": layout.to_json(), "metamorphic": "none"}
    return save_fixture(directory, name, problem, meta)
