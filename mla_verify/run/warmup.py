"""The warm-up phase: every compiled module a run's backends can load, built and loaded before the first case.

Each backend declares its modules (``Backend.warmup``; none for a kernel handed over compiled). Modules
shared by backends are made once. Builds are grouped by builder -- one call per library with all of its
pending modules, which spreads them over the host's cores -- and the groups run side by side; then each
module is loaded into this process, timed on its own. The phase's time is reported apart from the cases'
(``check``'s summary and report, the pytest summary), so a compile is never read as a slow or hung kernel.
A warm-up that fails is a line, not a traceback: the cases then meet the same failure and judge it.
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from ..backends.base import Backend, WarmupModule
from ..core.tracebacks import exception_line

HEARTBEAT_S = 30.0  # a build of minutes says it is alive this often


@dataclass
class WarmupResult:
    backends: list[str] = field(default_factory=list)  # those that declared modules
    modules: int = 0
    build_seconds: float = 0.0
    load_seconds: dict[str, float] = field(default_factory=dict)  # module name -> seconds to load it
    failures: list[str] = field(default_factory=list)  # one line each
    seconds: float = 0.0

    def describe(self) -> str:
        if not self.modules and not self.failures:
            return "nothing to build"
        loaded = sum(self.load_seconds.values())
        text = (f"{self.modules} module(s) for {', '.join(self.backends)} in {self.seconds:.1f} s "
                f"(build {self.build_seconds:.1f} s, load {loaded:.1f} s)")
        return text + (f"; {len(self.failures)} failed" if self.failures else "")

    def run_fields(self) -> dict[str, Any]:
        """The report's ``run`` entries (records/run_table.py labels them); none when nothing was declared."""
        if not self.modules and not self.failures:
            return {}
        return {"warmup": self.describe(), "warmup_s": round(self.seconds, 2),
                "warmup_failures": self.failures or None}


def warm_up(backends: Sequence[Backend], device: torch.device, stream: TextIO | None = None) -> WarmupResult:
    """Build, then load, every module ``backends`` declare for ``device``; progress lines go to ``stream``."""
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
    if modules:
        _say(stream, f"warm-up: building {len(modules)} module(s) for {', '.join(result.backends)}")
        failed = _build(list(modules.values()), result, stream)
        for name, module in modules.items():
            if name in failed:
                continue
            began = time.perf_counter()
            try:
                module.load()
            except Exception as exc:
                result.failures.append(f"{name}: loading raised {exception_line(exc)}")
                continue
            result.load_seconds[name] = time.perf_counter() - began
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
