"""Run one problem on one backend and judge it: the per-case checks, in the order that makes them sharp.

1. ``why_not`` before any kernel is touched (skip with the backend's own sentence).
2. Lay out the problem; snapshot every input; poison ``out`` with +inf (or, when the kernel allocates, prime
   the allocator with +inf so recycled memory cannot pass for written output). Unused cache slots already
   hold NaN (generate.py), so a read outside a sequence poisons the result.
3. Call the kernel -- before the reference is allocated, as FlashMLA does.
4. Check: ``out`` filled in place and returned, inputs bit-identical, every element finite and within the
   tolerance model (compare.py), LSE in the backend's base; the same call again gives the same bits; one
   metamorphic transformation (metamorphic.py) gives the same bits.
5. On failure, ask diagnose.py which known misreading explains the output.
"""
from __future__ import annotations

import hashlib
import json
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from . import metamorphic
from .backends.base import Backend, PreparedCall
from .compare import ErrorStats, baseline_decode, compare
from .generate import ProblemSpec, build_problem
from .layouts import LayoutSpec
from .problem import DecodeProblem
from .reference import ReferenceResult, fast_matmul_mode, reference_decode

POISON_OUT = float("inf")


@dataclass
class CaseResult:
    backend: str
    spec: ProblemSpec
    layout: LayoutSpec
    metamorphic: str
    verdict: str  # "pass" | "fail" | "skip"
    failures: list[str] = field(default_factory=list)
    reason: str = ""  # why skipped, or the first failure
    stats: ErrorStats | None = None
    seconds: float = 0.0
    diagnosis: list[str] = field(default_factory=list)
    problem: DecodeProblem | None = None  # kept on failure, for fixtures and diagnosis
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None

    @property
    def id(self) -> str:
        """Stable across runs and machines: a hash of backend, spec (seed included), layout and check."""
        blob = json.dumps([self.backend, self.spec.to_json(), self.layout.to_json(), self.metamorphic],
                          sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "backend": self.backend, "verdict": self.verdict, "reason": self.reason,
                "failures": self.failures, "diagnosis": self.diagnosis, "seconds": round(self.seconds, 4),
                "metamorphic": self.metamorphic, "spec": self.spec.to_json(), "layout": self.layout.to_json(),
                "stats": None if self.stats is None else self.stats.to_json()}

    def describe(self) -> str:
        return f"[{self.backend}] {self.spec.describe()} | {self.layout.describe()} | metamorphic={self.metamorphic}"


def run_case(backend: Backend, spec: ProblemSpec, layout: LayoutSpec, device: torch.device | str,
             transform: str = "none", problem: DecodeProblem | None = None, diagnose: bool = True) -> CaseResult:
    """Judge ``backend`` on one case. ``problem`` overrides building from ``spec`` (fixture replay)."""
    device = torch.device(device)
    started = time.perf_counter()
    result = CaseResult(backend.name, spec, layout, transform, "pass")
    reason = backend.why_not(spec, layout, device)
    if reason is not None:
        result.verdict, result.reason = "skip", f"{backend.name}: {reason}"
        return result
    try:
        return _judge(backend, spec, layout, device, transform, problem, diagnose, result, started)
    except torch.OutOfMemoryError:
        # the GPU is shared (other processes, the suite's own tensors): not a verdict on the kernel
        torch.cuda.empty_cache()
        result.verdict, result.reason = "skip", "out of device memory (GPU shared or the case too big for it)"
        result.failures, result.out, result.lse, result.problem = [], None, None, None
        result.seconds = time.perf_counter() - started
        return result


def _judge(backend: Backend, spec: ProblemSpec, layout: LayoutSpec, device: torch.device, transform: str,
           problem: DecodeProblem | None, diagnose: bool, result: CaseResult, started: float) -> CaseResult:
    if problem is None:
        problem = build_problem(spec, device)
    failures = result.failures
    run = _run_kernel(backend, problem, layout, failures)
    ref: ReferenceResult | None = None
    if run is not None:
        out, lse = run
        result.out, result.lse = out, lse
        ref = judge_reference(problem)
        baseline = baseline_decode(problem, spec.dtype)
        lse_base = backend.envelope.lse_base if layout.return_lse else None
        result.stats, numeric = compare(out, lse, ref, baseline, spec.dtype, lse_base)
        failures += numeric
        if not failures:
            _check_repeatable(backend, problem, layout, out, lse, failures, transform="none")
        if not failures and transform != "none":
            _check_repeatable(backend, problem, layout, out, lse, failures, transform=transform, seed=spec.seed)
    if failures:
        result.verdict, result.reason, result.problem = "fail", failures[0], problem
        if diagnose and result.out is not None and result.out.shape == problem.out_shape:
            result.diagnosis = _diagnose(problem, result.out, result.lse, backend.envelope.lse_base, ref)
    result.seconds = time.perf_counter() - started
    return result


def _run_kernel(backend: Backend, problem: DecodeProblem, layout: LayoutSpec,
                failures: list[str]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """Prepare, snapshot, poison, call; append contract violations. None when there is no output to judge."""
    try:
        prepared = backend.prepare(problem, layout)
    except Exception as exc:  # noqa: BLE001 - a backend that cannot even lay out an in-envelope problem fails
        failures.append(f"preparing the call raised {_exc_line(exc)}")
        return None
    snapshot = {name: t.detach().clone() for name, t in prepared.inputs.items()}
    try:
        raw = _invoke(prepared, problem.out_shape, problem.device)
    except torch.OutOfMemoryError:
        raise  # judged as the shared GPU's state, in run_case
    except Exception as exc:  # noqa: BLE001 - raising inside the envelope is a failure by contract
        failures.append(f"kernel raised {_exc_line(exc)}")
        return None
    try:
        out, lse = prepared.to_canonical(raw)
    except Exception as exc:  # noqa: BLE001
        failures.append(f"kernel returned something off-contract: {_exc_line(exc)}")
        return None
    if prepared.out is not None:
        if not isinstance(out, torch.Tensor) or out.data_ptr() != prepared.out.data_ptr():
            written = not bool(torch.isinf(prepared.out).all())
            failures.append("kernel returned a tensor other than the `out` buffer it was given"
                            + ("" if written else ", and left that buffer unwritten (out= ignored)"))
    if isinstance(out, torch.Tensor) and out.dtype != torch.bfloat16:
        failures.append(f"out dtype is {out.dtype}, the contract says bf16")
    for name, before in snapshot.items():
        changed = _changed(prepared.inputs[name], before)
        if changed:
            failures.append(f"kernel modified its input '{name}' ({changed} elements changed)")
    if not isinstance(out, torch.Tensor):
        failures.append(f"kernel returned {type(out).__name__}, not a tensor")
        return None
    judged = prepared.scaled(out)  # output_scale, if any, applied in float64
    return (judged.clone() if judged is out else judged), (None if lse is None else lse.clone())


def _invoke(prepared: PreparedCall, out_shape: tuple[int, ...], device: torch.device) -> Any:
    if prepared.out is not None:
        prepared.out.fill_(POISON_OUT)
    else:  # the kernel allocates: make the memory it will most likely get hold the poison
        torch.full(out_shape, POISON_OUT, dtype=torch.bfloat16, device=device)
    raw = prepared.invoke()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return raw


def _check_repeatable(backend: Backend, problem: DecodeProblem, layout: LayoutSpec, out: torch.Tensor,
                      lse: torch.Tensor | None, failures: list[str], transform: str, seed: int = 0) -> None:
    """Run again (after ``transform``) and require the very same bits."""
    moved, unmap = metamorphic.transform(problem, transform, seed)
    again_failures: list[str] = []
    run = _run_kernel(backend, moved, layout, again_failures)
    what = "a second identical call" if transform == "none" else metamorphic.DESCRIPTIONS[transform]
    if run is None or again_failures:
        failures.append(f"with {what}: " + (again_failures[0] if again_failures else "no output"))
        return
    out2, lse2 = unmap(*run)
    diff = _changed(out2, out)
    if diff:
        failures.append(f"not bit-identical with {what}: {diff} of {out.numel()} output elements differ")
    elif lse is not None and lse2 is not None and _changed(lse2, lse):
        failures.append(f"LSE not bit-identical with {what}")


def _changed(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of elements whose bits differ (NaN payloads included); shape changes count as all."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel())
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return int((a.contiguous().view(ints) != b.contiguous().view(ints)).sum())


def judge_reference(problem: DecodeProblem) -> ReferenceResult:
    """float64 on CPUs; on GPUs the fast mode (exact bf16 products, fp32 sums; reference.py states its bound)."""
    if problem.device.type == "cpu":
        return reference_decode(problem, torch.float64)
    return reference_decode(problem, torch.float32, matmul=fast_matmul_mode(problem))


def _diagnose(problem: DecodeProblem, out: torch.Tensor, lse: torch.Tensor | None, lse_base: float,
              truth: ReferenceResult | None) -> list[str]:
    from .diagnose import diagnose
    return [str(e) for e in diagnose(problem, out, lse, lse_base, truth=truth)]


def _exc_line(exc: BaseException) -> str:
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}" if frame else ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}{where}"
