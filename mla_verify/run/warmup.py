"""The warm-up phase: every compiled module a run's backends can load, built and loaded before the first case.

Each backend declares its modules (``Backend.warmup``; none for a kernel handed over compiled). Modules
shared by backends are made once. Builds are grouped by builder -- one call per library with all of its
pending modules, which shares the host's cores among them -- and the groups run side by side, in the
background (``start_warm_up``); each module is loaded into this process as soon as it is built, timed on its
own. The phase's time is reported apart from the cases' (``check``'s summary and report, the pytest summary),
so a compile is never read as a slow or hung kernel. A warm-up that fails is a line, not a traceback: the
cases then meet the same failure and judge it.

Building happens once on disk; loading is per process. So the steps are taken where they count: in-process,
this process does both; with cases isolated (isolate.py), this process only builds (``load=False``) and each
case worker, as it starts (again after a crash), loads its backend's modules (``build=False``) before its
first case, through this same function. The workers start while this process builds: a builder locks each
module before it returns, so a worker's load waits for that module's build (``wait_seconds``), and the first
backend's cases start as soon as its own modules are built.
"""
from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, as_completed
from concurrent.futures import wait as wait_futures
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
    wait_seconds: float = 0.0  # a case worker's: waiting for modules another process was building
    failures: list[str] = field(default_factory=list)  # one line each
    seconds: float = 0.0
    starts: int = 1  # a case worker's warm-ups added up (``then``): one per worker started

    def describe(self) -> str:
        if not self.modules and not self.failures:
            return "nothing to build"
        steps = [] if self.build_seconds is None else [f"build {self.build_seconds:.1f} s"]
        steps += [] if self.wait_seconds < 0.05 else [f"waited {self.wait_seconds:.1f} s for the build"]
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
        return replace(self, load_seconds=loads, wait_seconds=self.wait_seconds + later.wait_seconds,
                       seconds=self.seconds + later.seconds, starts=self.starts + later.starts,
                       failures=list(dict.fromkeys(self.failures + later.failures)))

    def run_fields(self) -> dict[str, Any]:
        """The report's ``run`` entries (records/run_table.py labels them); none when nothing was declared."""
        if not self.modules and not self.failures:
            return {}
        return {"warmup": self.describe(), "warmup_s": round(self.seconds, 2),
                "warmup_failures": self.failures or None}


def warm_up(backends: Sequence[Backend], device: torch.device, stream: TextIO | None = None, build: bool = True,
            load: bool = True) -> WarmupResult:
    """Build, then load, every module ``backends`` declare for ``device``; progress lines go to ``stream``.
    ``build=False``: built already, or being built by another process (a case worker's warm-up: it waits for
    each module's build, and a library's loader builds what is missing, as the cases' first call would);
    ``load=False``: each case worker loads them (cases isolated)."""
    return start_warm_up(backends, device, stream, build, load).wait()


def start_warm_up(backends: Sequence[Backend], device: torch.device, stream: TextIO | None = None,
                  build: bool = True, load: bool = True) -> Warming:
    """``warm_up`` under way: the modules declared and their builds started in the background (each locked
    against other processes' loads by the time this returns); ``Warming.wait`` loads them and says how it went."""
    warming = Warming(stream or sys.stderr, build, load)
    for backend in backends:
        try:
            declared = backend.warmup(device)
        except Exception as exc:  # e.g. the library's module generator failed: the cases will say it too
            warming.result.failures.append(f"{backend.name}: declaring its modules raised {exception_line(exc)}")
            continue
        if declared:
            warming.result.backends.append(backend.name)
        warming.modules.update((m.name, m) for m in declared)
    warming.result.modules = len(warming.modules)
    if warming.modules and build:
        _say(warming.stream, f"warm-up: building {len(warming.modules)} module(s) for "
                             f"{', '.join(warming.result.backends)}")
        warming.builds = _start_builds(list(warming.modules.values()))
        warming.beat.start()
    return warming


class Warming:
    """A warm-up under way: its builds run in the background until ``wait`` (``done``: they have ended)."""

    def __init__(self, stream: TextIO, build: bool, load: bool) -> None:
        self.stream, self.build, self.load = stream, build, load
        self.started = time.monotonic()
        self.result = WarmupResult()
        self.modules: dict[str, WarmupModule] = {}
        self.builds: dict[str, Future[None]] = {}  # module name -> its build
        self.built_at: float | None = None  # when the last build ended
        self.beat = threading.Thread(target=self._heartbeat, name="mla-verify warm-up heartbeat", daemon=True)

    def done(self) -> bool:
        return all(f.done() for f in self.builds.values())

    def wait(self) -> WarmupResult:
        """Each module loaded (``load``) as soon as its build ends; the builds' failures, one line each."""
        result = self.result
        arriving = (self._name(f) for f in as_completed(self.builds.values())) if self.builds else iter(self.modules)
        loads: dict[str, float] = {}
        load_failures = []
        for name in arriving:
            if not self.load or (name in self.builds and self.builds[name].exception() is not None):
                continue
            module = self.modules[name]
            try:
                if not self.build and module.ready is not None:  # another process builds it: not this load's time
                    began = time.perf_counter()
                    module.ready()
                    result.wait_seconds += time.perf_counter() - began
                began = time.perf_counter()
                module.load()
            except Exception as exc:
                load_failures.append(f"{name}: loading raised {exception_line(exc)}")
                continue
            loads[name] = time.perf_counter() - began
        self._add_build_failures()
        result.failures += load_failures
        if self.load and self.modules:
            result.load_seconds = loads
        if self.builds:
            self.beat.join()
            result.build_seconds = (self.built_at or self.started) - self.started
        ended = self.built_at if not self.load and self.built_at is not None else time.monotonic()
        result.seconds = ended - self.started
        return result

    def _name(self, future: Future[None]) -> str:
        return next(name for name, f in self.builds.items() if f is future)

    def _add_build_failures(self) -> None:
        """The failed builds' errors, one line per distinct error."""
        errors: dict[str, list[str]] = {}
        for name, future in self.builds.items():
            exc = future.exception()
            if exc is not None:
                errors.setdefault(exception_line(exc), []).append(name)
        self.result.failures += [f"building {', '.join(names)} raised {line}" for line, names in errors.items()]

    def _heartbeat(self) -> None:
        """A build of minutes says it is alive every HEARTBEAT_S; notes when the last one ended."""
        while wait_futures(self.builds.values(), HEARTBEAT_S).not_done:
            _say(self.stream, f"warm-up: still building after {time.monotonic() - self.started:.0f} s")
        self.built_at = time.monotonic()


def _start_builds(modules: list[WarmupModule]) -> dict[str, Future[None]]:
    """Every builder's modules handed to it in one call; module name -> its build. A builder that raises
    fails each of its modules with that error."""
    groups: dict[Callable[..., Sequence[Future[None]]], list[WarmupModule]] = {}
    for m in modules:
        groups.setdefault(m.build, []).append(m)
    builds: dict[str, Future[None]] = {}
    for build, group in groups.items():
        try:
            futures = list(build([m.spec for m in group]))
        except Exception as exc:  # noqa: BLE001 - each module's build failed with it
            futures = [Future() for _ in group]
            for f in futures:
                f.set_exception(exc)
        builds.update((m.name, f) for m, f in zip(group, futures))
    return builds


def _say(stream: TextIO, text: str) -> None:
    stream.write(text + "\n")
    stream.flush()
