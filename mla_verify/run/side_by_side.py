"""Backends judged side by side: each backend's search in a thread of this process, judging its cases in its own
isolated worker (isolate.py), so that a run with several backends ends near its slowest backend's time rather
than after the sum of theirs. The parent's share of a case is small (a draw, a message); the case is the
worker's.

Judged side by side, a backend is judged as it is alone:
- the same cases: each search has its own seed and its budget, sized (in the calling thread, before any starts)
  from the memory free then, as the first backend's is when they are judged in turn; Hypothesis runs searches in
  several threads (since 6.136), and the changes the engine makes to its process-wide state are shared
  (draw/profiles.py).
- no case runs out of device memory because another runs beside it: on a GPU each case holds its peak device
  memory (``ProblemKind.device_bytes``) in a ``DeviceLedger`` while it is judged, which lets the cases in flight
  hold no more than one case may take alone (core/memory.case_share); a case waits, in turn, until it fits
  beside them, and the largest run alone. A worker gives its cached blocks back after each case
  (core/memory.RELEASE_ABOVE), so that what a case held is free for the next. The estimate is the suite's
  memory, not the kernel's: a case that runs out of memory beside others (or finds too little spare memory for
  its relation, the large pool's) is judged again alone, and only then is its verdict the skip a run of that
  backend alone gives.
On a CPU at most as many searches run at once as this process has cores (each worker computes on one thread).

Ctrl-C reaches the calling thread only: it sets every search's stop, each ends after its case in flight, and
the run reports what was judged (engine.verify's ``stop``); a second Ctrl-C does not wait. A search that raises
(a worker that cannot start) stops the others, and the error is raised here once they have ended.
Import rule: torch, the engine's modules and core only; the command line's printing stays in cli/.
"""
from __future__ import annotations

import collections
import contextlib
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..core.memory import case_share
from ..draw.strategies import Case
from ..kinds import ProblemKind
from ..problems.layouts import LayoutSpec
from .engine import EngineResult
from .harness import SKIP_DEVICE, SKIP_MEMORY, CaseResult
from .isolate import CaseJudge
from .warmup import WarmupResult

POLL_S = 0.2  # how often the calling thread looks up from waiting (its ``idle`` callback, Ctrl-C)
Search = Callable[[threading.Event], EngineResult]  # one backend's search, given the run's stop


class DeviceLedger:
    """The device memory the cases in flight hold, at most ``capacity`` together; a case that does not fit beside
    those in flight waits for them, in the order cases came (no large case waits forever behind small ones), and
    one larger than ``capacity`` runs when nothing else does."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.held = 0.0
        self.in_flight = 0
        self._turns: collections.deque[object] = collections.deque()
        self._changed = threading.Condition()

    def alone(self) -> contextlib.AbstractContextManager[None]:
        """Held while no other case is in flight: more than the ledger holds waits for an empty one and fills it."""
        return self.holding(self.capacity + 1)

    @contextlib.contextmanager
    def holding(self, nbytes: float) -> Iterator[None]:
        turn = object()
        with self._changed:
            self._turns.append(turn)
            self._changed.wait_for(lambda: self._turns[0] is turn
                                   and (self.in_flight == 0 or self.held + nbytes <= self.capacity))
            self._turns.popleft()
            self.held += nbytes
            self.in_flight += 1
            self._changed.notify_all()  # the next in turn may fit too
        try:
            yield
        finally:
            with self._changed:
                self.held -= nbytes
                self.in_flight -= 1
                self._changed.notify_all()


class Ledgered:
    """A backend's judge whose cases hold their device memory in ``ledger`` while judged."""

    def __init__(self, judge: CaseJudge, kind: ProblemKind, ledger: DeviceLedger) -> None:
        self.judge, self.kind, self.ledger = judge, kind, ledger

    def __call__(self, spec: Any, layout: LayoutSpec, transform: str, diagnose: bool) -> CaseResult:
        with self.ledger.holding(self.kind.device_bytes(Case(spec, layout, transform))):
            result = self.judge(spec, layout, transform, diagnose)
        if result.skip_kind not in (SKIP_MEMORY, SKIP_DEVICE):
            return result
        # the estimate is the suite's memory, not the kernel's (a PyTorch kernel may take more): out of memory
        # beside other cases, or short of the spare memory a relation needs, it is judged again alone, as it
        # would be with the backends judged in turn
        with self.ledger.alone():
            return self.judge(spec, layout, transform, diagnose)

    def launch(self) -> None:
        self.judge.launch()

    def start(self) -> None:
        self.judge.start()

    @property
    def warmup(self) -> WarmupResult | None:
        return self.judge.warmup

    def close(self) -> None:
        self.judge.close()


def ledger_for(device: torch.device) -> DeviceLedger | None:
    """The ledger of a run's cases on ``device`` (None on a CPU: its cases are sized small, core/memory.py)."""
    return DeviceLedger(case_share(device)) if device.type == "cuda" else None


def lanes_for(device: torch.device, searches: int) -> int:
    """How many searches run at once: all of them on a GPU, at most one per core of this process on a CPU."""
    if device.type == "cuda":
        return searches
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(searches, cores))


def side_by_side(searches: Sequence[Search], lanes: int, on_done: Callable[[EngineResult], None],
                 idle: Callable[[], None] = lambda: None) -> list[EngineResult | None]:
    """Every search of ``searches`` in a thread, at most ``lanes`` at once; their results in the order given
    (None: a search Ctrl-C stopped before it started). ``on_done`` is called here with each result as its
    search ends, in the order they end; ``idle`` here every POLL_S while none ends."""
    stop = threading.Event()
    lane = threading.Semaphore(lanes)
    ended: queue.Queue[tuple[int, EngineResult | BaseException | None]] = queue.Queue()

    def run(index: int, search: Search) -> None:
        with lane:
            try:
                ended.put((index, None if stop.is_set() else search(stop)))
            except BaseException as exc:  # noqa: BLE001 - raised in the calling thread, below
                stop.set()
                ended.put((index, exc))

    with _ctrl_c_held():  # every search's thread started, or this thread would wait for one that never ends
        for index, search in enumerate(searches):
            threading.Thread(target=run, args=(index, search), name=f"mla-verify search {index}",
                             daemon=True).start()
    results: list[EngineResult | None] = [None] * len(searches)
    error: BaseException | None = None
    for _ in searches:
        index, outcome = _next(ended, stop, idle)
        if isinstance(outcome, BaseException):
            error = error or outcome
        elif outcome is not None:
            results[index] = outcome
            on_done(outcome)
    if error is not None:
        raise error
    return results


@contextlib.contextmanager
def _ctrl_c_held() -> Iterator[None]:
    """SIGINT held back from this thread until the block ends (and never delivered to the threads it starts,
    which inherit the mask: Python handles signals in its main thread)."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _next(ended: queue.Queue[Any], stop: threading.Event, idle: Callable[[], None]) -> Any:
    """The next search's end; the first Ctrl-C stops every search (and is told), a second one is raised."""
    while True:
        try:
            try:
                return ended.get(timeout=POLL_S)
            except queue.Empty:
                idle()
        except KeyboardInterrupt:
            if stop.is_set():
                raise
            stop.set()
            print("interrupted: every backend ends after its case in flight (Ctrl-C again not to wait)",
                  file=sys.stderr, flush=True)
