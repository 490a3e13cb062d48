"""A failing case as a user reads it: its FAIL block and its reproducer fixture. ``mla-verify check`` prints
them; the pytest helpers (pytest_helpers.py) put them in the failing test's message."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .harness import CaseResult


def save_reproducer(directory: Path, case: "CaseResult") -> Path | None:
    """The minimal failing case as a fixture: its problem, the kernel's output, and how to re-run it. None
    (said on stderr) when it cannot be written: the discrepancy still stands, only its reproducer is lost."""
    from .fixtures import save_fixture

    meta = {"kind": "regression", "backend": case.backend, "spec": case.spec.to_json(),
            "layout": case.layout.to_json(), "metamorphic": case.metamorphic, "verdict": case.verdict,
            "reason": case.reason, "failures": case.failures, "diagnosis": case.diagnosis,
            "stats": None if case.stats is None else case.stats.to_json(), "description": case.describe()}
    extra = {}
    if case.out is not None:
        extra["kernel_out"] = case.out
    if case.lse is not None:
        extra["kernel_lse"] = case.lse
    try:
        return save_fixture(directory, case.id, case.problem, meta, extra)
    except OSError as e:
        print(f"mla-verify: could not write the reproducer in {directory}: {e.strerror}", file=sys.stderr)
        return None


def failure_lines(case: "CaseResult", fixture: str | None) -> list[str]:
    """The FAIL block: the first failure, the case, every failure, the diagnosis, the reproducer."""
    lines = [f"FAIL {case.backend}: {case.reason}", f"  minimal case: {case.spec.describe()}",
             f"  layout: {case.layout.describe()}" + (f"; metamorphic check: {case.metamorphic}"
                                                      if case.metamorphic != "none" else "")]
    lines += [f"  - {f}" for f in case.failures]
    lines += [f"  diagnosis: {d}" for d in case.diagnosis]  # none: the kernel left no output to diagnose
    if fixture:
        lines += [f"  reproducer: {fixture}", f"  re-run: mla-verify replay {fixture}"]
    return lines
