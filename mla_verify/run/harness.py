"""Run one problem on one backend and judge it: the per-case checks, in the order that makes them sharp -- the same
for every problem kind (mla_verify/kinds: dense decode, sparse top-k decode), which supplies the problem, its
reference and baseline, its metamorphic relations and its catalogue of misreadings.

1. ``why_not`` before any kernel is touched (skip with the backend's own sentence).
2. Lay out the problem; snapshot every input; poison ``out`` with +inf (or, when the kernel allocates, prime
   the allocator with +inf so recycled memory cannot pass for written output). Unused cache slots already
   hold NaN (generate.py, sparse.py), so a read outside a sequence (or an index row) poisons the result.
3. Call the kernel -- before the reference is allocated, as FlashMLA does.
4. Check: ``out`` filled in place and returned, inputs bit-identical, every element finite and within the
   tolerance model (compare.py, with the kind's same-precision baseline), LSE in the backend's base; the same
   call again gives the same bits; one of the kind's metamorphic relations gives the same bits -- or, for a
   relation that changes the arithmetic's order (``Relation.bits`` false: a sparse row's order) and for the
   batch order of a backend that claims only invariance within tolerance (``Backend.batch_invariance``),
   passes the same tolerance model against the same reference (``CaseResult.invariance`` records which).
5. On failure, ask the kind's catalogue which known misreading explains the output, or where it is wrong
   (diagnose.py and localize.py, which may re-run the kernel to tell where a NaN comes from).

Out of memory at any stage is the machine's state, not the kernel's fault: the case becomes a skip with that
reason (memory.py). A CUDA error that leaves the device unusable (an illegal memory access, a device-side
assert) at any stage is a crash of the case: it fails with the error's text and the stage it surfaced in, and
``context_lost`` tells the caller that this process can judge no further case (isolate.py starts another).
A kernel call that runs past ``time_limit`` seconds fails the case (watchdog.py). The time of each stage
is recorded per case (``CaseResult.stages``); on a GPU each stage ends with a synchronize, so a stage is
charged for its own device work.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..backends.base import ENVELOPE_PREFIX, INVARIANT_BITS, INVARIANT_WITHIN_TOLERANCE, Backend, PreparedCall
from ..core.bits import changed_elements, changed_elements_each
from ..core.errors import UsageError
from ..core.memory import device_fault, is_out_of_memory, release_cached
from ..core.tracebacks import exception_line
from ..judge.compare import ErrorStats, compare
from ..judge.explains import Rerun
from ..kinds import ProblemKind, kind_named, kind_of
from ..problems.envelope import DENSE
from ..problems.layouts import LayoutSpec
from ..problems.metamorphic import BATCH_ORDER, Unmap
from ..problems.reference import ReferenceResult
from .watchdog import KernelTimeout, time_limit

POISON_OUT = float("inf")
PRIMED = 8  # poisoned blocks of the output's size freed just before a kernel that allocates its output
# the stages of one case, in order ("draw" is the engine's: the strategy's time for this case)
STAGES = ("draw", "build", "prepare", "kernel", "reference", "baseline", "compare", "repeat", "metamorphic",
          "diagnose")
# CaseResult.skip_kind: outside the backend's declared envelope (static), refused by its library for this
# problem's data (e.g. FlashInfer's planner), or no device memory for it
SKIP_ENVELOPE, SKIP_LIBRARY, SKIP_MEMORY = "envelope", "library", "memory"
NOT_BIT_IDENTICAL = "not bit-identical"
OUT_OF_MEMORY = "out of device memory (GPU shared or the case too big for it)"


@dataclass
class CaseResult:
    backend: str
    spec: Any  # its kind's spec (a ProblemSpec, a SparseSpec): ``kind`` is the kind
    layout: LayoutSpec
    metamorphic: str
    verdict: str  # "pass" | "fail" | "skip"
    failures: list[str] = field(default_factory=list)
    reason: str = ""  # why skipped, or the first failure
    stats: ErrorStats | None = None
    seconds: float = 0.0
    diagnosis: list[str] = field(default_factory=list)
    problem: Any = None  # the kind's problem, kept on failure, for fixtures and diagnosis
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    stages: dict[str, float] = field(default_factory=dict)  # seconds per STAGES entry that ran
    skip_kind: str = ""  # SKIP_ENVELOPE or SKIP_MEMORY when skipped
    hung: bool = False  # the kernel ran past its time limit
    resolved_backend: str | None = None  # the kernel a policy backend (fa-auto) ran: PreparedCall's
    # how the metamorphic check judged (INVARIANT_BITS or INVARIANT_WITHIN_TOLERANCE); "" when none ran
    invariance: str = ""
    crash: str = ""  # what ended the kernel's process or device context (a signal, a CUDA error): a failure
    context_lost: bool = False  # this process's device is unusable after the case: no further case can run
    # the first failing case of the search, when this shrunk one is another: its description, its diagnosis
    # and whether that tells more than this one's (diagnose.says_more)
    first_failing: tuple[str, list[str], bool] | None = None

    @property
    def kind(self) -> ProblemKind:
        return kind_of(self.spec)

    @property
    def id(self) -> str:
        """Stable across runs and machines: a hash of backend, spec (seed included), layout and check."""
        blob = json.dumps([self.backend, self.spec.to_json(), self.layout.to_json(), self.metamorphic],
                          sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        kind = self.kind.name
        return {"id": self.id, "backend": self.backend, "kind": kind, "verdict": self.verdict, "reason": self.reason,
                "failures": self.failures, "diagnosis": self.diagnosis, "seconds": round(self.seconds, 4),
                "stages": {k: round(v, 5) for k, v in self.stages.items()}, "skip_kind": self.skip_kind,
                "metamorphic": self.metamorphic, "spec": self.spec.to_json(), "layout": self.layout.to_json(),
                **({} if kind == DENSE else {"description": self.spec.describe()}),
                "resolved_backend": self.resolved_backend, "invariance": self.invariance,
                **({"crash": self.crash} if self.crash else {}),
                "stats": None if self.stats is None else self.stats.to_json(),
                "first_failing": None if self.first_failing is None else
                {"case": self.first_failing[0], "diagnosis": self.first_failing[1],
                 "tells_more": self.first_failing[2]}}

    def describe(self) -> str:
        return (f"[{self.backend}] {self.spec.describe()} | {self.kind.describe_layout(self.layout)} "
                f"| metamorphic={self.metamorphic}")


class Stages:
    """Seconds per stage of one case; on a GPU each stage ends with a synchronize (its work is charged to it)."""

    def __init__(self, device: torch.device, into: dict[str, float],
                 on_stage: Callable[[str], None] | None = None):
        self.device, self.seconds, self.on_stage = device, into, on_stage
        self.current = ""

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.current = name
        if self.on_stage is not None:
            self.on_stage(name)
        started = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started


def run_case(backend: Backend, spec: Any, layout: LayoutSpec, device: torch.device | str,
             transform: str = "none", problem: Any = None, diagnose: bool = True,
             kernel_seconds: float | None = None, on_stage: Callable[[str], None] | None = None) -> CaseResult:
    """Judge ``backend`` on one case of its kind (``spec``: that kind's spec; a UsageError for another's).
    ``problem`` overrides building from ``spec`` (fixture replay); ``kernel_seconds`` limits each kernel call
    (None: no limit); ``on_stage`` is told each stage as it starts (an isolated worker's parent learns from it
    where a dead worker was)."""
    device = torch.device(device)
    kind = kind_named(backend.kind)
    if not isinstance(spec, kind.spec_type):
        raise UsageError(f"{backend.name} judges {kind.name} decode problems; this case is a "
                         f"{kind_of(spec).name} one")
    started = time.perf_counter()
    result = CaseResult(backend.name, spec, layout, transform, "pass")
    reason = backend.why_not(spec, layout, device)
    if reason is not None:
        skip = SKIP_ENVELOPE if reason.startswith(ENVELOPE_PREFIX) else SKIP_LIBRARY
        result.verdict, result.reason, result.skip_kind = "skip", f"{backend.name}: {reason}", skip
        return result
    stage = Stages(device, result.stages, on_stage)
    try:
        _judge(backend, kind, spec, layout, device, transform, problem, diagnose, result, stage, kernel_seconds)
    except Exception as exc:  # noqa: BLE001 - out of memory and device faults; anything else is the suite's bug
        fault = device_fault(exc)
        if fault is not None:
            crashed(result, fault, stage.current)
            result.context_lost = True
        elif is_out_of_memory(exc):
            release_cached(device)
            result.verdict, result.reason, result.skip_kind = "skip", OUT_OF_MEMORY, SKIP_MEMORY
            result.failures, result.diagnosis, result.out, result.lse, result.problem = [], [], None, None, None
        else:
            raise
    result.seconds = time.perf_counter() - started
    return result


def crashed(result: CaseResult, what: str, stage: str) -> None:
    """Make ``result`` the failure of a case whose kernel crashed (``what``: the signal or error) in ``stage``."""
    result.crash = what
    result.verdict = "fail"
    result.reason = f"the kernel crashed: {what}" + (f" (in stage '{stage}')" if stage else "")
    result.failures = [result.reason]
    result.diagnosis = []  # no output, and no problem: the device it was on may be unusable
    result.out, result.lse, result.problem = None, None, None


def hung_line(timeout: KernelTimeout) -> str:
    """The failure of a kernel call that ran past its time limit."""
    return f"the kernel {timeout} (a kernel that does not return is a bug)"


def _judge(backend: Backend, kind: ProblemKind, spec: Any, layout: LayoutSpec, device: torch.device,
           transform: str, problem: Any, diagnose: bool, result: CaseResult, stage: Stages,
           kernel_seconds: float | None) -> None:
    with stage("build"):
        if problem is None:
            problem = kind.build(spec, device)
    failures = result.failures
    limit = _Limit(kernel_seconds, result)
    with stage("prepare"):
        prepared = _prepare(backend, problem, layout, failures)
    result.resolved_backend = None if prepared is None else prepared.resolved_backend
    run = None if prepared is None else _call(prepared, problem, failures, limit, stage)
    ref: ReferenceResult | None = None
    if run is not None:
        out, lse = run
        result.out, result.lse = out, lse
        dtype = kind.dtype(problem)
        with stage("reference"):
            ref = kind.reference(problem)
        with stage("baseline"):
            baseline = kind.baseline(problem, dtype)
        with stage("compare"):
            lse_base = backend.envelope.lse_base if layout.return_lse else None
            result.stats, numeric = compare(out, lse, ref, baseline, dtype, lse_base)
        failures += numeric
        # The metamorphic call compares bits with the first call, so it also catches a kernel that differs
        # from one call to the next; the plain repeat runs when there is no transform, or when the
        # transformed call differed, to tell the two apart.
        if not failures and transform != "none":
            with stage("metamorphic"):
                relation = kind.relations[transform]
                moved, unmap = relation.apply(problem, spec.seed)
                again: list[str] = []
                moved_call = _prepare(backend, moved, layout, again)
                if moved_call is None:
                    failures.append(f"with {relation.description}: {again[0]}")
                elif not relation.bits or (transform == BATCH_ORDER
                                           and backend.batch_invariance == INVARIANT_WITHIN_TOLERANCE):
                    result.invariance = INVARIANT_WITHIN_TOLERANCE
                    assert ref is not None  # judged above
                    _check_within_tolerance(moved_call, moved, unmap, ref, baseline, dtype, lse_base, failures,
                                            limit, relation.description + ("" if not relation.bits else
                                                                           " (judged within tolerance, the "
                                                                           "backend's claim)"))
                else:
                    result.invariance = INVARIANT_BITS
                    _check_repeatable(moved_call, moved, out, lse, failures, limit, relation.description, unmap)
        differed = bool(failures) and NOT_BIT_IDENTICAL in failures[-1] and not result.hung
        if (not failures and transform == "none") or differed:
            with stage("repeat"):  # the very same call again: the same prepared arguments
                repeat: list[str] = []
                assert prepared is not None  # there is an output to repeat
                _check_repeatable(prepared, problem, out, lse, repeat, limit, "a second identical call")
                failures[:0] = repeat  # nondeterminism, if seen, is the first failure: it explains the rest
    if failures:
        result.verdict, result.reason, result.problem = "fail", failures[0], problem
        if diagnose and not result.hung and result.out is not None and result.out.shape == problem.out_shape:
            with stage("diagnose"):
                result.diagnosis = kind.diagnose(problem, result.out, result.lse, backend.envelope.lse_base, ref,
                                                 kernel_rerun(backend, layout, limit))


@dataclass
class _Limit:
    """The time limit of each kernel call of one case, and where a timeout is recorded (None: nowhere)."""

    seconds: float | None
    result: CaseResult | None


def _prepare(backend: Backend, problem: Any, layout: LayoutSpec,
             failures: list[str]) -> PreparedCall | None:
    try:
        return backend.prepare(problem, layout)
    except Exception as exc:  # noqa: BLE001 - a backend that cannot even lay out an in-envelope problem fails
        if is_out_of_memory(exc):
            raise
        failures.append(f"preparing the call raised {exception_line(exc)}")
        return None


def _call(prepared: PreparedCall, problem: Any, failures: list[str], limit: _Limit,
          stage: Stages | None = None) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Snapshot, poison, call; append contract violations. None when there is no output to judge."""
    with stage("prepare") if stage else contextlib.nullcontext():
        snapshot = {name: t.detach().clone() for name, t in prepared.inputs.items()}
    with stage("kernel") if stage else contextlib.nullcontext():
        return _checked_call(prepared, problem, snapshot, failures, limit)


def _checked_call(prepared: PreparedCall, problem: Any, snapshot: dict[str, torch.Tensor],
                  failures: list[str], limit: _Limit) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    try:
        with time_limit(limit.seconds, "" if limit.result is None else limit.result.describe()):
            raw = _invoke(prepared, problem.out_shape, problem.query.device)
    except KernelTimeout as exc:
        if limit.result is not None:
            limit.result.hung = True
        failures.append(hung_line(exc))
        return None
    except Exception as exc:  # noqa: BLE001 - raising inside the envelope is a failure by contract
        if is_out_of_memory(exc) or device_fault(exc) is not None:
            raise
        failures.append(f"kernel raised {exception_line(exc)}")
        return None
    try:
        out, lse = prepared.to_canonical(raw)
    except Exception as exc:  # noqa: BLE001
        failures.append(f"kernel returned something off-contract: {exception_line(exc, located=False)}")
        return None
    unwritten = prepared.out is not None and bool(torch.isinf(prepared.out).all())
    returned = out if prepared.kernel_out is None else prepared.kernel_out(raw)
    if prepared.out is not None and isinstance(returned, torch.Tensor):  # not a tensor at all: one message, below
        if returned.data_ptr() != prepared.out.data_ptr():
            failures.append("kernel returned a tensor other than the `out` buffer it was given"
                            + (", and left that buffer unwritten (out= ignored)" if unwritten else ""))
    if isinstance(out, torch.Tensor) and out.dtype != torch.bfloat16:
        failures.append(f"out dtype is {out.dtype}, the contract says bf16")
    names = list(snapshot)
    for name, changed in zip(names, changed_elements_each([(prepared.inputs[n], snapshot[n]) for n in names])):
        if changed:
            failures.append(f"kernel modified its input '{name}' ({changed} elements changed)")
    if not isinstance(out, torch.Tensor):
        failures.append(f"kernel returned {type(out).__name__}, not a tensor"
                        + (", and left the `out` buffer it was given unwritten" if unwritten else ""))
        return None
    judged = prepared.scaled(out)  # output_scale, if any, applied in float64
    return (judged.clone() if judged is out else judged), (None if lse is None else lse.clone())


def _invoke(prepared: PreparedCall, out_shape: tuple[int, ...], device: torch.device) -> Any:
    if prepared.out is not None:
        prepared.out.fill_(POISON_OUT)
    else:  # the kernel allocates: make the memory it will most likely get hold the poison. Several blocks:
        # the kernel's own temporaries of the same size may take the most recently freed ones first (CPU
        # allocators hand out recently freed blocks of a size first), and an older block of that size can hold
        # an earlier correct output, which unwritten rows would then pass for
        primed = [torch.full(out_shape, POISON_OUT, dtype=torch.bfloat16, device=device) for _ in range(PRIMED)]
        del primed
    raw = prepared.invoke()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return raw


def _check_repeatable(prepared: PreparedCall, problem: Any, out: torch.Tensor, lse: torch.Tensor | None,
                      failures: list[str], limit: _Limit, what: str, unmap: Unmap | None = None) -> None:
    """Call ``prepared`` (the same call, or a transformed problem's: ``what`` it is) and require the very same
    bits."""
    again_failures: list[str] = []
    run = _call(prepared, problem, again_failures, limit)
    if run is None or again_failures:
        failures.append(f"with {what}: " + (again_failures[0] if again_failures else "no output"))
        return
    out2, lse2 = unmap(*run) if unmap is not None else run
    diff = changed_elements(out2, out)
    if diff:
        failures.append(f"{NOT_BIT_IDENTICAL} with {what}: {diff} of {out.numel()} output elements differ")
    elif lse is not None and lse2 is not None and changed_elements(lse2, lse):
        failures.append(f"LSE {NOT_BIT_IDENTICAL} with {what}")


def _check_within_tolerance(prepared: PreparedCall, problem: Any, unmap: Unmap, ref: ReferenceResult,
                            baseline: ReferenceResult, dtype: str, lse_base: float | None, failures: list[str],
                            limit: _Limit, what: str) -> None:
    """Call the transformed ``prepared`` (``what`` it is) and judge its output, mapped back, by the tolerance
    model against the original problem's reference: for a relation that changes the order of the arithmetic,
    and the claim of a backend whose bits depend on the whole batch."""
    again: list[str] = []
    run = _call(prepared, problem, again, limit)
    if run is None or again:
        failures.append(f"with {what}: " + (again[0] if again else "no output"))
        return
    out2, lse2 = unmap(*run)
    numeric = compare(out2, lse2, ref, baseline, dtype, lse_base)[1]
    if numeric:
        failures.append(f"with {what}: {numeric[0]}")


def kernel_rerun(backend: Backend, layout: LayoutSpec, limit: _Limit | None = None) -> Rerun:
    """The kernel's output on another problem (diagnosis re-runs it), laid out as before (less what the kind's
    ``rerun_layout`` leaves out) and under the case's time limit (a timeout here is no verdict: the case has
    failed already; none without ``limit``)."""
    plain = kind_named(backend.kind).rerun_layout(layout)

    def rerun(problem: Any) -> torch.Tensor | None:
        prepared = _prepare(backend, problem, plain, [])
        call_limit = _Limit(None, None) if limit is None or limit.result is None else \
            _Limit(limit.seconds, replace(limit.result))
        run = None if prepared is None else _call(prepared, problem, [], call_limit)
        return None if run is None else run[0]
    return rerun
