"""Make a failing case smaller where Hypothesis did not: the explicit corner cases, and drawn cases that are
minimal in Hypothesis's order of choices but not in size -- for every problem kind alike.

``simplify`` tries one change at a time -- first the kind's size reductions (``ProblemKind.smaller``: half the
batch, fewer heads or query tokens, shorter sequences or fewer top-k entries), then its incidental features set
to their plain values (``ProblemKind.plainer``) -- and keeps each change under which the case still fails,
until no change does or the attempts run out. A corner case that fails is so shrunk like a drawn one: it seeds
the search, it is not its end.
Import rule: the kinds and the backend envelope; it runs cases through the callable it is given.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from ..backends.base import AnyEnvelope
from ..draw.strategies import Case
from ..kinds import ProblemKind, kind_of

MAX_ATTEMPTS = 48  # cases run at most: a corner failure is big, and each attempt costs a case of its size
MAX_SECONDS = 30.0  # and at most this long: a 131072-token case costs ~1 s an attempt on a 2-core machine


def size(case: Case) -> tuple[int, int]:
    """What "smaller" means (ProblemKind.size): the (query token, head, key) triples, then the batch."""
    return kind_of(case.spec).size(case)


def simplify(case: Case, env: AnyEnvelope, fails: Callable[[Case], bool], kind: ProblemKind | None = None) -> Case:
    """The smallest case reached from ``case`` by single changes that keep ``fails(case)`` true: sizes first,
    within MAX_ATTEMPTS cases, then each incidental feature once; all within MAX_SECONDS."""
    kind = kind or kind_of(case.spec)
    stop_at = time.monotonic() + MAX_SECONDS
    case = _greedy(case, lambda c: kind.smaller(c, env), env, fails, MAX_ATTEMPTS, stop_at, retry=True)
    return _greedy(case, lambda c: kind.plainer(c, env), env, fails, kind.features, stop_at, retry=False)


def _greedy(case: Case, changes: Callable[[Case], Iterator[tuple[str, Case]]], env: AnyEnvelope,
            fails: Callable[[Case], bool], attempts: int, stop_at: float, retry: bool) -> Case:
    """Apply the first change under which the case still fails, again, until none does or the budget ends.
    ``retry``: a change rejected before is tried again once the case has changed (a smaller batch can make a
    smaller head count fail); without it each change is tried once."""
    rejected: set[str] = set()
    while attempts > 0 and time.monotonic() < stop_at:
        for name, candidate in changes(case):
            if name in rejected or env.why_not(candidate.spec, candidate.layout) is not None:
                continue
            attempts -= 1
            if fails(candidate):
                case = candidate
                rejected = set() if retry else rejected
                break
            rejected.add(name)
            if attempts == 0 or time.monotonic() >= stop_at:
                return case
        else:
            return case
    return case
