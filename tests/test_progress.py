"""The progress line: counts against the planned total, and the case running now and for how long."""
from __future__ import annotations

import io
from types import SimpleNamespace

from mla_verify.problems.generate import ProblemSpec
from mla_verify.run.progress import Progress


def test_the_line_counts_against_the_total_and_names_a_running_case():
    progress = Progress("fa3", minutes=None, total=70, stream=io.StringIO())
    progress.update(SimpleNamespace(id="a", verdict="pass"))
    progress.update(SimpleNamespace(id="b", verdict="skip"))
    case = SimpleNamespace(spec=ProblemSpec(seq_lens=(5, 9), num_heads=3))
    progress.start(case)
    now = progress.case_started + 4.2
    line = progress.line(now)
    assert line.startswith("fa3: 2 of <= 70 distinct cases, 0 failing, 1 skipped")
    assert "case running 4 s: B=2 H=3" in line
    progress.update(SimpleNamespace(id="c", verdict="fail"))  # the case ended: it is no longer named
    assert "case running" not in progress.line(now) and "1 failing" in progress.line(now)


def test_a_revisited_case_counts_once_as_the_verdict_counts_it():
    from mla_verify.records.report import count_verdicts, distinct_cases
    from mla_verify.run.engine import EngineResult

    # shrinking replays cases: the failing one three times, a passing one twice
    ran = [SimpleNamespace(id=i, verdict=v) for i, v in
           [("a", "pass"), ("b", "fail"), ("a", "pass"), ("b", "fail"), ("c", "skip"), ("b", "fail")]]
    progress = Progress("fa3", minutes=None, stream=io.StringIO())
    for case in ran:
        progress.update(case)
    verdict = count_verdicts(c.verdict for c in distinct_cases(EngineResult("fa3", "dev", 1, cases=ran)))
    assert progress.counts == verdict
    assert progress.line(progress.started).startswith(f"fa3: {sum(verdict.values())} distinct cases, 1 failing")


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_backends_side_by_side_tell_their_counts_as_in_a_log_on_a_terminal_too():
    # one redrawn line per backend would overwrite each other's: side by side each prints lines instead
    assert Progress("fa3", minutes=None, stream=_Terminal()).live
    assert not Progress("fa3", minutes=None, stream=_Terminal(), redraw=False).live
