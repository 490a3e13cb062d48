"""Drive Hypothesis over one backend: corner cases, drawn cases, shrinking, time bounds, targeting -- one search
for every problem kind (mla_verify/kinds): the backend's kind supplies its cases, corner cases and the steps
that make a failing case smaller.

``verify`` returns every case run (shrinking attempts included, in order) and, on failure, the shrunk
minimal failing case with its diagnosis. Reproducible: premerge and dev use a fixed seed and no database;
fuzz a fresh seed each run unless given one (profiles.run_seed), which the result records.

A user's own cases (``given_cases``: records/cases.py, ``--cases``) of the backend's kind are judged first,
before the corner cases, in every profile. A failing one ends the search, as a failing explicit example ends
Hypothesis's: it is the failure, made smaller where its spec rebuilds it and diagnosed like any other. A case
that stores its tensors (its spec only describes them) is judged, with cases isolated, in a copy of this process
holding them where it can fork (the CPU), as ``replay`` runs one; else in this process (a worker of the fork
server rebuilds each case from its spec).

Time bounds hold wherever Hypothesis spends its time: the deadline is checked before each draw (generation,
targeting and shrinking all draw) as well as before each case, so a run ends within ``minutes`` plus one
case. Past the deadline a search that found a failure reports the smallest one seen so far. A kernel call
that overruns ``kernel_seconds`` fails its case and ends the search at once (a hung kernel is not shrunk:
every attempt would hang too). With ``isolate`` each case is judged in a worker process (isolate.py): a
kernel that crashes its process fails its case as a crash, and the search goes on and shrinks it; in this
process, a CUDA error that leaves the device unusable fails its case as a crash and ends the search
(supervise.py runs the search in a copy of this process, and takes it over isolated when a kernel kills the
copy or its device: a seeded search retraces itself, an unseeded one is handed the case, ``found``). The
worker warms up before the first case and after each restart (isolate.py); that time is the run's warm-up
(``EngineResult.warmup``), left out of its seconds and its minutes, as the caller's warm-up before an
in-process run is. Ctrl-C ends the search and returns what was judged so far (``EngineResult.interrupted``); a
search in a thread Ctrl-C does not reach (side_by_side.py) ends so at its next case once its ``stop`` is set.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from hypothesis import given, target
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.control import current_build_context
from hypothesis.database import ExampleDatabase, choices_to_bytes
from hypothesis.errors import Flaky, InvalidArgument
from hypothesis.internal.reflection import function_digest

from ..backends.base import Backend
from ..draw.profiles import (
    Profile,
    draws_free_of_local_source,
    get_profile,
    hypothesis_settings,
    hypothesis_storage,
    run_seed,
    seeded_with_database,
)
from ..draw.strategies import Budget, Case, budget_for
from ..judge.diagnose import explained, says_more
from ..kinds import ProblemKind, kind_named, kind_of
from ..problems.envelope import DENSE
from ..problems.layouts import LayoutSpec
from .harness import SKIP_MEMORY, CaseResult
from .isolate import CaseJudge, InProcess, Isolated, case_judge, forkable
from .simplify import simplify, size
from .warmup import WarmupResult
from .watchdog import grace_seconds

DEFAULT_KERNEL_SECONDS = 120.0  # one kernel call; FlashInfer's first fa2/fa3 call JIT-compiles (~25 s)


@dataclass
class EngineResult:
    backend: str
    profile: str
    seed: int
    kind: str = DENSE  # the kind of problem the backend was judged on (mla_verify/kinds)
    cases: list[CaseResult] = field(default_factory=list)
    failure: CaseResult | None = None  # the shrunk minimal failing case
    unavailable: str | None = None  # why the backend cannot run on this device at all
    seconds: float = 0.0
    timed_out: bool = False
    interrupted: bool = False  # Ctrl-C: the cases judged until then
    draw_seconds: float = 0.0  # in the strategies, every draw counted (also those that never became a case)
    warmup: WarmupResult | None = None  # its isolated workers' warm-ups, not in ``seconds``
    given_origin: str | None = None  # where the user's case that failed came from (its file), if one did

    @property
    def verdict(self) -> str:
        if self.unavailable:
            return "skip"
        return "fail" if self.failure is not None else "pass"


class GivenCase(Protocol):
    """A user's own case (records/cases.py's ``UserCase``), given rather than drawn: judged before anything is
    drawn."""

    @property
    def origin(self) -> str: ...  # its file, for messages

    @property
    def spec(self) -> Any: ...  # its kind's spec

    @property
    def layout(self) -> LayoutSpec: ...

    @property
    def transform(self) -> str: ...

    @property
    def problem(self) -> Any: ...  # its stored tensors (a problem of its kind), where its spec only describes them


class _CaseFailed(AssertionError):
    pass


class _Stop(BaseException):
    """Ends the search (time up, or a hung kernel); BaseException so Hypothesis does not shrink it."""


@dataclass
class _Clock:
    """The run's deadline, and the time spent drawing."""

    deadline: float | None
    stop: threading.Event | None = None  # set: Ctrl-C reached the run (side_by_side.py), this search ends
    drawing_since: float = 0.0
    draw_seconds: float = 0.0
    expired: bool = False

    def check(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise KeyboardInterrupt  # as Ctrl-C in the thread it reached ends a search
        if self.deadline is not None and time.monotonic() > self.deadline:
            self.expired = True
            raise _Stop("time up")

    def leave_out(self, seconds: float) -> None:
        """Time that was not the cases' (a worker's warm-up): the deadline moves by it."""
        if self.deadline is not None:
            self.deadline += seconds

    def drawn(self) -> float:
        """Called as a case starts: seconds since its draw began."""
        took = time.perf_counter() - self.drawing_since
        self.draw_seconds += took
        return took


def _clocked(strategy: st.SearchStrategy[Case], clock: _Clock) -> st.SearchStrategy[Case]:
    @st.composite
    def draw(draw_fn: st.DrawFn) -> Case:
        clock.check()
        clock.drawing_since = time.perf_counter()
        return draw_fn(strategy)
    return draw()


def verify(backend: Backend, device: torch.device | str, profile: str | Profile = "premerge",
           seed: int | None = None, max_examples: int | None = None, minutes: float | None = None,
           database: ExampleDatabase | None = None,
           on_case: Callable[[CaseResult], None] | None = None,
           on_start: Callable[[Case], None] | None = None,
           kernel_seconds: float | None = DEFAULT_KERNEL_SECONDS,
           budget: Budget | None = None, isolate: bool = False, judge: CaseJudge | None = None,
           found: Found | None = None, given_cases: Sequence[GivenCase] = (),
           stop: threading.Event | None = None) -> EngineResult:
    """Judge ``backend`` on ``device``. ``on_start``/``on_case`` are called before and after each case;
    ``kernel_seconds`` limits each kernel call (None: no limit); ``budget`` overrides the device's;
    ``isolate`` judges each case in a worker process; ``judge``: the one ``case_judge`` made for these arguments,
    already launched (check starts every backend's isolated worker at once), or another; this run closes it.
    ``found``: a failing case judged before this run, by a search that died on it and that this run cannot
    retrace (supervise.py): with its choice sequence and a ``database``, Hypothesis replays it first (then
    shrinks it, as any failure it finds); else it is this run's failure, made smaller and replayed as a failing
    corner case is, and nothing is drawn. ``given_cases``: the user's own cases, those of the backend's kind
    judged first. ``stop``: once set, the search ends before its next case as Ctrl-C ends it (a search run in
    another thread than the one Ctrl-C reaches: side_by_side.py)."""
    device = torch.device(device)
    prof = get_profile(profile) if isinstance(profile, str) else profile
    seed = run_seed(prof, seed)
    result = EngineResult(backend.name, prof.name, seed, backend.kind)
    started = time.monotonic()
    reason = backend.unavailable_reason(device)
    if reason is not None:
        result.unavailable = f"{backend.name}: {reason}"
        return result
    if kernel_seconds is not None:
        grace_seconds()  # a malformed grace is a UsageError here, not a "kernel raised" verdict inside a case
    budget = budget if budget is not None else budget_for(device)
    kind = kind_named(backend.kind)
    minutes = prof.minutes if minutes is None else minutes
    clock = _Clock(None if minutes is None else started + 60.0 * minutes, stop)
    if judge is None:  # a worker left by an exception ends at exit
        judge = case_judge(backend, device, kernel_seconds, isolate)
    began = time.monotonic()
    judge.start()
    waited = time.monotonic() - began  # for a worker to start and warm up (what was left of it, if launched earlier)
    first_warm = _warm_seconds(judge)
    clock.leave_out(waited)

    holding: dict[int, CaseJudge] = {}  # by id: the judge of each stored problem judged so far

    def judge_of(problem: Any) -> CaseJudge:
        """The judge of a case: ``judge``, or for a stored problem (a user's case that no spec rebuilds) one that
        holds it -- a copy of this process where cases are isolated and it can fork (isolate.forkable), so that
        a crash on it is a verdict too, else this process."""
        if problem is None:
            return judge
        if id(problem) not in holding:
            here = problem.to(device)
            isolated = isinstance(judge, Isolated) and forkable(device)
            holding[id(problem)] = Isolated(backend, device, kernel_seconds, fork=True, problem=here) if isolated \
                else InProcess(backend, device, kernel_seconds, here)
        return holding[id(problem)]

    def record(case: Case, diagnose: bool = False, draw_seconds: float | None = None,
               problem: Any = None) -> CaseResult:
        if on_start is not None:
            on_start(case)
        warmed = _warm_seconds(judge)
        r = judge_of(problem)(case.spec, case.layout, case.transform, diagnose)
        clock.leave_out(_warm_seconds(judge) - warmed)  # a worker restarted after a crash warmed up again
        if draw_seconds is not None:
            r.stages = {"draw": draw_seconds, **r.stages}
        if r.skip_kind == SKIP_MEMORY:  # the rest of the run draws smaller cases
            budget.shrink_below(*kind.footprint(case.spec))
        if on_case is not None:
            on_case(r)
        if r.verdict != "fail":  # the run keeps every case's result: only a failure's tensors are used later
            r.out = r.lse = r.problem = None  # (on a GPU, thousands of outputs would fill its memory)
        result.cases.append(r)
        if r.hung or r.context_lost:
            raise _Stop("hung kernel" if r.hung else "device unusable")
        return r

    corner_failure: CaseResult | None = None
    given_failure: GivenCase | None = None
    drawn: list[CaseResult] = []  # every failing drawn case, in the order seen
    replay = None if found is None or database is None else found.choices  # drawn again first, by Hypothesis
    if found is not None and replay is None:  # judged already: the failure, as a failing corner case is
        corner_failure = found.result
        if on_case is not None:
            on_case(found.result)
        result.cases.append(found.result)
    try:
        first, step = prof.share
        for g in [g for g in given_cases if kind_of(g.spec) is kind and corner_failure is None][first::step]:
            clock.check()
            given_failure = g  # until it passes: a kernel that hangs on it ends the search here too
            r = record(Case(g.spec, g.layout, g.transform), diagnose=True, problem=g.problem)
            if r.verdict == "fail":
                corner_failure = r  # a failure not drawn, as a corner case's
                raise _Stop("a case of the user's failed")
            given_failure = None
        if prof.corner_cases and corner_failure is None:
            for case in kind.corner_cases(backend.envelope, budget)[first::step]:
                clock.check()
                r = record(case, diagnose=True)
                if r.verdict == "fail":
                    corner_failure = r
                    break
        # The search runs even after a corner case failed: a corner case seeds the search, and a drawn failure
        # is shrunk by Hypothesis to the smallest problem that still fails, which is what a user wants to read
        # (the corner case is made smaller too, below: the smaller of the two is reported).
        # Hypothesis may end a search before the deadline by its own rules (e.g. it judges a small envelope
        # exhausted); a time-bounded random search then starts another until the deadline, each with its own
        # seed (the same one would repeat the cases)
        for restart in itertools.count() if found is None or replay is not None else ():
            _search(backend, kind, prof, max_examples, database, seed + restart, budget, clock, record, drawn,
                    replay if restart == 0 else None)
            if drawn or prof.deterministic or clock.deadline is None:
                break
    except _Stop:
        result.timed_out = clock.expired
    except KeyboardInterrupt:
        result.interrupted = True
    hung = _hung(result)
    failing = drawn + ([corner_failure] if corner_failure is not None else [])
    if hung is not None:
        result.failure = hung
    elif failing:
        # the smallest failure seen whose output shows the fault, where one does (_readable): Hypothesis's
        # minimal example (it replays that one last) is minimal in its own order, not always in size, and a
        # corner case is not shrunk by Hypothesis at all
        smallest = min(reversed(failing),
                       key=lambda r: (not _readable(r), size(Case(r.spec, r.layout, r.metamorphic))))
        result.failure = smallest
        # a corner case (or a user's) was never shrunk, a drawn one only in Hypothesis's order; a user's case
        # that stores its tensors has no spec to make smaller
        stored = None if given_failure is None else given_failure.problem
        try:
            if not result.interrupted and not clock.expired and stored is None:
                smallest = result.failure = _simplified(backend, kind, smallest, clock, record)
            if not result.interrupted:
                result.failure = _replayed(smallest, judge_of(stored))
        except KeyboardInterrupt:  # the failure as it stood is the report
            result.interrupted = True
    if result.failure is not None and given_failure is not None:
        result.given_origin = given_failure.origin
        if result.failure.problem is None:  # a crash keeps none: a stored one, which no spec rebuilds, goes on
            result.failure.problem = given_failure.problem  # into its reproducer
    if result.failure is not None and corner_failure is not None and result.failure is not corner_failure \
            and not explained(result.failure.diagnosis) and explained(corner_failure.diagnosis):
        # a shrunk case can be too small to tell misreadings apart (one token: every scale gives the same out)
        larger = f"case {result.given_origin}" if result.given_origin else \
            f"corner case {corner_failure.spec.describe()}"
        result.failure.diagnosis = [f"{d} -- on the larger {larger}" for d in corner_failure.diagnosis]
    if result.failure is not None and failing and not result.interrupted:  # after the borrowing above: a
        # first failing case that is that corner case then tells nothing more
        result.failure.first_failing = _first_failing(corner_failure or failing[0], result.failure, judge,
                                                      rerun=not clock.expired)
    for held in (judge, *holding.values()):
        held.close()
    result.draw_seconds = clock.draw_seconds
    result.warmup = judge.warmup
    result.seconds = time.monotonic() - started - waited - (_warm_seconds(judge) - first_warm)
    return result


@dataclass(frozen=True)
class Found:
    """A failing case judged before a run, by a search that died on it (supervise.py): its verdict, and the
    choice sequence Hypothesis drew it from (``drawn_choices``; None for a case Hypothesis did not draw)."""

    result: CaseResult
    choices: bytes | None = None


def drawn_choices() -> bytes | None:
    """The choice sequence of the case Hypothesis is running now, as its example database stores it; None
    outside a Hypothesis search (a corner case, simplify.py's)."""
    try:
        context = current_build_context()
    except InvalidArgument:
        return None
    return choices_to_bytes(context.data.choices)


def _warm_seconds(judge: CaseJudge) -> float:
    return 0.0 if judge.warmup is None else judge.warmup.seconds


def _search(backend: Backend, kind: ProblemKind, prof: Profile, max_examples: int | None,
            database: ExampleDatabase | None, seed: int, budget: Budget, clock: _Clock,
            record: Callable[..., CaseResult], failures: list[CaseResult], replay: bytes | None = None) -> None:
    """Hypothesis's search; ``replay``: a choice sequence saved into ``database`` first, which the search then
    replays before it draws anything (its reuse phase)."""
    first, step = prof.share
    drawn_cases = itertools.count()

    @hypothesis_settings(prof, max_examples, database)
    @given(_clocked(kind.cases(backend.envelope, budget, prof.fp8_probes), clock))
    def search(case: Case) -> None:
        # another shard's case (a deterministic profile's): drawn, so that every shard draws the same sequence,
        # and not judged; once this shard has a failure every case is judged (Hypothesis is shrinking it)
        if step > 1 and prof.deterministic and not failures and next(drawn_cases) % step != first:
            clock.drawn()
            return
        r = record(case, draw_seconds=clock.drawn())
        if prof.targeted and r.stats is not None and math.isfinite(r.stats.error_ratio):
            # Hypothesis takes finite observations only; a non-finite ratio is judged by compare() (a failure)
            target(min(r.stats.error_ratio, 1e6), label="error ratio (error / allowed)")
        if r.verdict == "fail":
            failures.append(r)
            raise _CaseFailed(r.reason)

    # One database key per backend (Hypothesis keys on the test's source, the same for every backend),
    # so runners sharing a database replay each other's failures for that backend.
    search.hypothesis.inner_test._hypothesis_internal_add_digest = backend.name.encode()  # type: ignore[attr-defined]
    if replay is not None and database is not None:
        # under the key Hypothesis gives this test (its run_engine), in the secondary corpus: examples it has not
        # shrunk yet (one in the primary corpus it takes for shrunk already, and does not shrink)
        key = function_digest(search.hypothesis.inner_test)  # type: ignore[attr-defined]
        database.save(key + b".secondary", replay)
    with_database = not prof.deterministic and database is not None
    if not with_database:  # Hypothesis ignores the database once a seed is set: seeded_with_database instead
        search = hypothesis_seed(seed)(search)
    try:
        with hypothesis_storage(), draws_free_of_local_source(prof.deterministic), \
                seeded_with_database(seed) if with_database else contextlib.nullcontext():
            search()
    except _CaseFailed:
        pass
    except Flaky:
        # Hypothesis turns a stop inside a draw into "inconsistent data generation"; otherwise Flaky means
        # the minimal failure did not fail again, which _replayed says
        if clock.expired:
            raise _Stop("time up") from None
        if clock.stop is not None and clock.stop.is_set():
            raise KeyboardInterrupt from None


def _simplified(backend: Backend, kind: ProblemKind, failure: CaseResult, clock: _Clock,
                record: Callable[..., CaseResult]) -> CaseResult:
    """A failing case made as small as it still fails (simplify.py), within the run's deadline."""
    last = failure

    def fails(case: Case) -> bool:
        """Fails, and keeps an output that shows the fault once the case has one (_readable)."""
        nonlocal last
        clock.check()
        r = record(case)
        kept = r.verdict == "fail" and (_readable(r) or not _readable(last))
        if kept:
            last = r
        return kept

    try:
        simplify(Case(failure.spec, failure.layout, failure.metamorphic), backend.envelope, fails, kind)
    except _Stop:
        pass
    return last


def _readable(r: CaseResult) -> bool:
    """Whether ``r``'s own output shows the fault on finite values: out of tolerance, no inf or NaN. A smaller
    case with NaN hides what the kernel computed (and all-NaN output "matches" many misreadings); one that
    fails only a repeat or metamorphic check has a right output, so it shows less of the fault."""
    return r.stats is not None and r.stats.nonfinite == 0 and r.stats.error_ratio > 1


def _first_failing(first: CaseResult, minimal: CaseResult, judge: CaseJudge,
                   rerun: bool) -> tuple[str, list[str], bool] | None:
    """The first failing case's description, diagnosis (``rerun``: run again to diagnose it if the search did
    not; not past the run's deadline) and whether that tells more than the minimal case's, when it is not the
    minimal case."""
    if first.spec == minimal.spec and first.layout == minimal.layout and first.metamorphic == minimal.metamorphic:
        return None
    if not first.diagnosis and first.out is not None and rerun:
        first = judge(first.spec, first.layout, first.metamorphic, True)
    return first.describe(), first.diagnosis, says_more(first.diagnosis, minimal.diagnosis)


def _hung(result: EngineResult) -> CaseResult | None:
    """The case whose kernel hung or left the device unusable, if that is what ended the search."""
    last = result.cases[-1] if result.cases else None
    return last if last is not None and (last.hung or last.context_lost) else None


def _replayed(shrunk: CaseResult, judge: CaseJudge) -> CaseResult:
    """The minimal failing case run once more, with diagnosis; the original if it no longer fails."""
    again = judge(shrunk.spec, shrunk.layout, shrunk.metamorphic, True)
    if again.verdict == "fail":
        return again
    shrunk.failures.append("did not fail again when replayed (flaky kernel?)")
    return shrunk
