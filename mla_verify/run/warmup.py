"""The warm-up phase: every compiled module a run's backends can load, built and loaded before the first case.

Each backend declares its modules (``Backend.warmup``; none for a kernel handed over compiled). Modules
shared by backends are made once. Builds are grouped by builder -- one call per library with all of its
pending modules, which spreads them over the host's cores -- and the groups run side by side; then each
module is loaded into this process, timed on its own. The phase's time is reported apart from the cases'
(``check``'s summary and report, the pytest summary), so a compile is never read as a slow or hung kernel.
A warm-up that fails is a line, not a traceback: the cases then meet the same failure and judge it.

Building happens once on disk; loading is per process. So the steps are taken where they count: in-process,
this process does both; with cases isolated (isolate.py), this process only builds (``load=False``) and each
case worker, as it starts (again after a crash), loads its backend's modules (``build=False``) before its
first case, through this same function.
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

import torch

from ..backends.base import Backend, WarmupModule
from ..core.tracebacks import exception_line

HEARTBEAT_S = 30.0  # a build of minutes says it is alive this often


@dataclass
class WarmupResult:
    backends: list[str] = field(default_factory=list)  # those that declared modules
    modules: int = 0
    build_seconds: float | None = None  # None: not built here (a case worker's warm-up)
    load_seconds: dict[str, float] | None = None  # module name -> seconds to load it; None: not loaded here
    failures: list[str] = field(default_factory=list)  # one line each
    seconds: float = 0.0
    starts: int = 1  # a case worker's warm-ups added up (``then``): one per worker started

    def describe(self) -> str:
        if not self.modules and not self.failures:
            return "nothing to build"
        steps = [] if self.build_seconds is None else [f"build {self.build_seconds:.1f} s"]
        steps.append("each case worker loads them" if self.load_seconds is None
                     else f"load {sum(self.load_seconds.values()):.1f} s")
        text = f"{self.modules} module(s) for {', '.join(self.backends)} in {self.seconds:.1f} s ({', '.join(steps)})"
        text += f", over {self.starts} worker starts" if self.starts > 1 else ""
        return text + (f"; {len(self.failures)} failed" if self.failures else "")

    def then(self, later: WarmupResult) -> WarmupResult:
        """This warm-up and a later one of the same modules (a case worker's after a restart), added up."""
        loads = None if self.load_seconds is None or later.load_seconds is None else {
            name: self.load_seconds.get(name, 0.0) + later.load_seconds.get(name, 0.0)
            for name in {**self.load_seconds, **later.load_seconds}}
        return replace(self, load_seconds=loads, seconds=self.seconds + later.seconds,
                       failures=list(dict.fromkeys(self.failures + later.failures)), starts=self.starts + later.starts)

    def run_fields(self) -> dict[str, Any]:
        """The report's ``run`` entries (records/run_table.py labels them); none when nothing was declared."""
        if not self.modules and not self.failures:
            return {}
        return {"warmup": self.describe(), "warmup_s": round(self.seconds, 2),
                "warmup_failures": self.failures or None}


def warm_up(backends: Sequence[Backend], device: torch.device, stream: TextIO | None = None, build: bool = True,
            load: bool = True) -> WarmupResult:
    """Build, then load, every module ``backends`` declare for ``device``; progress lines go to ``stream``.
    ``build=False``: built already (a case worker's warm-up; a library's loader builds what is missing, as the
    cases' first call would); ``load=False``: each case worker loads them (cases isolated)."""
    stream = stream or sys.stderr
    started = time.monotonic()
    result = WarmupResult()
    modules: dict[str, WarmupModule] = {}
    for backend in backends:
        try:
            declared = backend.warmup(device)
        except Exception as exc:  # e.g. the library's module generator failed: the cases will say it too
            result.failures.append(f"{backend.name}: declaring its modules raised {exception_line(exc)}")
            continue
        if declared:
            result.backends.append(backend.name)
        modules.update((m.name, m) for m in declared)
    result.modules = len(modules)
    failed: set[str] = set()
    if modules and build:
        _say(stream, f"warm-up: building {len(modules)} module(s) for {', '.join(result.backends)}")
        failed = _build(list(modules.values()), result, stream)
    if modules and load:
        loads: dict[str, float] = {}
        for name, module in modules.items():
            if name in failed:
                continue
            began = time.perf_counter()
            try:
                module.load()
            except Exception as exc:
                result.failures.append(f"{name}: loading raised {exception_line(exc)}")
                continue
            loads[name] = time.perf_counter() - began
        result.load_seconds = loads
    result.seconds = time.monotonic() - started
    return result


def _build(modules: list[WarmupModule], result: WarmupResult, stream: TextIO) -> set[str]:
    """Every builder's modules in one call, the builders side by side; the names of modules not built."""
    groups: dict[Callable[..., None], list[WarmupModule]] = {}
    for m in modules:
        groups.setdefault(m.build, []).append(m)
    began = time.perf_counter()
    done = threading.Event()
    beat = threading.Thread(target=_heartbeat, args=(done, began, stream), daemon=True)
    beat.start()
    failed: set[str] = set()
    with ThreadPoolExecutor(max_workers=len(groups)) as pool:
        futures = {pool.submit(build, [m.spec for m in group]): group for build, group in groups.items()}
        for future, group in futures.items():
            exc = future.exception()
            if exc is not None:
                failed.update(m.name for m in group)
                result.failures.append(f"building {', '.join(m.name for m in group)} raised {exception_line(exc)}")
    done.set()
    beat.join()
    result.build_seconds = time.perf_counter() - began
    return failed


def _heartbeat(done: threading.Event, began: float, stream: TextIO) -> None:
    while not done.wait(HEARTBEAT_S):
        _say(stream, f"warm-up: still building after {time.perf_counter() - began:.0f} s")


def _say(stream: TextIO, text: str) -> None:
    stream.write(text + "\n")
    stream.flush()
