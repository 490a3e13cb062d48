"""The search under a supervisor: run in a copy of this process at in-process speed, and picked up isolated
where it stopped if the copy dies -- libFuzzer's fork mode. A kernel that kills its process (a signal, an exit,
a call stuck past the watchdog) or leaves its device unusable then ends the run with the verdict ``--isolate``
gives, without paying isolation on every case that does not crash.

``supervised`` forks this process (isolate.forkable: torch and the backend are loaded already, so the copy
starts in milliseconds, with no import) and runs the search there, in-process (engine.verify). The copy keeps a
journal in a scratch directory: each case as it starts -- the case in flight -- and its verdict as it ends, then
the search's result (the minimal failure's output beside it, as safetensors). This process reads the journal,
every POLL_S while there are progress callbacks to tell, else once the copy has ended, and returns the result.

When the copy dies instead, or its device is lost (a CUDA error: nothing more runs there), this process takes
over. It judges the case in flight again, isolated in a worker forked from this process (isolate.py): that
confirms the crash, in the words ``--isolate`` gives ("the kernel crashed: killed by SIGSEGV ... (in stage
'kernel')"). Then it runs the search again, every case isolated, knowing every verdict the copy reached. A
seeded search (premerge, dev, fuzz without an example database: profiles.py) draws the same cases given the
same verdicts, so it retraces the copy's cases at the cost of a lookup each, reaches the case that killed the
copy, and goes on exactly as ``--isolate`` would: the same cases, the crash shrunk like any failure, the same
minimal case. A search with an example database (fuzz with ``--hypothesis-db``) cannot be retraced: it draws
from what the database holds, which the copy changed, as well as from its seed. The choice sequence the
copy journaled for the crashing case goes into the example database, among the examples Hypothesis has not
shrunk yet, and the search replays it first and shrinks it as it shrinks any failure (engine.verify's
``found``; a case Hypothesis did not draw is the failure as it stands, made smaller as a failing corner case
is); the copy's cases head the list. Either way ``--minutes`` counts the copy's time too. The copy ends with
this process: Ctrl-C reaches it as SIGTERM, which ends its search with what it judged, and so does this
process's death.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ..backends.base import Backend
from ..core.errors import FixtureError, ProblemError, UsageError
from ..draw.profiles import Profile, get_profile, run_seed
from ..draw.strategies import Case
from ..kinds import kind_named
from ..problems.layouts import LayoutSpec
from . import watchdog
from .engine import DEFAULT_KERNEL_SECONDS, EngineResult, Found, drawn_choices, verify
from .harness import CaseResult
from .isolate import (
    EXIT_STUCK,
    Isolated,
    decoded,
    ended_by,
    forkable,
    fresh_copy,
    result_header,
    start_copy,
    with_problem,
)
from .warmup import WarmupResult

# how cases are judged: in this process with no supervisor (--no-isolate), in a supervised copy (the default
# where this process can fork), each in a worker process (--isolate; the default elsewhere: CUDA)
IN_PROCESS, SUPERVISED, ISOLATED = "in-process", "supervised", "isolated"
POLL_S = 0.1  # how often the progress callbacks hear of the copy's cases (a terminal's line is redrawn as often)
_JOURNAL, _FAILURE = "journal.jsonl", "failure.safetensors"
_PR_SET_PDEATHSIG = 1  # Linux's prctl option: a signal to this process when its parent dies
_RAISED_AS = {error.__name__: error for error in (UsageError, ProblemError, FixtureError)}


def how_to_run(isolate: bool | None, device: torch.device | str, otherwise: str = ISOLATED) -> str:
    """``isolate`` True (``--isolate``): ISOLATED; False (``--no-isolate``): IN_PROCESS, where a crash ends the
    run; None (the default): SUPERVISED where this process can fork a copy of itself (isolate.forkable: Linux,
    the CPU, one torch thread), else ``otherwise`` (check's: ISOLATED)."""
    if isolate is not None:
        return ISOLATED if isolate else IN_PROCESS
    return SUPERVISED if forkable(torch.device(device)) else otherwise


def search(backend: Backend, device: torch.device | str, profile: str | Profile, how: str,
           **options: Any) -> EngineResult:
    """engine.verify of ``backend``, its cases judged ``how`` (how_to_run); ``options`` are verify's."""
    if how == SUPERVISED:
        return supervised(backend, device, profile, **options)
    return verify(backend, device, profile, isolate=how == ISOLATED, **options)


def supervised(backend: Backend, device: torch.device | str, profile: str | Profile = "premerge",
               on_start: Callable[[Case], None] | None = None, on_case: Callable[[CaseResult], None] | None = None,
               **options: Any) -> EngineResult:
    """engine.verify of ``backend`` in a copy of this process, taken over isolated if the copy dies (the module's
    docstring); ``options`` are verify's, less ``isolate``. ``on_start``/``on_case`` are called here, for the
    copy's cases as its journal shows them, then for the cases judged here."""
    device = torch.device(device)
    if not forkable(device):
        raise UsageError(f"{backend.name}: a supervised search runs in a copy of this process, which needs Linux, "
                         "the CPU and one torch thread (isolate.forkable); --isolate judges each case in a worker")
    options.pop("judge", None)  # the copy judges in-process, this process by its own isolated worker
    if backend.unavailable_reason(device) is not None:  # nothing runs, nothing to supervise
        return verify(backend, device, profile, **options)
    prof = get_profile(profile) if isinstance(profile, str) else profile
    # the seed chosen here: a fresh one (fuzz) drawn in the copy would die with it, and no search taken over
    # here could retrace the copy's cases
    options["seed"] = run_seed(prof, options.get("seed"))
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mla-verify-search-") as scratch:
        # the user's cases that store their tensors (no spec rebuilds them): a failure's problem is theirs
        stored = {_key(g.spec, g.layout, g.transform): g.problem for g in options.get("given_cases", ())
                  if g.problem is not None}
        journal = _Journal(Path(scratch), backend, device, stored)
        copy = multiprocessing.get_context("fork").Process(
            target=_search_copy, name=f"mla-verify search ({backend.name})", daemon=True,
            args=(scratch, os.getpid(), backend, device, prof, options))
        start_copy(copy)
        interrupted = _follow(copy, journal, on_start, on_case)
        if journal.error is not None and journal.error[0] != "KeyboardInterrupt":
            raise _raised(*journal.error)
        lost = journal.result is not None and journal.result.failure is not None \
            and journal.result.failure.context_lost
        if journal.result is not None and not lost:
            return journal.result
        elapsed = time.monotonic() - started
        if interrupted or journal.error is not None:  # Ctrl-C: the cases judged until then
            return EngineResult(backend.name, prof.name, options["seed"], backend.kind,
                                cases=journal.cases, interrupted=True, seconds=elapsed)
        ended = ended_by(copy.exitcode, options.get("kernel_seconds", DEFAULT_KERNEL_SECONDS), "it")
        died = "left its device unusable" if lost else f"died ({ended})"
    return _taken_over(backend, device, prof, options, journal, died, elapsed, on_start, on_case)


def _follow(copy: Any, journal: _Journal, on_start: Callable[[Case], None] | None,
            on_case: Callable[[CaseResult], None] | None) -> bool:
    """Wait for the copy to end, reading its journal as it goes when there are callbacks to tell. Returns
    whether Ctrl-C came meanwhile: the copy, which ignores SIGINT, is then told once (SIGTERM: it ends its search
    as Ctrl-C ends one, with what it judged), and killed at a second Ctrl-C."""
    tell = on_start is not None or on_case is not None
    interrupts = 0
    while True:
        try:
            ended = bool(wait([copy.sentinel], POLL_S if tell else None))
            journal.read(on_start, on_case)
        except KeyboardInterrupt:
            interrupts += 1
            if interrupts == 1:
                os.kill(copy.pid, signal.SIGTERM)
            else:
                copy.kill()
            continue
        if ended:
            copy.join()
            return interrupts > 0


def _taken_over(backend: Backend, device: torch.device, prof: Profile, options: dict[str, Any], journal: _Journal,
                died: str, elapsed: float, on_start: Callable[[Case], None] | None,
                on_case: Callable[[CaseResult], None] | None) -> EngineResult:
    """The search that the copy left, isolated from where it stopped (the module's docstring)."""
    lost = journal.result.failure if journal.result is not None else None
    case = Case(lost.spec, lost.layout, lost.metamorphic) if lost is not None else journal.in_flight
    print(f"mla-verify: {backend.name}: the process running the search {died}" +
          (f" on {case.spec.describe()}" if case is not None else "") +
          "; the search goes on with every case isolated (docs/judging.md, \"A crash\")", file=sys.stderr, flush=True)
    judge = _Retrace(backend, device, options.get("kernel_seconds", DEFAULT_KERNEL_SECONDS),
                     {_key(r.spec, r.layout, r.metamorphic): r for r in journal.cases
                      if r.verdict != "fail"})  # a failure is judged again: its output is not kept
    confirmed = None
    # not known: it never ended, or ended as a failure. (A user's case that stores its tensors is not judged
    # here: the search below judges it first, in a copy that holds them.)
    if case is not None and _key(case.spec, case.layout, case.transform) not in journal.stored:
        confirmed = judge(case.spec, case.layout, case.transform, False)
        if confirmed.crash:  # a crash has no diagnosis to make: the same verdict whoever asks
            judge.known[_key(case.spec, case.layout, case.transform)] = confirmed
    minutes = options.pop("minutes", None) or prof.minutes
    left = None if minutes is None else max(minutes - elapsed / 60, 0.0)
    retrace = _seeded(prof, options) and left != 0.0
    found = None
    if not retrace and confirmed is not None and confirmed.verdict == "fail":  # drawn again first if time is left
        found = Found(confirmed, journal.choices if left != 0.0 else None)
    result = verify(backend, device, prof, on_start=on_start, on_case=on_case, judge=judge, found=found,
                    minutes=left, **options)
    if not retrace:
        result.cases[:0] = journal.cases
    result.seconds += elapsed
    return result


def _seeded(prof: Profile, options: dict[str, Any]) -> bool:
    """Whether the search draws from its seed alone, with no example database (engine._search): the same cases
    given the same verdicts."""
    return prof.deterministic or options.get("database") is None


class _Retrace(Isolated):
    """An isolated judge, in copies of this process, that knows verdicts reached before (``known``, by _key): a
    case it knows is not judged again, and the same verdict comes back (a copy: the engine writes on a result)."""

    def __init__(self, backend: Backend, device: torch.device, kernel_seconds: float | None,
                 known: dict[str, CaseResult]) -> None:
        super().__init__(backend, device, kernel_seconds, fork=True)
        self.known = known

    def __call__(self, spec: Any, layout: LayoutSpec, transform: str, diagnose: bool) -> CaseResult:
        r = self.known.get(_key(spec, layout, transform))
        if r is None:
            return super().__call__(spec, layout, transform, diagnose)
        return dataclasses.replace(r, failures=list(r.failures), diagnosis=list(r.diagnosis), stages=dict(r.stages))


def _key(spec: Any, layout: LayoutSpec, transform: str) -> str:
    return json.dumps(_case_json(spec, layout, transform), sort_keys=True)


def _case_json(spec: Any, layout: LayoutSpec, transform: str) -> list[Any]:
    return [spec.to_json(), layout.to_json(), transform]


# ---------------------------------------------------------------- the copy
def _search_copy(scratch: str, parent: int, backend: Backend, device: torch.device, profile: str | Profile,
                 options: dict[str, Any]) -> None:
    """The copy: the search in-process, each case journaled as it starts and as it ends, then its result (or the
    exception it raised, which the parent raises)."""
    fresh_copy()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's, which then tells this process
    signal.signal(signal.SIGTERM, _interrupt)
    # and so is a parent that dies (killed): a copy never searches on, orphaned (forkable: Linux has prctl)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before that
        return
    watchdog.set_stuck_exit(EXIT_STUCK, "the search process (the run goes on isolated)")
    tempfile.tempdir = scratch  # Hypothesis's scratch directory goes with the journal: removed even if this dies
    fd = os.open(Path(scratch) / _JOURNAL, os.O_WRONLY | os.O_APPEND)

    def write(entry: dict[str, Any]) -> None:
        os.write(fd, json.dumps(entry).encode() + b"\n")  # one write a line: a death leaves whole lines

    # a search with a database cannot be retraced: Hypothesis is to draw the case in flight again from its choices
    seeded = _seeded(get_profile(profile) if isinstance(profile, str) else profile, options)
    try:
        result = verify(backend, device, profile, **options,
                        on_start=lambda case: write({"start": _case_json(case.spec, case.layout, case.transform),
                                                     "choices": None if seeded else _hex(drawn_choices())}),
                        on_case=lambda r: write({"done": _case_json(r.spec, r.layout, r.metamorphic),
                                                 "verdict": result_header(r)}))
        failure = result.failure
        if failure is not None and failure.out is not None:
            save_file({k: t.detach().cpu().contiguous() for k, t in (("out", failure.out), ("lse", failure.lse))
                       if t is not None}, str(Path(scratch) / _FAILURE))
        write({"end": {f.name: getattr(result, f.name) for f in dataclasses.fields(result)
                       if f.name not in ("cases", "failure", "warmup")},
               "warmup": None if result.warmup is None else dataclasses.asdict(result.warmup),
               "failure": None if failure is None else {
                   "case": _case_json(failure.spec, failure.layout, failure.metamorphic),
                   "verdict": result_header(failure), "first_failing": failure.first_failing}})
    except BaseException as exc:  # noqa: BLE001 - raised in the parent, as it would have been there
        write({"error": [type(exc).__name__, str(exc), traceback.format_exc()]})


def _hex(choices: bytes | None) -> str | None:
    return None if choices is None else choices.hex()


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _raised(name: str, message: str, trace: str) -> Exception:
    """The copy's exception as this process raises it: the suite's one-line errors as they are, else an internal
    error that names it and keeps the copy's traceback."""
    if name in _RAISED_AS:
        return _RAISED_AS[name](message)
    return RuntimeError(f"in the search process: {name}: {message}\n{trace}")


# ---------------------------------------------------------------- the journal, read here
class _Journal:
    """The copy's journal as read so far: its cases' verdicts, the case in flight, its result or its error."""

    def __init__(self, scratch: Path, backend: Backend, device: torch.device, stored: dict[str, Any]) -> None:
        self.scratch, self.backend, self.device = scratch, backend, device
        self.stored = stored  # by _key: the problems of the user's cases that store their tensors
        self.kind = kind_named(backend.kind)
        (scratch / _JOURNAL).touch()
        self.cases: list[CaseResult] = []
        self.in_flight: Case | None = None  # started, with no verdict yet
        self.choices: bytes | None = None  # Hypothesis's choice sequence of the case started last, if recorded
        self.result: EngineResult | None = None
        self.error: list[str] | None = None  # [type name, message, traceback]
        self._read = 0
        self._partial = b""

    def read(self, on_start: Callable[[Case], None] | None, on_case: Callable[[CaseResult], None] | None) -> None:
        """Take the lines written since the last read, telling the callbacks of each case's start and end."""
        with open(self.scratch / _JOURNAL, "rb") as f:
            f.seek(self._read)
            data = f.read()
        self._read += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for line in lines:
            entry = json.loads(line)
            if "start" in entry:
                self.in_flight = Case(*self._case(entry["start"]))
                self.choices = None if entry["choices"] is None else bytes.fromhex(entry["choices"])
                if on_start is not None:
                    on_start(self.in_flight)
            elif "done" in entry:
                r = decoded(self.backend.name, *self._case(entry["done"]), entry["verdict"], {})
                self.cases.append(r)
                self.in_flight = None
                if on_case is not None:
                    on_case(r)
            elif "end" in entry:
                self.result = self._ended(entry)
            else:
                self.error = entry["error"]

    def _case(self, fields: list[Any]) -> tuple[Any, LayoutSpec, str]:
        spec, layout, transform = fields
        return self.kind.spec_from_json(spec), LayoutSpec(**layout), transform

    def _ended(self, entry: dict[str, Any]) -> EngineResult:
        failure = None
        if entry["failure"] is not None:
            tensors = load_file(str(self.scratch / _FAILURE)) if (self.scratch / _FAILURE).exists() else {}
            case = self._case(entry["failure"]["case"])
            failure = with_problem(decoded(self.backend.name, *case, entry["failure"]["verdict"], tensors),
                                   self.backend.kind, self.device, self.stored.get(_key(*case)))
            first = entry["failure"]["first_failing"]
            failure.first_failing = None if first is None else (first[0], first[1], first[2])
        warmup = entry["warmup"]
        return EngineResult(**entry["end"], cases=self.cases, failure=failure,
                            warmup=None if warmup is None else WarmupResult(**warmup))
