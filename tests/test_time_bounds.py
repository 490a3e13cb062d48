"""Runs end when they say they will: --minutes holds wherever Hypothesis spends its time, a kernel that does
not return fails its case (it does not hang the run), and Ctrl-C ends a run with a report of what was judged.

These run the real command in a subprocess: the time bound, the signal-based watchdog and the exit codes are
properties of the process, not of a function.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mla_verify.run.watchdog import GRACE_ENV

TESTS = Path(__file__).resolve().parent


def check(*argv: str, timeout: float, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
               **(env or {})}
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "mla_verify.cli", "check", "--device", "cpu", *argv],
                          capture_output=True, text=True, env=environ, timeout=timeout)
    return done, time.monotonic() - started


def test_fuzz_minutes_holds_against_a_slow_kernel(tmp_path):
    # `--minutes 0.5` against a correct kernel whose calls take 0.4 s (~1 s a case): the run, torch's import
    # and the reference self-check included, ends within the half minute plus 45 s (one case is ~1 s; the rest
    # is process start-up and the report, ~10 s on the 2-core CI machine). Half a minute, not one: the bound
    # is the same deadline plus the same slack, and fuzz left unbounded runs its 5-minute default (> timeout).
    done, took = check("--kernel", "slow_kernels:slow", "--profile", "fuzz", "--minutes", "0.5",
                       "--report", str(tmp_path / "r.json"), "--fixtures-dir", str(tmp_path), timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert took <= 30 + 45, f"--minutes 0.5 took {took:.0f} s"
    assert "(time limit reached)" in done.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["backends"][0]["cases"] > 10  # it did judge cases until the deadline
    assert "Traceback" not in done.stderr


def test_a_kernel_that_never_returns_fails_its_case_by_name(tmp_path):
    done, took = check("--kernel", "slow_kernels:hangs", "--profile", "premerge", "--case-timeout", "2",
                       "--fixtures-dir", str(tmp_path), timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "did not return within 2 s" in done.stdout
    assert "minimal case: B=" in done.stdout  # the hung case is named
    # one hung call (2 s) plus start-up, the corner cases before it and the report, ~15 s on 2 cores; a run
    # that hung once per shrinking attempt would take minutes
    assert took < 60
    assert "Traceback" not in done.stderr


def test_a_kernel_stuck_where_no_signal_reaches_ends_the_process(tmp_path):
    # in this process (--no-isolate); supervised or isolated, it ends the process judging it and the run goes
    # on (test_crash.py)
    done, took = check("--kernel", "slow_kernels:hangs_in_native_code", "--profile", "dev", "--case-timeout", "1",
                       "--no-isolate", "--fixtures-dir", str(tmp_path), env={"MLA_VERIFY_WATCHDOG_GRACE_S": "2"},
                       timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "did not return within 1 s and could not be interrupted" in done.stderr
    assert "B=" in done.stderr  # which case
    assert took < 60  # the 1 s limit plus the 2 s grace and start-up; without the hard stop it would hang


@pytest.mark.parametrize("profile", ["premerge", "fuzz"])
def test_ctrl_c_ends_with_a_report_of_what_was_judged_and_exit_130(tmp_path, profile):
    done, _ = check("--kernel", "slow_kernels:interrupted_after_calls", "--profile", profile, "--minutes", "1",
                    "--report", str(tmp_path / "r.json"), "--fixtures-dir", str(tmp_path),
                    env={"CALLS_BEFORE_CTRL_C": "7"}, timeout=180)
    assert done.returncode == 130, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert "interrupted" in done.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["run"]["interrupted"] is True
    judged = [c for c in report["cases"] if c["verdict"] != "skip"]
    assert judged and all(c["verdict"] == "pass" for c in judged)  # the cases before Ctrl-C, none blamed


def test_a_running_case_is_named_while_it_runs(tmp_path):
    # not a terminal (a CI log): a case still running after 10 s gets a line naming it, before its kernel is
    # failed as hung at 13 s -- a hung kernel is told apart from a slow run while it happens
    done, _ = check("--kernel", "slow_kernels:hangs", "--profile", "premerge", "--case-timeout", "13",
                    "--fixtures-dir", str(tmp_path), timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    beat = [line for line in done.stderr.splitlines() if "still running after" in line]
    assert beat and "B=" in beat[0] and beat[0].startswith("slow_kernels:hangs:"), done.stderr


@pytest.mark.parametrize("grace", ["soon", "-1", "nan"])
def test_a_malformed_watchdog_grace_is_a_usage_error_before_any_case(grace, tmp_path):
    done, _ = check("--kernel", "mla_verify.kernels.mutants:correct_kernel", "--fixtures-dir", str(tmp_path),
                    env={GRACE_ENV: grace}, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"mla-verify check: error: {GRACE_ENV}={grace!r}: expected a number of seconds >= 0"], done.stderr
    assert "reference self-check" not in done.stdout  # refused before any work
