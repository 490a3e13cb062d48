"""What shadow mode saw: per entry point and call site, calls seen, checked, compared, mismatched and with argument
errors or warnings, why calls went unchecked, and the overhead; the sampling that decides which calls are checked.
"""
from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 60.0  # the overhead budget is per minute


@dataclass
class SiteTally:
    calls: int = 0
    checked: int = 0  # arguments checked
    compared: int = 0  # numbers compared with the reference
    mismatched: int = 0
    errors: int = 0  # calls with an argument error
    warnings: int = 0  # calls with an argument warning
    not_checked: Counter[str] = field(default_factory=Counter)  # reason -> calls
    overhead_s: float = 0.0

    def merge(self, other: SiteTally) -> None:
        for name in ("calls", "checked", "compared", "mismatched", "errors", "warnings", "overhead_s"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.not_checked.update(other.not_checked)

    def to_json(self) -> dict[str, Any]:
        return {**{k: v for k, v in self.__dict__.items() if k != "not_checked"}, "not_checked": dict(self.not_checked)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SiteTally:
        return cls(**{**d, "not_checked": Counter(d.get("not_checked", {}))})

    def describe(self) -> str:
        parts = [f"{self.calls} calls", f"{self.checked} checked", f"{self.compared} compared with the reference",
                 f"{self.mismatched} mismatched", f"{self.errors} with argument errors",
                 f"{self.warnings} with argument warnings"]
        return ", ".join(parts) + f"; overhead {self.overhead_s:.3f} s"


class Tally:
    """SiteTally per (entry point, call site), in the order first seen, plus notes on what was not wrapped."""

    def __init__(self) -> None:
        self.sites: dict[tuple[str, str], SiteTally] = {}
        self.notes: list[str] = []
        self.reports: list[str] = []  # the first report of each call site that had one

    def site(self, entry: str, where: str) -> SiteTally:
        return self.sites.setdefault((entry, where), SiteTally())

    def total(self) -> SiteTally:
        total = SiteTally()
        for t in self.sites.values():
            total.merge(t)
        return total

    def merge(self, other: Tally) -> None:
        for key, t in other.sites.items():
            self.site(*key).merge(t)
        self.notes += [n for n in other.notes if n not in self.notes]
        self.reports += other.reports

    def to_json(self) -> dict[str, Any]:
        return {"sites": [[entry, where, t.to_json()] for (entry, where), t in self.sites.items()],
                "notes": list(self.notes), "reports": list(self.reports)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Tally:
        tally = cls()
        for entry, where, t in d.get("sites", []):
            tally.sites[(entry, where)] = SiteTally.from_json(t)
        tally.notes = list(d.get("notes", []))
        tally.reports = list(d.get("reports", []))
        return tally

    def summary_lines(self, settings: str) -> list[str]:
        total = self.total()
        lines = [f"mla-verify shadow ({settings}): {total.describe()}"]
        entries = list(dict.fromkeys(entry for entry, _ in self.sites))
        for entry in entries:
            lines.append(f"  {entry}")
            for (e, where), t in self.sites.items():
                if e != entry:
                    continue
                lines.append(f"    {where}: {t.describe()}")
                lines += [f"      not checked, {n} calls: {reason}" for reason, n in t.not_checked.most_common()]
        lines += [f"  {note}" for note in self.notes]
        return lines


class Sampler:
    """Checks the 1st, (N+1)th, (2N+1)th ... call at each site, while the checks' overhead over the last minute
    stays under the budget (a check may overshoot it once; the next waits until the window has room)."""

    def __init__(self, every: int = 1, budget_s_per_min: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.every = every
        self.budget = budget_s_per_min
        self.clock = clock
        self._spent: deque[tuple[float, float]] = deque()  # (when, seconds) of the last minute's checks

    def skip_reason(self, nth_call_at_site: int) -> str | None:
        if (nth_call_at_site - 1) % self.every:
            return f"sampling (1 call in {self.every} at each site is checked)"
        if self.budget is not None and self._spent_in_window() >= self.budget:
            return f"overhead budget ({self.budget:g} s per minute) spent"
        return None

    def charge(self, seconds: float) -> None:
        self._spent.append((self.clock(), seconds))

    def _spent_in_window(self) -> float:
        now = self.clock()
        while self._spent and self._spent[0][0] <= now - WINDOW_S:
            self._spent.popleft()
        return sum(s for _, s in self._spent)

    def describe(self) -> str:
        budget = "no overhead budget" if self.budget is None else f"at most {self.budget:g} s of overhead per minute"
        calls = "every call" if self.every == 1 else f"1 call in {self.every} at each site"
        return f"{calls} checked, {budget}"
