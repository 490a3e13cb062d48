"""A failing case as a user reads it: its FAIL block and its reproducer fixture. ``mla-verify check`` prints
them; the pytest helpers (pytest_helpers.py) put them in the failing test's message."""
from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..run.harness import CaseResult

DEFAULT_FIXTURES_DIR = Path("fixtures") / "regressions"  # under the current directory


def save_reproducer(directory: Path, case: CaseResult, max_mib: int | None = None,
                    source: dict[str, str] | None = None) -> Path | None:
    """The minimal failing case as a fixture of at most ``max_mib`` MiB (default
    fixtures.DEFAULT_MAX_REPRODUCER_MIB; fixtures.write_reproducer: its spec, layout and verdict, the kernel's
    output summarised, tensors only where the spec cannot rebuild them) and, for a user kernel, ``source``:
    where it was loaded from (Backend.source), so that replay finds it from any directory. None (said on
    stderr) when it cannot be written: the discrepancy still stands, only its reproducer is lost."""
    from .fixtures import DEFAULT_MAX_REPRODUCER_MIB, write_reproducer

    meta = {"kind": "regression", "backend": case.backend, "spec": case.spec.to_json(),
            "layout": case.layout.to_json(), "metamorphic": case.metamorphic, "verdict": case.verdict,
            "reason": case.reason, "failures": case.failures, "diagnosis": case.diagnosis,
            "stats": None if case.stats is None else case.stats.to_json(), "description": case.describe()}
    if source is not None:
        meta["kernel_source"] = source
    assert case.problem is not None  # a failure keeps its problem (harness.py)
    cap = DEFAULT_MAX_REPRODUCER_MIB if max_mib is None else max_mib
    try:
        saved = write_reproducer(directory, case.id, case.problem, case.spec, meta, case.out, case.lse, cap << 20)
    except OSError as e:
        print(f"mla-verify: could not write the reproducer in {directory}: {e.strerror}", file=sys.stderr)
        return None
    if saved.path is None:
        print(f"mla-verify: no reproducer for {case.backend}: {saved.reason}", file=sys.stderr)
    return saved.path


def failure_lines(case: CaseResult, fixture: str | None, directory: Path | None = None) -> list[str]:
    """The FAIL block: the first failure, the case, every failure, the diagnosis, the reproducer (its size) and,
    when a reproducer was to be written into ``directory``, the folder reproducers go to."""
    from .fixtures import fixture_paths

    lines = [f"FAIL {case.backend}: {case.reason}", f"  minimal case: {case.spec.describe()}",
             f"  layout: {case.layout.describe()}" + (f"; metamorphic check: {case.metamorphic}"
                                                      if case.metamorphic != "none" else "")]
    lines += [f"  - {f}" for f in case.failures]
    lines += [f"  diagnosis: {d}" for d in case.diagnosis]  # none: the kernel left no output to diagnose
    if fixture:
        size = sum(p.stat().st_size for p in fixture_paths(fixture) if p.exists())
        lines += [f"  reproducer: {fixture} ({size / 2**20:.2f} MiB)", f"  re-run: mla-verify replay {fixture}"]
    elif directory is not None:
        lines.append("  reproducer: none written")
    if directory is not None:
        where = " (the default, under the current directory; --fixtures-dir DIR moves them)" \
            if directory == DEFAULT_FIXTURES_DIR else ""
        lines.append(f"  reproducers go to {directory}{where}")
    return lines
