"""``check`` and ``replay`` for sparse (top-k) decode backends.

A sparse backend is named like any other (``--backend flashmla-sparse``) or given as ``--kernel MODULE:ATTR``
naming a ``SparseBackend`` instance (``mla_verify.kernels.sparse_mutants:<mutant>`` are such). Its run is
``run/sparse_check.py``'s: the verdict, the shrunk failing case with its diagnosis, and a reproducer -- a JSON
file holding the spec, which rebuilds the problem bit for bit on the same device type -- that
``mla-verify replay`` re-runs.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..backends import SparseBackend, sparse_backends
from ..backends.user_kernel import resolve_kernel
from ..core.errors import FixtureError, UsageError
from ..draw.profiles import Profile
from ..problems.sparse import SparseSpec
from ..run.sparse_check import SparseCaseResult, run_sparse_case, verify_sparse

KIND = "sparse-regression"


def require_runnable(chosen: list[tuple[SparseBackend, str | None]], device: torch.device) -> None:
    """A sparse backend the user named must be able to run here: else a UsageError, before any case runs."""
    for backend, _ in chosen:
        if (reason := backend.unavailable_reason(device)) is not None:
            raise UsageError(f"{backend.name} cannot run on {device}: {reason}")


def check_sparse(chosen: list[tuple[SparseBackend, str | None]], device: torch.device, profile: Profile,
                 seed: int | None, max_examples: int | None, minutes: float | None, fixtures_dir: Path) -> bool:
    """Run each sparse backend; print its summary and, on failure, the case, diagnosis and reproducer. True if
    any failed."""
    failed = False
    for backend, _ in chosen:
        if (reason := backend.unavailable_reason(device)) is not None:
            print(f"skipped {backend.name}: {reason}", flush=True)
    for backend, target in chosen:
        if backend.unavailable_reason(device) is not None:
            continue
        run = verify_sparse(backend, device, profile, max_examples=max_examples, seed=seed or 0, minutes=minutes)
        counts = {v: sum(c.verdict == v for c in run.cases) for v in ("pass", "fail", "skip")}
        n = len(run.cases)
        print(f"{backend.name}: {run.verdict.upper()} -- {n} sparse case{'s' * (n != 1)} ({counts['pass']} passed, "
              f"{counts['fail']} failed, {counts['skip']} skipped)", flush=True)
        if run.failure is not None:
            failed = True
            path = save_sparse_reproducer(fixtures_dir, run.failure, target, device)
            print("\n" + "\n".join(failure_lines(run.failure, path)))
    return failed


def failure_lines(case: SparseCaseResult, path: Path | None) -> list[str]:
    lines = [f"FAIL {case.describe()}", *(f"  - {f}" for f in case.failures)]
    lines += [f"  diagnosis: {d}" for d in case.diagnosis] or ["  diagnosis: no known sparse misreading explains it"]
    if path is not None:
        lines += [f"  reproducer: {path}", f"  replay with: mla-verify replay {path}"]
    return lines


def save_sparse_reproducer(directory: Path, case: SparseCaseResult, target: str | None,
                           device: torch.device) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"sparse-{case.spec.case_id()}.json"
    meta = {"kind": KIND, "backend": target or case.backend, "spec": case.spec.to_json(),
            "source_device": device.type, "verdict": case.verdict, "failures": case.failures,
            "diagnosis": case.diagnosis, "description": case.describe()}
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)  # nothing half-written
    return path


def sparse_fixture(path: str) -> dict[str, Any] | None:
    """The sparse reproducer at ``path``, or None when it is not one (a dense fixture)."""
    p = Path(path)
    if p.suffix != ".json" or not p.is_file():
        return None
    try:
        meta = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("kind") == KIND else None


def replay_sparse(meta: dict[str, Any], path: str, backend_name: str | None, kernel: str | None,
                  device: torch.device | None) -> bool:
    """Re-run a sparse reproducer; True when it fails again."""
    spec = SparseSpec.from_json(meta.get("spec"))
    target = kernel or backend_name or meta.get("backend")
    if not isinstance(target, str):
        raise FixtureError(f"{path}: records no backend; name one with --backend or --kernel")
    registry = sparse_backends()
    backend = resolve_kernel(target)[2] if ":" in target else registry.get(target)
    if not isinstance(backend, SparseBackend):
        raise UsageError(f"{target} is not a sparse backend (known: {', '.join(registry)}, or MODULE:ATTR naming "
                         "a SparseBackend)")
    device = device or torch.device(meta.get("source_device") or "cpu")
    reason = backend.why_not(spec, device)
    if reason is not None:
        raise UsageError(f"{backend.name} cannot replay this case on {device}: {reason}")
    print(f"replaying {path} on {device}: {backend.name}\n  case: {spec.describe()}")
    case = run_sparse_case(backend, spec, device)
    print("\n".join(f"  - {f}" for f in case.failures) or "  (no failures)")
    for d in case.diagnosis:
        print(f"  diagnosis: {d}")
    print(f"verdict: {case.verdict.upper()} (recorded: {str(meta.get('verdict')).upper()})")
    return case.verdict == "fail"
