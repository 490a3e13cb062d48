"""The progress line: counts against the planned total, and the case running now and for how long."""
from __future__ import annotations

import io
from types import SimpleNamespace

from mla_verify.problems.generate import ProblemSpec
from mla_verify.run.progress import Progress


def test_the_line_counts_against_the_total_and_names_a_running_case():
    progress = Progress("fa3", minutes=None, total=70, stream=io.StringIO())
    progress.update(SimpleNamespace(verdict="pass"))
    progress.update(SimpleNamespace(verdict="skip"))
    case = SimpleNamespace(spec=ProblemSpec(seq_lens=(5, 9), num_heads=3))
    progress.start(case)
    now = progress.case_started + 4.2
    line = progress.line(now)
    assert line.startswith("fa3: 2 of <= 70 cases, 0 failing, 1 skipped")
    assert "case running 4 s: B=2 H=3" in line
    progress.update(SimpleNamespace(verdict="fail"))  # the case ended: it is no longer named
    assert "case running" not in progress.line(now) and "1 failing" in progress.line(now)
