"""Problem kinds: what differs between dense decode and sparse (top-k) decode, and nothing else.

One harness, one search, one verdict, one reproducer format and one report serve every kind; what a kind holds
(``ProblemKind``, base.py) is its spec and builder, its reference and same-precision baseline, its metamorphic
relations, its strategies and corner cases, the steps that make a failing case smaller, and its catalogue of
misreadings. ``kind_named`` finds a kind by the name its envelope (problems/envelope.py) and its records carry.

May import: core, problems, judge, draw. (tests/test_imports.py holds this rule.)
"""
from __future__ import annotations

from ..problems.envelope import DENSE, SPARSE
from .base import Case, ProblemKind, Relation
from .dense import DENSE_KIND
from .sparse import SPARSE_KIND

KINDS: dict[str, ProblemKind] = {DENSE: DENSE_KIND, SPARSE: SPARSE_KIND}

__all__ = ["Case", "KINDS", "ProblemKind", "Relation", "kind_named", "kind_of"]


def kind_named(name: str) -> ProblemKind:
    """The kind ``name`` (DENSE, SPARSE); ValueError for another name."""
    if name not in KINDS:
        raise ValueError(f"unknown problem kind {name!r}; known: {list(KINDS)}")
    return KINDS[name]


def kind_of(spec_or_problem: object) -> ProblemKind:
    """The kind whose spec, or problem, ``spec_or_problem`` is."""
    return next(k for k in KINDS.values() if isinstance(spec_or_problem, (k.spec_type, k.problem_type)))
