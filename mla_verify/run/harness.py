"""Run one problem on one backend and judge it: the per-case checks, in the order that makes them sharp -- the same
for every problem kind (mla_verify/kinds: dense decode, sparse top-k decode), which supplies the problem, its
reference and baseline, its metamorphic relations and its catalogue of misreadings.

1. ``why_not`` before any kernel is touched (skip with the backend's own sentence).
2. Lay out the problem; snapshot every input; poison ``out`` with +inf (or, when the kernel allocates, prime
   the allocator with +inf so recycled memory cannot pass for written output). Unused cache slots already
   hold NaN (generate.py, sparse.py), so a read outside a sequence (or an index row) poisons the result.
3. Call the kernel -- before the reference is allocated, as FlashMLA does.
4. Check: ``out`` filled in place and returned, inputs bit-identical, every element finite and within the
   tolerance model (compare.py, with the kind's same-precision baseline -- in the backend's declared arithmetic,
   ``Backend.arithmetic_for``), LSE in the backend's base; the same call again gives the same bits; one of the
   kind's metamorphic relations gives the same bits where the relation keeps the arithmetic (``Relation.bits``)
   and the backend claims them (``Backend.claims_bits``), else passes the same tolerance model against the same
   reference -- for a relation that changes the arithmetic's order (a sparse row's order), and for one the
   kernel claims no bit-level invariance for, whose moved bits are then a note (``CaseResult.invariance``
   records which judgement was applied, ``CaseResult.notes`` the notes).
5. On failure, ask the kind's catalogue which known misreading explains the output, or where it is wrong
   (diagnose.py and localize.py, which may re-run the kernel to tell where a NaN comes from); when only a
   metamorphic relation broke, the first output is right: the diagnosis says where the relation's output
   differs from it.

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
from ..judge.explains import WHERE, Rerun
from ..kinds import ProblemKind, Relation, kind_named, kind_of
from ..problems.arithmetic import DEFAULT
from ..problems.envelope import DENSE
from ..problems.layouts import LayoutSpec
from ..problems.metamorphic import Unmap
from ..problems.reference import ReferenceResult
from .watchdog import KernelTimeout, time_limit

POISON_OUT = float("inf")
PRIMED = 8  # poisoned blocks of the output's size freed just before a kernel that allocates its output
# the stages of one case, in order ("draw" is the engine's: the strategy's time for this case)
STAGES = ("draw", "build", "prepare", "kernel", "reference", "baseline", "compare", "repeat", "metamorphic",
          "diagnose")
# CaseResult.skip_kind: outside the backend's declared envelope (static), refused by its library for this
# problem's data (e.g. FlashInfer's planner), no device memory for it (it ran out), or a relation this device
# cannot hold (asked before anything ran)
SKIP_ENVELOPE, SKIP_LIBRARY, SKIP_MEMORY = "envelope", "library", "memory"
SKIP_DEVICE = "device"  # a relation that needs more of the device than this one has (Relation.why_not)
NOT_BIT_IDENTICAL = "not bit-identical"
LISTED_ROWS = 4  # rows a broken relation's diagnosis names before "and N more"
FIRST_PASSED = "the first output passed the tolerance model: the relation, not a key or position, is what failed"
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
    # what passed but is worth saying: bits a metamorphic relation moved within tolerance, where the kernel
    # claims no bit-level invariance for it
    notes: list[str] = field(default_factory=list)
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
                **({"notes": self.notes} if self.notes else {}),
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
    relation = kind.relations.get(transform)
    reason = None if relation is None or relation.why_not is None else relation.why_not(spec, layout, device)
    if reason is not None:  # the device cannot hold what the relation needs: no kernel is touched
        result.verdict, result.reason, result.skip_kind = "skip", f"{backend.name}: {reason}", SKIP_DEVICE
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
    where: list[str] = []  # where the transformed call's output differs from the first (right) one
    relation_broke = False  # the only failure is a metamorphic relation's (the first output passed)
    arithmetic = DEFAULT
    if run is not None:
        out, lse = run
        result.out, result.lse = out, lse
        dtype = kind.dtype(problem)
        with stage("reference"):
            ref = kind.reference(problem)
        arithmetic = backend.arithmetic_for(dtype, result.resolved_backend)
        with stage("baseline"):
            baseline = kind.baseline(problem, dtype, arithmetic)
        with stage("compare"):
            lse_base = backend.envelope.lse_base if layout.return_lse else None
            empty_lse = backend.envelope.empty_lse
            result.stats, numeric = compare(out, lse, ref, baseline, dtype, lse_base, arithmetic.emulation, empty_lse)
        failures += numeric
        # The metamorphic call compares bits with the first call, so it also catches a kernel that differs
        # from one call to the next; the plain repeat runs when there is no transform, or when the
        # transformed call's bits differed where the relation keeps them, to tell the two apart.
        moved_bits = False
        if not failures and transform != "none":
            with stage("metamorphic"):
                relation = kind.relations[transform]
                moved, unmap = relation.apply(problem, spec.seed)
                again: list[str] = []
                moved_call = _prepare(backend, moved, layout, again)
                if moved_call is None:
                    failures.append(f"with {relation.description}: {again[0]}")
                    where = [f"{WHERE}the relation broke: the call with {relation.description} could not be "
                             f"prepared; {FIRST_PASSED}"]
                else:
                    bits = relation.bits and backend.claims_bits(transform)
                    result.invariance = INVARIANT_BITS if bits else INVARIANT_WITHIN_TOLERANCE
                    judged = Judged(ref, baseline, dtype, lse_base, arithmetic.emulation, empty_lse)
                    moved_bits, where = _check_relation(moved_call, moved, unmap, out, lse, relation,
                                                        None if bits else judged, failures, result.notes, limit)
        relation_broke = bool(failures) and transform != "none" and not numeric
        if (not failures and transform == "none") or (moved_bits and not result.hung):
            with stage("repeat"):  # the very same call again: the same prepared arguments
                repeat: list[str] = []
                assert prepared is not None  # there is an output to repeat
                _check_repeatable(prepared, problem, out, lse, repeat, limit)
                failures[:0] = repeat  # nondeterminism, if seen, is the first failure: it explains the rest
                if repeat:  # the relation's moved bits were the kernel's nondeterminism
                    result.notes.clear()
                    relation_broke = False
    if failures:
        result.verdict, result.reason, result.problem = "fail", failures[0], problem
        if relation_broke and where:  # the first output is right: say where the relation's output differs
            result.diagnosis = where  # from it, not what a search of the right one's keys makes of it
        elif diagnose and not result.hung and result.out is not None and result.out.shape == problem.out_shape:
            with stage("diagnose"):
                result.diagnosis = kind.diagnose(problem, result.out, result.lse, backend.envelope.lse_base, ref,
                                                 kernel_rerun(backend, layout, limit), arithmetic)


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
                      failures: list[str], limit: _Limit) -> None:
    """Call ``prepared`` again and require the very same bits."""
    again_failures: list[str] = []
    run = _call(prepared, problem, again_failures, limit)
    what = "a second identical call"
    if run is None or again_failures:
        failures.append(f"with {what}: " + (again_failures[0] if again_failures else "no output"))
        return
    out2, lse2 = run
    diff = changed_elements(out2, out)
    if diff:
        failures.append(f"{NOT_BIT_IDENTICAL} with {what}: {diff} of {out.numel()} output elements differ")
    elif lse is not None and lse2 is not None and changed_elements(lse2, lse):
        failures.append(f"LSE {NOT_BIT_IDENTICAL} with {what}")


@dataclass
class Judged:
    """What the first call's output was judged by: the reference, the baseline (``emulation`` names its declared
    arithmetic; "" the plain one), the dtype, the LSE base (None: no LSE) and the LSE of a row with no key (the
    backend's convention: compare()'s ``empty_lse``)."""

    ref: ReferenceResult
    baseline: ReferenceResult
    dtype: str
    lse_base: float | None
    emulation: str = ""
    empty_lse: float | None = None


def _check_relation(prepared: PreparedCall, problem: Any, unmap: Unmap, out: torch.Tensor, lse: torch.Tensor | None,
                    relation: Relation, judged: Judged | None, failures: list[str], notes: list[str],
                    limit: _Limit) -> tuple[bool, list[str]]:
    """Call the transformed problem and hold its output, mapped back, to ``relation``: the very same bits as
    ``out``/``lse`` (``judged`` None: the relation keeps them and the backend claims them), or the tolerance
    model against the same reference -- where the relation keeps the arithmetic, moved bits are then a note.
    Returns whether bits moved where the relation keeps them, and when the relation broke, diagnosis lines
    saying where the outputs differ."""
    what = relation.description
    again: list[str] = []
    run = _call(prepared, problem, again, limit)
    if run is None or again:
        failures.append(f"with {what}: " + (again[0] if again else "no output"))
        return False, [f"{WHERE}the relation broke: the call with {what} gave no output to compare; {FIRST_PASSED}"]
    out2, lse2 = unmap(*run)
    diff = changed_elements(out2, out)
    lse_moved = lse is not None and lse2 is not None and bool(changed_elements(lse2, lse))
    moved = relation.bits and (bool(diff) or lse_moved)
    if judged is None:
        if diff:
            failures.append(f"{NOT_BIT_IDENTICAL} with {what}: {diff} of {out.numel()} output elements differ")
        elif lse_moved:
            failures.append(f"LSE {NOT_BIT_IDENTICAL} with {what}")
    else:
        numeric = compare(out2, lse2, judged.ref, judged.baseline, judged.dtype, judged.lse_base, judged.emulation,
                          judged.empty_lse)[1]
        claim = " (judged within tolerance: the kernel claims no bit-level invariance for it)" if relation.bits else ""
        if numeric:
            failures.append(f"with {what}{claim}: {numeric[0]}")
        elif moved:
            notes.append(f"bits moved with {what}, within tolerance (no bit-level invariance claimed for it): "
                         f"{diff} of {out.numel()} output elements differ" + (", and the LSE" if lse_moved else ""))
    broke = bool(failures)  # (called only while the first output had passed)
    return moved, _relation_lines(what, out, out2, diff) if broke else []


def _relation_lines(what: str, out: torch.Tensor, out2: torch.Tensor, diff: int) -> list[str]:
    """Where the relation's output differs from the first call's (the first one passed: it is the reference
    point), in the diagnosis's "where: " form."""
    if not diff:
        return [f"{WHERE}the relation broke: with {what} every output element is the same, the LSE is not; "
                f"{FIRST_PASSED}"]
    a, b = out.to(torch.float64), out2.to(torch.float64)
    gap = torch.where(a == b, 0.0, (a - b).abs().nan_to_num(float("inf")))
    at = tuple(int(i) for i in (gap == gap.max()).nonzero()[0])
    rows = (gap.amax(-1) > 0).nonzero()
    named = ", ".join("({}, {}, {})".format(*(int(i) for i in r)) for r in rows[:LISTED_ROWS])
    more = f" and {rows.shape[0] - LISTED_ROWS} more" if rows.shape[0] > LISTED_ROWS else ""
    return [f"{WHERE}the relation broke: with {what}, {diff} of {out.numel()} output elements differ, in "
            f"{rows.shape[0]} (batch entry, token, head) row(s) {named}{more}; the largest at batch {at[0]}, "
            f"token {at[1]}, head {at[2]}, dim {at[3]}: {float(a[at]):.6g} as first called, {float(b[at]):.6g} "
            f"with {what}; {FIRST_PASSED}"]


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
