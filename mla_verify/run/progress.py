"""What a run shows while it runs, on stderr: counts, and a heartbeat while a case is in progress.

On a terminal one line is redrawn in place (after each case, and every second while a case runs, naming the
case and how long it has run). Elsewhere (CI logs) a line is printed every ``LOG_EVERY_S`` seconds, and one when
a case has run ``SLOW_CASE_S`` seconds, so a hung kernel is told apart from a slow run. A daemon thread draws
the heartbeat; the lock keeps its lines whole.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO

SLOW_CASE_S = 10.0
LOG_EVERY_S = 30.0


class Progress:
    """Counts of one backend's distinct cases, each by its first verdict, as the summary and the report count
    them (shrinking revisits cases); ``start``/``update`` are the engine's on_start/on_case hooks."""

    REDRAW_S = 0.1

    def __init__(self, name: str, minutes: float | None, total: int | None = None, stream: TextIO | None = None,
                 redraw: bool = True):
        """``redraw`` False: lines as in a log on a terminal too (backends judged side by side, run/side_by_side.py,
        have one each, and cannot share one redrawn line)."""
        self.stream = stream or sys.stderr
        self.live = redraw and self.stream.isatty()
        self.name, self.minutes, self.total = name, minutes, total
        self.counts = {"pass": 0, "fail": 0, "skip": 0}
        self.seen: set[str] = set()  # ids of the cases counted
        self.started = self.last = self.logged = time.monotonic()
        self.case: str | None = None  # the case running now
        self.case_started = 0.0
        self.slow_told = 0.0  # when the running case was last said to be slow
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="mla-verify-progress", daemon=True)

    def __enter__(self) -> Progress:
        self._beat.start()
        return self

    def start(self, case: Any) -> None:
        with self._lock:
            self.case, self.case_started, self.slow_told = case.spec.describe(), time.monotonic(), 0.0

    def update(self, result: Any) -> None:
        with self._lock:
            self.case = None
            if result.id not in self.seen:
                self.seen.add(result.id)
                self.counts[result.verdict] = self.counts.get(result.verdict, 0) + 1
            now = time.monotonic()
            if self.live and now - self.last >= self.REDRAW_S:
                self._draw(now)

    def line(self, now: float) -> str:
        """The counts line (and, while a case has run over a second, which one and for how long)."""
        c = self.counts
        done = sum(c.values())
        text = (f"{self.name}: {done}{f' of <= {self.total}' if self.total else ''} distinct cases, "
                f"{c['fail']} failing, "
                f"{c['skip']} skipped, {now - self.started:.0f} s")
        if self.minutes:
            frac = min(1.0, (now - self.started) / (60 * self.minutes))
            text += f" [{'#' * int(20 * frac):<20}] of {self.minutes:g} min"
        if self.case is not None and now - self.case_started >= 1.0:
            text += f"; case running {now - self.case_started:.0f} s: {self.case}"
        return text

    def _draw(self, now: float) -> None:
        self.last = now
        self.stream.write("\r" + self.line(now)[:200] + "\x1b[K")
        self.stream.flush()

    def _heartbeat(self) -> None:
        while not self._done.wait(1.0):
            with self._lock:
                now = time.monotonic()
                if self.live:
                    self._draw(now)
                    continue
                slow = self.case is not None and now - self.case_started >= SLOW_CASE_S
                if slow and now - max(self.slow_told, self.case_started) >= (LOG_EVERY_S if self.slow_told else
                                                                               SLOW_CASE_S):
                    self.slow_told = now
                    self._say(f"still running after {now - self.case_started:.0f} s: {self.case}")
                elif now - self.logged >= LOG_EVERY_S:
                    self._say(self.line(now))

    def _say(self, text: str) -> None:
        self.logged = time.monotonic()
        self.stream.write(f"{text if text.startswith(self.name) else f'{self.name}: {text}'}\n")
        self.stream.flush()

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._beat.join(timeout=2.0)
        if self.live:
            with self._lock:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
