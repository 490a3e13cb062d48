"""Drive Hypothesis over one backend: corner cases, drawn cases, shrinking, time bounds, targeting.

``verify`` returns every case run (shrinking attempts included, in order) and, on failure, the shrunk
minimal failing case with its diagnosis. Reproducible: premerge and dev use a fixed seed and no database.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from hypothesis import given, seed as hypothesis_seed, target
from hypothesis.database import ExampleDatabase

from .backends.base import Backend
from .harness import CaseResult, run_case
from .profiles import Profile, get_profile, hypothesis_settings
from .strategies import Case, budget_for, cases, corner_cases

DEFAULT_SEED = 20261201


@dataclass
class EngineResult:
    backend: str
    profile: str
    seed: int
    cases: list[CaseResult] = field(default_factory=list)
    failure: CaseResult | None = None  # the shrunk minimal failing case
    unavailable: str | None = None  # why the backend cannot run on this device at all
    seconds: float = 0.0
    timed_out: bool = False

    @property
    def verdict(self) -> str:
        if self.unavailable:
            return "skip"
        return "fail" if self.failure is not None else "pass"


class _CaseFailed(AssertionError):
    pass


class _TimeUp(BaseException):
    """Stops a time-bounded search; BaseException so Hypothesis does not treat it as a failure to shrink."""


def verify(backend: Backend, device: torch.device | str, profile: str | Profile = "premerge",
           seed: int | None = None, max_examples: int | None = None, minutes: float | None = None,
           database: ExampleDatabase | None = None,
           on_case: Callable[[CaseResult], None] | None = None) -> EngineResult:
    device = torch.device(device)
    prof = get_profile(profile) if isinstance(profile, str) else profile
    seed = DEFAULT_SEED if seed is None else seed
    result = EngineResult(backend.name, prof.name, seed)
    started = time.monotonic()
    reason = backend.unavailable_reason(device)
    if reason is not None:
        result.unavailable = f"{backend.name}: {reason}"
        return result
    budget = budget_for(device.type)
    minutes = prof.minutes if minutes is None else minutes
    deadline = None if minutes is None else started + 60.0 * minutes

    def record(case: Case, diagnose: bool = False) -> CaseResult:
        r = run_case(backend, case.spec, case.layout, device, case.transform, diagnose=diagnose)
        result.cases.append(r)
        if on_case is not None:
            on_case(r)
        return r

    corner_failure: CaseResult | None = None
    if prof.corner_cases:
        for case in corner_cases(backend.envelope, budget):
            r = record(case, diagnose=True)
            if r.verdict == "fail":
                corner_failure = r
                break
    # The search runs even after a corner case failed: corner cases are big and are not shrunk, while a
    # drawn failure is shrunk to the smallest problem that still fails, which is what a user wants to read.
    last_failure: list[CaseResult] = []

    @hypothesis_settings(prof, max_examples, database)
    @given(cases(backend.envelope, budget))
    def search(case: Case) -> None:
        if deadline is not None and not last_failure and time.monotonic() > deadline:
            raise _TimeUp()
        r = record(case)
        if prof.targeted and r.stats is not None:
            target(min(r.stats.error_ratio, 1e6), label="error ratio (error / allowed)")
        if r.verdict == "fail":
            last_failure.append(r)
            raise _CaseFailed(r.reason)

    # One database key per backend (Hypothesis keys on the test's source, the same for every backend),
    # so runners sharing a database replay each other's failures for that backend.
    search.hypothesis.inner_test._hypothesis_internal_add_digest = backend.name.encode()
    if prof.deterministic or database is None:  # Hypothesis ignores the database once a seed is set
        search = hypothesis_seed(seed)(search)
    try:
        search()
    except _CaseFailed:
        shrunk = last_failure[-1]  # Hypothesis replays the minimal example last
        result.failure = run_case(backend, shrunk.spec, shrunk.layout, device, shrunk.metamorphic)
        if result.failure.verdict != "fail":  # flaky: keep what was seen, say so
            shrunk.failures.append("did not fail again when replayed (flaky kernel?)")
            result.failure = shrunk
    except _TimeUp:
        result.timed_out = True
    if result.failure is None:
        result.failure = corner_failure
    elif corner_failure is not None and not result.failure.diagnosis and corner_failure.diagnosis:
        # a shrunk case can be too small to tell misreadings apart (one token: every scale gives the same out)
        result.failure.diagnosis = [f"{d} -- on the larger corner case {corner_failure.spec.describe()}"
                                    for d in corner_failure.diagnosis]
    result.seconds = time.monotonic() - started
    return result
