"""Search sparse decode problems on a sparse backend; shrink and report the first failure.

Each case is judged by sparse_case.py (``run_sparse_case``), in this process or, with ``isolate``, in a worker
process (isolate.py): a kernel that kills its worker fails its case as a crash, and the search goes on.

A run (``verify_sparse``): premerge's corner cases first (draw/sparse_strategies.py), then drawn cases under
the profile's Hypothesis settings -- seeded, so premerge gives the same cases and verdicts every time -- and
Hypothesis shrinks the first failure to a minimal spec. A corner case that fails ends the run with its
diagnosis, unless it crashed isolated: a crash has no output to diagnose, its input is all it tells, so the
search runs on and a drawn crash, shrunk, is reported instead where one is found. A hung kernel, or a CUDA
error in this process (its device is then unusable), ends the search at that case. Ctrl-C ends it too, as in
engine.py: the run is marked interrupted and keeps the cases judged so far, its failure the last one seen.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hypothesis import given
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Flaky

from ..backends.base import SparseBackend
from ..draw.profiles import Profile, draws_free_of_local_source, get_profile, hypothesis_settings, hypothesis_storage
from ..draw.sparse_strategies import sparse_corner_cases, sparse_specs
from ..problems.sparse import SparseSpec
from .isolate import sparse_case_judge
from .sparse_case import SparseCaseResult


@dataclass
class SparseRunResult:
    backend: str
    cases: list[SparseCaseResult]
    failure: SparseCaseResult | None = None  # the shrunk first failure
    unavailable: str | None = None  # why the backend cannot run on this device
    seconds: float = 0.0
    interrupted: bool = False  # Ctrl-C: the cases judged until then

    @property
    def verdict(self) -> str:
        if self.failure is not None:
            return "fail"
        return "pass" if any(c.verdict == "pass" for c in self.cases) else "skip"


class _Failed(AssertionError):
    pass


class _Stop(BaseException):
    """Ends the search (time up, a hung kernel, a device left unusable); BaseException so Hypothesis does not
    shrink it."""


def verify_sparse(backend: SparseBackend, device: torch.device | str, profile: str | Profile = "premerge",
                  max_examples: int | None = None, seed: int = 0, minutes: float | None = None,
                  isolate: bool = False, kernel_seconds: float | None = None,
                  on_start: Callable[[SparseSpec], None] | None = None, target: str | None = None) -> SparseRunResult:
    """``minutes`` (default: the profile's) bounds the drawn cases' search; a failure found is still shrunk.
    ``isolate`` judges each case in a worker process, which loads the backend by ``target`` (what it was named
    by) when it is not a registered name; ``kernel_seconds`` limits each kernel call; ``on_start`` is told
    each case before it runs."""
    started = time.monotonic()
    prof = get_profile(profile) if isinstance(profile, str) else profile
    device = torch.device(device)
    minutes = prof.minutes if minutes is None else minutes
    deadline = None if minutes is None else time.monotonic() + 60.0 * minutes
    run = SparseRunResult(backend.name, [])
    reason = backend.unavailable_reason(device)
    if reason is not None:
        run.unavailable = f"{backend.name}: {reason}"
        run.cases.append(SparseCaseResult(backend.name, SparseSpec(), "skip", reason=run.unavailable))
        return run
    judge = sparse_case_judge(backend, device, kernel_seconds, isolate, target)

    def judged(spec: SparseSpec, diagnose: bool) -> SparseCaseResult:
        if on_start is not None:
            on_start(spec)
        return judge(spec, diagnose)

    def record(spec: SparseSpec, diagnose: bool) -> SparseCaseResult:
        case = judged(spec, diagnose)
        run.cases.append(case)
        if case.hung or case.context_lost:
            run.failure = case
            raise _Stop
        return case

    try:
        _search(backend, prof, max_examples, seed, deadline, record, judged, run)
    except _Stop:
        pass
    except KeyboardInterrupt:  # the failure as it stood (Hypothesis may have been shrinking it) is the report
        run.interrupted = True
        run.failure = run.failure or next((c for c in reversed(run.cases) if c.verdict == "fail"), None)
    finally:
        judge.close()
    run.seconds = time.monotonic() - started
    return run


def _search(backend: SparseBackend, prof: Profile, max_examples: int | None, seed: int, deadline: float | None,
            record: Callable[[SparseSpec, bool], SparseCaseResult],
            judged: Callable[[SparseSpec, bool], SparseCaseResult], run: SparseRunResult) -> None:
    """The corner cases, then the drawn ones; ``run.failure`` is set to what is reported."""
    if prof.corner_cases:
        for spec in sparse_corner_cases(backend.envelope):
            case = record(spec, True)
            if case.verdict == "fail":
                run.failure = case
                if not case.crash:
                    return
                break
    last: dict[str, SparseCaseResult] = {}  # the last failing case: Hypothesis replays its minimal one last

    def check(spec: SparseSpec) -> None:
        if deadline is not None and time.monotonic() > deadline and "case" not in last:
            raise _Stop
        case = record(spec, False)
        if case.verdict == "fail":
            last["case"] = case
            raise _Failed(case.reason)

    test = given(sparse_specs(backend.envelope))(check)
    test = hypothesis_settings(prof, max_examples, None)(test)
    if prof.deterministic:
        test = hypothesis_seed(seed)(test)
    with hypothesis_storage(), draws_free_of_local_source(prof.deterministic):
        try:
            test()
        except (_Failed, Flaky):  # Flaky: the minimal case passed when Hypothesis replayed it
            if "case" not in last:
                raise
            shrunk = last["case"]
            again = judged(shrunk.spec, True)  # the shrunk case once more, with its diagnosis
            if again.verdict != "fail":  # as engine._replayed: the failure seen stays the report
                shrunk.failures.append("did not fail again when replayed (flaky kernel?)")
            run.failure = again if again.verdict == "fail" else shrunk
