"""``check --fib-solution``: a flashinfer-bench solution checked as any kernel, and its failure handed back to
flashinfer-bench as a workload with its evaluator's verdict on it (docs/flashinfer-bench.md).

The solution becomes a backend (fib/solution.py) and runs through the same search, checks, shrinking
and reproducers as ``--kernel``. On a failure, beside the reproducer, the minimal case is added as a workload
to a flashinfer-bench dataset folder, ``<fixtures-dir>/flashinfer-bench/`` (fib/workload.py), read back
through flashinfer-bench's TraceSet, and judged there as its evaluator judges (fib/judgement.py): the
FAIL block says whether flashinfer-bench would have flagged this very case.
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from ..core.errors import UsageError
from ..fib.judgement import FibJudgement, fib_judgement
from ..fib.solution import FibSolutionBackend, build, fib_backend, run_as_evaluator
from ..fib.workload import ExportedWorkload, export_workload, load_workload_inputs
from ..kinds import kind_named
from ..run.harness import CaseResult

DATASET_DIR = "flashinfer-bench"  # under --fixtures-dir: the dataset failing cases are exported to


def check_fib_arguments(ns: argparse.Namespace) -> None:
    """``--fib-definition`` and ``--fib-dataset`` only say where ``--fib-solution``'s definition is."""
    for flag, value in (("--fib-definition", ns.fib_definition), ("--fib-dataset", ns.fib_dataset)):
        if value is not None and ns.fib_solution is None:
            raise UsageError(f"{flag} names the definition of a --fib-solution; give the solution too")


def fib_solution_backend(ns: argparse.Namespace, device: torch.device) -> FibSolutionBackend:
    """The backend of ``--fib-solution``, built, able to run on ``device``; else a UsageError."""
    backend = fib_backend(ns.fib_solution, ns.fib_definition, ns.fib_dataset)
    reason = backend.unavailable_reason(device)
    if reason is not None:
        raise UsageError(f"{backend.name} cannot run on {device}: {reason}")
    build(backend)
    return backend


def hand_back(backend: Any, failure: CaseResult, fixtures_dir: Path, device: torch.device) -> list[str]:
    """The lines that follow a flashinfer-bench solution's FAIL block: the workload its minimal case became
    and what flashinfer-bench's evaluator says of it (none for another backend)."""
    if not isinstance(backend, FibSolutionBackend):
        return []
    problem = failure.problem if failure.problem is not None else kind_named(backend.kind).build(failure.spec, device)
    root = fixtures_dir / DATASET_DIR
    try:
        exported = export_workload(root, backend.fib.definition_path, failure.id, backend.definition_inputs(problem))
    except OSError as exc:
        return [f"  flashinfer-bench workload: not written ({exc.strerror}: {exc.filename})"]
    lines = [f"  flashinfer-bench workload: {exported.describe()}"]
    if failure.crash or failure.hung:  # run again here, it would take this process down or hang it
        return lines + ["  flashinfer-bench's evaluator on it: not run here (the solution "
                        + ("crashed" if failure.crash else "did not return") + " on this case)"]
    verdict = evaluator_verdict(backend, exported, device)
    beyond = "" if verdict.flagged else " -- what mla-verify found is outside what it checks"
    return lines + [f"  flashinfer-bench's evaluator on it: {verdict.line()}{beyond}"]


def evaluator_verdict(backend: FibSolutionBackend, exported: ExportedWorkload, device: torch.device
                      ) -> FibJudgement:
    """flashinfer-bench's verdict on the exported workload, loaded back from its dataset as its evaluator
    loads it (3 trials, its tolerances)."""
    _, args = load_workload_inputs(exported.root, exported.definition, exported.uuid, str(device))
    return fib_judgement(*run_as_evaluator(backend, args))
