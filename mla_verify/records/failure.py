"""A failing case as a user reads it: its FAIL block and its reproducer fixture. ``mla-verify check`` prints
them; the pytest helpers (pytest_helpers.py) put them in the failing test's message. Also the record of the
case in flight, written before its kernel is called, so that a crash of the whole process leaves one."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..kinds import kind_of
from ..problems.envelope import DENSE
from ..problems.layouts import LayoutSpec

if TYPE_CHECKING:
    from ..run.harness import CaseResult

DEFAULT_FIXTURES_DIR = Path("fixtures") / "regressions"  # under the current directory
IN_FLIGHT_REASON = "the process died while this case ran (a crash of the kernel, or the process was killed)"


def in_flight_path(directory: Path) -> Path:
    """Where this process records the case in flight: one file per process (runs may share a directory), named
    by its xdist worker (which xdist names when it crashes), else by its pid."""
    return directory / f"in-flight-{os.environ.get('PYTEST_XDIST_WORKER') or os.getpid()}.json"


def in_flight_note(path: Path) -> str:
    """The line that says, as an in-process run starts, where its case in flight is kept."""
    return (f"in-process: the case in flight is kept in {path} while it runs (if this run dies, "
            f"`mla-verify replay {path}` re-runs it)")


def record_in_flight(directory: Path, backend: str, spec: Any, layout: LayoutSpec, transform: str,
                     device: torch.device, source: dict[str, str] | None = None) -> Path:
    """Write the case about to run as a reproducer (in_flight_path), before its kernel is called: if the kernel
    takes the process down, the file remains, and ``mla-verify replay`` re-runs the case isolated."""
    from .fixtures import write_case_record

    meta = {"kind": "in-flight", "backend": backend, "layout": layout.to_json(), "metamorphic": transform,
            "verdict": "fail", "reason": IN_FLIGHT_REASON, "crash": "the process died",
            **({"kernel_source": source} if source is not None else {})}
    return write_case_record(directory, in_flight_path(directory).stem, spec, device, meta, durable=False)


def save_reproducer(directory: Path, case: CaseResult, max_mib: int | None = None,
                    source: dict[str, str] | None = None, device: torch.device | str = "cpu") -> Path | None:
    """The minimal failing case as a fixture of at most ``max_mib`` MiB (default
    fixtures.DEFAULT_MAX_REPRODUCER_MIB; fixtures.write_reproducer: its spec, layout and verdict, the kernel's
    output summarised, tensors only where the spec cannot rebuild them) and, for a user kernel, ``source``:
    where it was loaded from (Backend.source), so that replay finds it from any directory. None (said on
    stderr) when it cannot be written: the discrepancy still stands, only its reproducer is lost. A crash, and a
    case of another kind than dense, is recorded by its spec alone (fixtures.write_case_record), as run on
    ``device`` -- but a crash that kept its problem (a user's case whose tensors no spec rebuilds) with them."""
    from .fixtures import DEFAULT_MAX_REPRODUCER_MIB, tensor_summary, write_case_record, write_reproducer

    meta = {"kind": "regression", "backend": case.backend, "spec": case.spec.to_json(),
            "layout": case.layout.to_json(), "metamorphic": case.metamorphic, "verdict": case.verdict,
            "reason": case.reason, "failures": case.failures, "diagnosis": case.diagnosis,
            "stats": None if case.stats is None else case.stats.to_json(), "description": case.describe()}
    if source is not None:
        meta["kernel_source"] = source
    cap = DEFAULT_MAX_REPRODUCER_MIB if max_mib is None else max_mib
    try:
        if case.crash:
            meta["crash"] = case.crash
        if case.crash and case.problem is None:  # the device it was on may be unusable; its spec rebuilds it
            return write_case_record(directory, case.id, case.spec, torch.device(device), meta)
        if kind_of(case.spec).name != DENSE:  # its spec rebuilds it; the kernel's output is summarised
            meta["kernel_output"] = {k: None if t is None else tensor_summary(t)
                                     for k, t in (("out", case.out), ("lse", case.lse))}
            return write_case_record(directory, case.id, case.spec, torch.device(device), meta)
        assert case.problem is not None  # a failure keeps its problem (harness.py)
        saved = write_reproducer(directory, case.id, case.problem, case.spec, meta, case.out, case.lse, cap << 20)
    except OSError as e:
        print(f"mla-verify: could not write the reproducer in {directory}: {e.strerror}", file=sys.stderr)
        return None
    if saved.path is None:
        print(f"mla-verify: no reproducer for {case.backend}: {saved.reason}", file=sys.stderr)
    return saved.path


def crash_line(now: str, recorded: str | None) -> str:
    """How a replay's crash (``now``, "" for none) compares with the recorded one."""
    if not now:
        return f"did not crash (recorded: {recorded})"
    if now == recorded:
        return f"crashed again (same signal/error): {now}"
    return f"crashed again: {now}" + (f" (recorded: {recorded})" if recorded else " (recorded: no crash)")


def failure_lines(case: CaseResult, fixture: str | None, directory: Path | None = None,
                  origin: str | None = None) -> list[str]:
    """The FAIL block: the first failure, the user's case file it came from (``origin``, if it did), the case,
    every failure, the diagnosis (and the first failing case's, when it tells more), the reproducer (its size)
    and, when a reproducer was to be written into ``directory``, the folder reproducers go to."""
    from .fixtures import fixture_paths

    lines = [f"FAIL {case.backend}: {case.reason}"]
    if origin is not None:
        lines.append(f"  from your case {origin} (judged before any drawn case)")
    lines += [f"  minimal case: {case.spec.describe()}",
              f"  layout: {case.kind.describe_layout(case.layout)}" + (f"; metamorphic check: {case.metamorphic}"
                                                      if case.metamorphic != "none" else "")]
    lines += [f"  - {f}" for f in case.failures]
    lines += [f"  diagnosis: {d}" for d in case.diagnosis]  # none: the kernel left no output to diagnose
    if case.first_failing is not None and case.first_failing[2]:
        lines.append(f"  first failing case (it tells more): {case.first_failing[0]}")
        lines += [f"    diagnosis: {d}" for d in case.first_failing[1]]
    if fixture:
        size = sum(p.stat().st_size for p in fixture_paths(fixture) if p.exists())
        lines += [f"  reproducer: {fixture} ({size / 2**20:.2f} MiB)", f"  re-run: mla-verify replay {fixture}"]
        if case.crash:  # docs/judging.md, "A crash"
            lines.append(f"  where it faults: `mla-verify replay {fixture} --no-isolate` under compute-sanitizer "
                         "(GPU) or gdb (CPU), docs/judging.md")
    elif directory is not None:
        lines.append("  reproducer: none written")
    if directory is not None:
        where = " (the default, under the current directory; --fixtures-dir DIR moves them)" \
            if directory == DEFAULT_FIXTURES_DIR else ""
        lines.append(f"  reproducers go to {directory}{where}")
    return lines
