"""Run sparse decode problems on a sparse backend and judge them; search, shrink and report the first failure.

One case (``run_sparse_case``): ``why_not`` first; build the problem; prepare; snapshot the inputs; call (an
exception is a failure with its one line); the inputs must be unchanged; judge against the float64 sparse
reference (judge/sparse_judge.py); the same call again must give the same bits; on failure, the diagnosis.

A run (``verify_sparse``): premerge's corner cases first (draw/sparse_strategies.py), then drawn cases under
the profile's Hypothesis settings -- seeded, so premerge gives the same cases and verdicts every time -- and
Hypothesis shrinks the first failure to a minimal spec.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import given
from hypothesis import seed as hypothesis_seed

from ..backends.base import ENVELOPE_PREFIX, SparseBackend
from ..core.bits import changed_elements, same_bits
from ..core.tracebacks import exception_line
from ..draw.profiles import Profile, draws_free_of_local_source, get_profile, hypothesis_settings, hypothesis_storage
from ..draw.sparse_strategies import sparse_corner_cases, sparse_specs
from ..judge.sparse_judge import diagnose_sparse, judge_sparse
from ..problems.sparse import SparseSpec, build_sparse_problem
from ..problems.sparse_reference import sparse_reference


@dataclass
class SparseCaseResult:
    backend: str
    spec: SparseSpec
    verdict: str  # "pass" | "fail" | "skip"
    failures: list[str] = field(default_factory=list)
    reason: str = ""
    diagnosis: list[str] = field(default_factory=list)

    def describe(self) -> str:
        return f"[{self.backend}] {self.spec.describe()}"


def run_sparse_case(backend: SparseBackend, spec: SparseSpec, device: torch.device | str,
                    diagnose: bool = True) -> SparseCaseResult:
    device = torch.device(device)
    result = SparseCaseResult(backend.name, spec, "pass")
    reason = backend.why_not(spec, device)
    if reason is not None:
        result.verdict, result.reason = "skip", f"{backend.name}: {reason}"
        return result
    problem = build_sparse_problem(spec, device)
    failures = result.failures
    snapshot: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.Tensor] = {}
    out = lse = again = None
    try:  # planning is the library's too: its refusal of a problem inside the envelope is a failure
        prepared = backend.prepare(problem)
        inputs = prepared.inputs
        snapshot = {name: t.clone() for name, t in inputs.items()}
        out, lse = (t if t is None else t.clone() for t in prepared.judged(prepared.invoke()))
        again = prepared.judged(prepared.invoke())[0]
    except Exception as exc:  # noqa: BLE001 - a kernel's error is its verdict
        failures.append(f"the kernel raised {exception_line(exc)}")
    for name, before in snapshot.items():
        if (n := changed_elements(before, inputs[name])):
            failures.append(f"input {name} changed in {n} elements")
    if lse is not None and backend.envelope.lse_base != math.e:
        lse = lse * math.log(backend.envelope.lse_base)
    ref = sparse_reference(problem)
    if out is not None:
        failures += judge_sparse(problem, out, lse, ref)
        if again is not None and not same_bits(out, again):
            failures.append("not bit-identical: the same call twice gave different outputs")
        if failures and diagnose:
            result.diagnosis = diagnose_sparse(problem, out, lse, ref)
    if failures:
        result.verdict, result.reason = "fail", failures[0]
    return result


@dataclass
class SparseRunResult:
    backend: str
    cases: list[SparseCaseResult]
    failure: SparseCaseResult | None = None  # the shrunk first failure

    @property
    def verdict(self) -> str:
        if self.failure is not None:
            return "fail"
        return "pass" if any(c.verdict == "pass" for c in self.cases) else "skip"


class _Failed(AssertionError):
    pass


class _TimeUp(BaseException):
    """Ends the search when the run's minutes are spent; BaseException so Hypothesis does not shrink it."""


def verify_sparse(backend: SparseBackend, device: torch.device | str, profile: str | Profile = "premerge",
                  max_examples: int | None = None, seed: int = 0, minutes: float | None = None) -> SparseRunResult:
    """``minutes`` (default: the profile's) bounds the drawn cases' search; a failure found is still shrunk."""
    prof = get_profile(profile) if isinstance(profile, str) else profile
    device = torch.device(device)
    minutes = prof.minutes if minutes is None else minutes
    deadline = None if minutes is None else time.monotonic() + 60.0 * minutes
    run = SparseRunResult(backend.name, [])
    reason = backend.unavailable_reason(device)
    if reason is not None:
        run.cases.append(SparseCaseResult(backend.name, SparseSpec(), "skip", reason=f"{backend.name}: {reason}"))
        return run
    if prof.corner_cases:
        for spec in sparse_corner_cases(backend.envelope):
            case = run_sparse_case(backend, spec, device)
            run.cases.append(case)
            if case.verdict == "fail":
                run.failure = case
                return run
    last: dict[str, Any] = {}

    def check(spec: SparseSpec) -> None:
        if deadline is not None and time.monotonic() > deadline and "spec" not in last:
            raise _TimeUp
        case = run_sparse_case(backend, spec, device, diagnose=False)
        run.cases.append(case)
        if case.verdict == "fail":
            last["spec"] = spec
            raise _Failed(case.reason)

    test = given(sparse_specs(backend.envelope))(check)
    test = hypothesis_settings(prof, max_examples, None)(test)
    if prof.deterministic:
        test = hypothesis_seed(seed)(test)
    with hypothesis_storage(), draws_free_of_local_source(prof.deterministic):
        try:
            test()
        except _TimeUp:
            pass
        except _Failed:
            run.failure = run_sparse_case(backend, last["spec"], device)  # the shrunk case, with its diagnosis
    return run


def skipped_outside_envelope(case: SparseCaseResult) -> bool:
    return case.verdict == "skip" and ENVELOPE_PREFIX in case.reason
