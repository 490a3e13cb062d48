"""Run one sparse decode problem on a sparse backend and judge it (the search over many is sparse_check.py).

``why_not`` first; build the problem; prepare; snapshot the inputs; call (an exception is a failure with its
one line; a call past ``kernel_seconds`` fails the case as hung, watchdog.py); the same call again must give
the same bits; the inputs must be unchanged; judge against the float64 sparse reference
(judge/sparse_judge.py); on failure, the diagnosis. A CUDA error that leaves the device unusable, at any stage,
is a crash of the case, as in harness.py (``context_lost``: this process can judge no further case).
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..backends.base import SparseBackend
from ..core.bits import changed_elements, same_bits
from ..core.memory import device_fault, is_out_of_memory, release_cached
from ..core.tracebacks import exception_line
from ..judge.sparse_judge import diagnose_sparse, judge_sparse
from ..problems.sparse import SparseSpec, build_sparse_problem
from ..problems.sparse_reference import sparse_reference
from .harness import OUT_OF_MEMORY, Stages, crashed, hung_line
from .watchdog import KernelTimeout, time_limit


@dataclass
class SparseCaseResult:
    backend: str
    spec: SparseSpec
    verdict: str  # "pass" | "fail" | "skip"
    failures: list[str] = field(default_factory=list)
    reason: str = ""
    diagnosis: list[str] = field(default_factory=list)
    crash: str = ""  # what ended the kernel's process or device context (CaseResult.crash)
    context_lost: bool = False  # this process's device is unusable after the case
    hung: bool = False  # the kernel ran past its time limit
    stages: dict[str, float] = field(default_factory=dict)  # seconds per harness.STAGES entry that ran

    @property
    def id(self) -> str:
        """Stable across runs and machines: a hash of backend and spec (seed included), as CaseResult.id."""
        blob = json.dumps([self.backend, self.spec.to_json()], sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def describe(self) -> str:
        return f"[{self.backend}] {self.spec.describe()}"

    def to_json(self) -> dict[str, Any]:
        """The case as a report records it (records/report.py's ``sparse_cases``); seconds: its stages' sum."""
        return {"id": self.id, "backend": self.backend, "verdict": self.verdict, "reason": self.reason,
                "failures": self.failures, "diagnosis": self.diagnosis,
                "seconds": round(sum(self.stages.values()), 4),
                "stages": {k: round(v, 5) for k, v in self.stages.items()},
                **({"crash": self.crash} if self.crash else {}), "spec": self.spec.to_json(),
                "description": self.spec.describe()}


def run_sparse_case(backend: SparseBackend, spec: SparseSpec, device: torch.device | str, diagnose: bool = True,
                    kernel_seconds: float | None = None,
                    on_stage: Callable[[str], None] | None = None) -> SparseCaseResult:
    """Judge ``backend`` on ``spec``; ``kernel_seconds`` limits each kernel call (None: no limit); ``on_stage``
    is told each stage as it starts (harness.run_case's)."""
    device = torch.device(device)
    result = SparseCaseResult(backend.name, spec, "pass")
    reason = backend.why_not(spec, device)
    if reason is not None:
        result.verdict, result.reason = "skip", f"{backend.name}: {reason}"
        return result
    stage = Stages(device, result.stages, on_stage)
    try:
        _judge(backend, spec, device, diagnose, kernel_seconds, result, stage)
    except Exception as exc:  # noqa: BLE001 - a device fault is the case's crash, out of memory a skip (as
        fault = device_fault(exc)  # harness.run_case's); anything else the suite's bug
        if fault is not None:
            crashed(result, fault, stage.current)
            result.context_lost = True
        elif is_out_of_memory(exc):
            release_cached(device)
            result.verdict, result.reason, result.failures, result.diagnosis = "skip", OUT_OF_MEMORY, [], []
        else:
            raise
    return result


def _judge(backend: SparseBackend, spec: SparseSpec, device: torch.device, diagnose: bool,
           kernel_seconds: float | None, result: SparseCaseResult, stage: Stages) -> None:
    with stage("build"):
        problem = build_sparse_problem(spec, device)
    failures = result.failures
    snapshot: dict[str, torch.Tensor] = {}
    inputs: dict[str, torch.Tensor] = {}
    out = lse = again = None
    try:  # planning is the library's too: its refusal of a problem inside the envelope is a failure
        with stage("prepare"):
            prepared = backend.prepare(problem)
            inputs = prepared.inputs
            snapshot = {name: t.clone() for name, t in inputs.items()}
        with stage("kernel"), time_limit(kernel_seconds, result.describe()):
            out, lse = (t if t is None else t.clone() for t in prepared.judged(_synced(prepared.invoke(), device)))
        with stage("repeat"), time_limit(kernel_seconds, result.describe()):
            again = prepared.judged(_synced(prepared.invoke(), device))[0]
    except KernelTimeout as exc:
        result.hung = True
        failures.append(hung_line(exc))
    except Exception as exc:  # noqa: BLE001 - a kernel's error is its verdict
        if device_fault(exc) is not None or is_out_of_memory(exc):
            raise
        failures.append(f"the kernel raised {exception_line(exc)}")
    for name, before in snapshot.items():
        if (n := changed_elements(before, inputs[name])):
            failures.append(f"input {name} changed in {n} elements")
    if lse is not None and backend.envelope.lse_base != math.e:
        lse = lse * math.log(backend.envelope.lse_base)
    with stage("reference"):
        ref = sparse_reference(problem)
    if out is not None:
        with stage("compare"):
            failures += judge_sparse(problem, out, lse, ref)
            if again is not None and not same_bits(out, again):
                failures.append("not bit-identical: the same call twice gave different outputs")
        if failures and diagnose:
            with stage("diagnose"):
                result.diagnosis = diagnose_sparse(problem, out, lse, ref)
    if failures:
        result.verdict, result.reason = "fail", failures[0]


def _synced(raw: object, device: torch.device) -> object:
    """``raw`` once the device has finished it: a hung asynchronous kernel hangs here, inside the time limit."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return raw
