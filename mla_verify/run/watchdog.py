"""A kernel that does not return is a bug, not a hung run: a time limit on one kernel call.

``time_limit(seconds, what)`` arms SIGALRM around the call; its handler raises ``KernelTimeout`` in the main
thread, which interrupts Python code and sleeps (a PyTorch kernel, a kernel stuck in a Python loop). A call
stuck in native code never returns to the interpreter, so a daemon thread waits a grace period more (15 s;
``GRACE_ENV``), then prints one line naming the case and ends the process with exit code 1 (the discrepancy
exit: a hung kernel fails the gate). Where SIGALRM cannot be used (not the main thread, no SIGALRM on the
platform) the call runs unguarded. An isolated worker (isolate.py) ends with its own exit code instead
(``set_stuck_exit``), which its parent reads as "hung past the watchdog". Import rule: the standard library
and ``errors`` only.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

from ..core.errors import UsageError

# after the limit: time for a native call to return before the process is ended (the environment variable
# shortens it for tests and lengthens it for slow machines)
GRACE_ENV = "MLA_VERIFY_WATCHDOG_GRACE_S"
EXIT_HUNG = 1
_stuck_exit, _stuck_ends = EXIT_HUNG, "the run"  # the exit code and what ends with a process the hard stop ends


class KernelTimeout(Exception):
    """The kernel call ran past its time limit."""


def can_interrupt() -> bool:
    return hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()


class _HardStop:
    """One daemon thread for the process: ends it when an armed call outlives its limit plus the grace."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._until: float | None = None  # monotonic time past which the process is ended
        self._what = ""
        self._limit = 0.0
        threading.Thread(target=self._watch, name="mla-verify-watchdog", daemon=True).start()

    def arm(self, seconds: float, what: str) -> None:
        with self._cond:
            self._until, self._what, self._limit = time.monotonic() + seconds + grace_seconds(), what, seconds
            self._cond.notify()

    def disarm(self) -> None:
        with self._cond:
            self._until = None

    def _watch(self) -> None:
        with self._cond:
            while True:
                if self._until is None:
                    self._cond.wait()
                elif time.monotonic() < self._until:
                    self._cond.wait(self._until - time.monotonic())
                else:
                    sys.stderr.write(f"\nmla-verify: FAIL: the kernel did not return within {self._limit:g} s "
                                     f"and could not be interrupted (stuck in native code) on {self._what}; "
                                     f"ending {_stuck_ends}\n")
                    sys.stderr.flush()
                    os._exit(_stuck_exit)


_hard_stop: _HardStop | None = None


def _forget_hard_stop() -> None:
    """In a copy of this process (a fork): its thread was not copied, so the copy starts its own."""
    global _hard_stop
    _hard_stop = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_hard_stop)


def set_stuck_exit(code: int, ends: str) -> None:
    """The exit code with which the hard stop ends this process (default EXIT_HUNG), and what it ends."""
    global _stuck_exit, _stuck_ends
    _stuck_exit, _stuck_ends = code, ends


def grace_seconds() -> float:
    """The grace period from ``GRACE_ENV`` (15 s unset); a value that is not a number >= 0 is a UsageError, so
    a run checks it before its first case rather than ignoring a typo."""
    raw = os.environ.get(GRACE_ENV, "15")
    try:
        grace = float(raw)
    except ValueError:
        grace = -1.0
    if not grace >= 0:  # also refuses nan
        raise UsageError(f"{GRACE_ENV}={raw!r}: expected a number of seconds >= 0")
    return grace


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str) -> Iterator[None]:
    """Raise KernelTimeout if the body runs longer than ``seconds`` (None: no limit); ``what`` names the case
    in the line printed if the body cannot be interrupted."""
    global _hard_stop
    if seconds is None or not can_interrupt():
        yield
        return

    def on_alarm(signum: int, frame: object) -> None:
        raise KernelTimeout(f"did not return within {seconds:g} s")

    if _hard_stop is None:
        _hard_stop = _HardStop()
    _hard_stop.arm(seconds, what)  # first: it reads the grace period, which may be malformed
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _hard_stop.disarm()
