"""Make a failing case smaller where Hypothesis did not: the explicit corner cases, and drawn cases that are
minimal in Hypothesis's order of choices but not in size.

``simplify`` tries one change at a time -- keep half the batch, fewer heads or query tokens, a shorter longest
sequence, then drop an incidental feature (unused pages, table padding, a strided pool, a non-default scale,
per-request q_lens, a metamorphic check) -- and keeps each change under which the case still fails, until no
change does or the attempts run out. Lengths approach the shortest failing one geometrically (half, then three
quarters, ...), so a failure that needs a long sequence is reported near the shortest length that shows it.
Import rule: the strategy layer's ``Case`` and the backend envelope; it runs cases through the callable it is
given.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..backends.base import Envelope
from ..draw.strategies import Case

if TYPE_CHECKING:
    from ..problems.generate import ProblemSpec

MAX_ATTEMPTS = 48  # cases run at most: a corner failure is big, and each attempt costs a case of its size
MAX_SECONDS = 30.0  # and at most this long: a 131072-token case costs ~1 s an attempt on a 2-core machine
PLAIN_SPEC: dict[str, Any] = dict(extra_pages=0, table_pad=0, pad_fill="zero", values="normal", shuffle_pages=False,
                  softmax_scale=None, bmm2_extra=1.0, q_scale=1.0, k_scale=1.0, q_lens=None)
PLAIN_LAYOUT = ("page_stride_pad", "cache_dims", "table_width")  # set to the envelope's plainest (_plainer)
FEATURES = len(PLAIN_SPEC) + len(PLAIN_LAYOUT) + 1  # and the metamorphic transform: each tried once


def size(case: Case) -> tuple[int, int]:
    """What "smaller" means: the (query token, head, KV token) triples, then the batch."""
    s = case.spec
    return sum(s.seq_lens) * s.num_heads * s.q_len, s.batch


def simplify(case: Case, env: Envelope, fails: Callable[[Case], bool]) -> Case:
    """The smallest case reached from ``case`` by single changes that keep ``fails(case)`` true: sizes first,
    within MAX_ATTEMPTS cases, then each incidental feature once; all within MAX_SECONDS."""
    stop_at = time.monotonic() + MAX_SECONDS
    case = _greedy(case, lambda c: _smaller(c, env), env, fails, MAX_ATTEMPTS, stop_at, retry=True)
    return _greedy(case, lambda c: _plainer(c, env), env, fails, FEATURES, stop_at, retry=False)


def _greedy(case: Case, changes: Callable[[Case], Iterator[tuple[str, Case]]], env: Envelope,
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


def _smaller(case: Case, env: Envelope) -> Iterator[tuple[str, Case]]:
    """(name, candidate) for each single size reduction of ``case`` (each makes the attempts after it cheaper)."""
    s = case.spec
    lens = s.seq_lens
    if len(lens) > 1:
        half = len(lens) // 2
        yield f"batch first {half}", replace(case, spec=_requests(s, range(half)))
        yield f"batch last {len(lens) - half}", replace(case, spec=_requests(s, range(half, len(lens))))
        if len(lens) <= 8:
            for i in range(len(lens)):
                yield f"batch without {i}", replace(case, spec=_requests(s, [j for j in range(len(lens)) if j != i]))
    for heads in sorted({h for h in (1, s.num_heads // 2) if h < s.num_heads and env.allows_heads(h)}):
        yield f"heads {heads}", replace(case, spec=replace(s, num_heads=heads))
    low_q = env.q_len[0]
    for q in sorted({q for q in (low_q, s.q_len // 2) if low_q <= q < s.q_len}):
        if min(lens) >= q:
            q_lens = None if s.q_lens is None else tuple(min(n, q) for n in s.q_lens)
            yield f"q_len {q}", replace(case, spec=replace(s, q_len=q, q_lens=q_lens))
    longest = max(range(len(lens)), key=lambda i: lens[i])
    n, lo = lens[longest], s.q_len
    for step in (2, 4, 8, 16, 32):  # n - (n - lo) / 2, then closer to n: the shortest failing length is near
        shorter = n - (n - lo) // step
        if lo <= shorter < n:
            yield f"length {shorter}", replace(case, spec=replace(s, seq_lens=lens[:longest] + (shorter,)
                                                                   + lens[longest + 1:]))


def _requests(s: ProblemSpec, kept: Sequence[int]) -> ProblemSpec:
    """``s`` with only the requests ``kept`` (their seq_lens and, if ragged, their q_lens)."""
    return replace(s, seq_lens=tuple(s.seq_lens[i] for i in kept),
                   q_lens=None if s.q_lens is None else tuple(s.q_lens[i] for i in kept))


def _plainer(case: Case, env: Envelope) -> Iterator[tuple[str, Case]]:
    """(name, candidate) for each incidental feature of ``case`` set to its plain value."""
    s, layout = case.spec, case.layout
    for key, plain in PLAIN_SPEC.items():
        if getattr(s, key) != plain:
            yield f"feature {key}", replace(case, spec=replace(s, **{key: plain}))
    plain_layout: dict[str, Any] = dict(page_stride_pad=0, cache_dims=min(env.cache_dims),
                                        table_width=env.table_widths[0])
    assert tuple(plain_layout) == PLAIN_LAYOUT
    for key, plain in plain_layout.items():
        if getattr(layout, key) != plain:
            yield f"feature {key}", replace(case, layout=replace(layout, **{key: plain}))
    if case.transform != "none":
        yield "feature transform", replace(case, transform="none")
