"""``check`` and ``replay`` for sparse (top-k) decode backends.

A sparse backend is named like any other (``--backend flashmla-sparse``) or given as ``--kernel MODULE:ATTR``
naming a ``SparseBackend`` instance (``mla_verify.kernels.sparse_mutants:<mutant>`` are such). Its run is
``run/sparse_check.py``'s: the verdict, the shrunk failing case with its diagnosis, and a reproducer -- a JSON
file holding the spec, which rebuilds the problem bit for bit on the same device type -- that
``mla-verify replay`` re-runs. Cases are isolated as dense ones are (``--isolate``, run/isolate.py): a crash is
a failing case; in-process, the case in flight is written first (records/failure.py's ``in_flight_path``), so
that a crash of the whole process leaves it to replay.
"""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch

from ..backends import SparseBackend, named_sparse_backend
from ..core.errors import FixtureError, ProblemError, UsageError
from ..draw.profiles import Profile
from ..problems.sparse import SparseSpec
from ..records.failure import IN_FLIGHT_REASON, crash_line, in_flight_note, in_flight_path
from ..records.fixtures import atomic_write, overwrite_in_place
from ..run.isolate import sparse_case_judge
from ..run.sparse_case import SparseCaseResult
from ..run.sparse_check import SparseRunResult, verify_sparse

KIND = "sparse-regression"


def require_runnable(chosen: list[tuple[SparseBackend, str | None]], device: torch.device) -> None:
    """A sparse backend the user named must be able to run here: else a UsageError, before any case runs."""
    for backend, _ in chosen:
        if (reason := backend.unavailable_reason(device)) is not None:
            raise UsageError(f"{backend.name} cannot run on {device}: {reason}")


def check_sparse(chosen: list[tuple[SparseBackend, str | None]], device: torch.device, profile: Profile,
                 seed: int | None, max_examples: int | None, minutes: float | None, fixtures_dir: Path,
                 isolate: bool = False, case_timeout: float | None = None
                 ) -> tuple[list[SparseRunResult], dict[str, str]]:
    """Run each sparse backend; print its summary and, on failure, the case, diagnosis and reproducer. Returns
    the runs (one that cannot run here is recorded as unavailable) and the reproducers written, by backend
    name. In-process, each case is written to the in-flight record before it runs. Ctrl-C ends the run in
    progress (kept, marked interrupted) and leaves the rest unrun."""
    runs: list[SparseRunResult] = []
    fixtures: dict[str, str] = {}
    in_flight = in_flight_path(fixtures_dir)
    for backend, _ in chosen:
        if (reason := backend.unavailable_reason(device)) is not None:
            print(f"skipped {backend.name}: {reason}", flush=True)
    for i, (backend, target) in enumerate(chosen):
        available = backend.unavailable_reason(device) is None
        if available and not isolate:
            fixtures_dir.mkdir(parents=True, exist_ok=True)
            print(in_flight_note(in_flight), flush=True)

        def starting(spec: SparseSpec, backend: SparseBackend = backend, target: str | None = target) -> None:
            meta = _record(backend, target, spec, device, "fail", [IN_FLIGHT_REASON], [], "the process died")
            overwrite_in_place(in_flight, _json(meta))  # written over for each case: no rename, no sync

        run = verify_sparse(backend, device, profile, max_examples=max_examples, seed=seed or 0, minutes=minutes,
                            isolate=isolate, kernel_seconds=case_timeout, on_start=None if isolate else starting,
                            target=target)  # an unavailable backend: a run recording why, no case run
        runs.append(run)
        if not available:
            continue
        in_flight.unlink(missing_ok=True)
        counts = {v: sum(c.verdict == v for c in run.cases) for v in ("pass", "fail", "skip")}
        n = len(run.cases)
        print(f"{backend.name}: {run.verdict.upper()} -- {n} sparse case{'s' * (n != 1)} ({counts['pass']} passed, "
              f"{counts['fail']} failed, {counts['skip']} skipped){' (interrupted)' if run.interrupted else ''}",
              flush=True)
        if run.failure is not None:
            path = save_sparse_reproducer(fixtures_dir, run.failure, backend, target, device)
            if path is not None:
                fixtures[run.backend] = str(path)
            print("\n" + "\n".join(failure_lines(run.failure, path)))
        if run.interrupted:
            print(f"interrupted: the report holds the cases judged until then; {len(chosen) - i - 1} sparse "
                  "backend(s) not run", flush=True)
            break
    return runs, fixtures


def failure_lines(case: SparseCaseResult, path: Path | None) -> list[str]:
    lines = [f"FAIL {case.describe()}", *(f"  - {f}" for f in case.failures)]
    if not case.crash:  # a crash left no output to diagnose
        lines += [f"  diagnosis: {d}" for d in case.diagnosis] or \
            ["  diagnosis: no known sparse misreading explains it"]
    if path is not None:
        lines += [f"  reproducer: {path}", f"  replay with: mla-verify replay {path}"]
        if case.crash:  # docs/judging.md, "A crash"
            lines.append(f"  where it faults: `mla-verify replay {path} --no-isolate` under compute-sanitizer "
                         "(GPU) or gdb (CPU), docs/judging.md")
    return lines


def save_sparse_reproducer(directory: Path, case: SparseCaseResult, backend: SparseBackend, target: str | None,
                           device: torch.device) -> Path | None:
    """The reproducer's path, named by the backend and the case (backends that fail on one case must not write
    over each other's); None, said on stderr, when it cannot be written."""
    named = hashlib.sha256(f"{target or backend.name}\n{case.spec.case_id()}".encode()).hexdigest()[:16]
    path = directory / f"sparse-{named}.json"
    meta = _record(backend, target, case.spec, device, case.verdict, case.failures, case.diagnosis, case.crash)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write(path, _json(meta))  # nothing half-written
    except OSError as e:
        print(f"mla-verify: could not write the reproducer in {directory}: {e.strerror}", file=sys.stderr)
        return None
    return path


def _record(backend: SparseBackend, target: str | None, spec: SparseSpec, device: torch.device, verdict: str,
            failures: list[str], diagnosis: list[str], crash: str) -> dict[str, Any]:
    """A sparse reproducer's fields: the backend by what it was named by, and where a --kernel was loaded from."""
    return {"kind": KIND, "backend": target or backend.name, "spec": spec.to_json(), "source_device": device.type,
            "verdict": verdict, "failures": failures, "diagnosis": diagnosis,
            "description": f"[{backend.name}] {spec.describe()}", **({"crash": crash} if crash else {}),
            **({"kernel_source": backend.source} if backend.source else {})}


def _json(meta: dict[str, Any]) -> bytes:
    return (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode()


def sparse_fixture(path: str) -> dict[str, Any] | None:
    """The sparse reproducer at ``path``, or None when it is not one (a dense fixture)."""
    p = Path(path)
    if p.suffix != ".json":  # named by its stem, as replay allows
        p = p.with_name(p.name + ".json")
    if not p.is_file():
        return None
    try:
        meta = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("kind") == KIND else None


def replay_sparse(meta: dict[str, Any], path: str, backend_name: str | None, kernel: str | None,
                  device: torch.device | None, isolate: bool | None = None,
                  case_timeout: float | None = None) -> bool:
    """Re-run a sparse reproducer (isolated unless ``isolate`` is False: its spec always rebuilds its problem);
    True when it fails again."""
    try:
        spec = SparseSpec.from_json(meta.get("spec"))
    except ProblemError as e:
        raise FixtureError(f"{path}: {e}") from None
    target = kernel or backend_name or meta.get("backend")
    if not isinstance(target, str):
        raise FixtureError(f"{path}: records no backend; name one with --backend or --kernel")
    backend = named_sparse_backend(target, meta.get("kernel_source") if target == meta.get("backend") else None)
    device = device or torch.device(meta.get("source_device") or "cpu")
    reason = backend.why_not(spec, device)
    if reason is not None:
        raise UsageError(f"{backend.name} cannot replay this case on {device}: {reason}")
    print(f"replaying {path} on {device}: {backend.name}\n  case: {spec.describe()}")
    judge = sparse_case_judge(backend, device, case_timeout, isolate is not False, target)
    try:
        case = judge(spec, True)
    finally:
        judge.close()
    if case.crash or meta.get("crash"):
        print(f"  {crash_line(case.crash, meta.get('crash'))}")
    print("\n".join(f"  - {f}" for f in case.failures) or "  (no failures)")
    for d in case.diagnosis:
        print(f"  diagnosis: {d}")
    print(f"verdict: {case.verdict.upper()} (recorded: {str(meta.get('verdict')).upper()})")
    return case.verdict == "fail"
