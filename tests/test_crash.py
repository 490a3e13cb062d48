"""A kernel that crashes gets a verdict: with no flag (the search supervised, run/supervise.py) or isolated, a
segfault, an abort, an exit or a native hang on some inputs fails its case as a crash, the search shrinks it to
the smallest crashing input -- with no flag, to the very cases and minimal case of an isolated run -- and its
reproducer crashes again on replay; in this process (--no-isolate), a CUDA error is a crash of the running case
(exit 1, never "internal error"), and a crash that takes the process leaves the case in flight behind.

Supervised and isolated runs are in this process (the crashes are its copies' and workers'); a crash of the
process itself, and pytest under xdist, run in a subprocess.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from crashing_kernels import CRASH_BATCH, CRASH_SEQ_LEN, EXIT_CODE

from mla_verify.cli.main import main
from mla_verify.core.memory import device_fault
from mla_verify.records.fixtures import load_fixture
from mla_verify.run.watchdog import GRACE_ENV

TESTS = Path(__file__).resolve().parent
# the subprocesses start in tmp_path (their reproducers go there): this checkout first, the test kernels beside it
PYTHONPATH = os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])


def check(capsys, kernel: str, tmp_path: Path, *argv: str, module: str = "crashing_kernels") -> tuple[int, str]:
    """``mla-verify check`` in this process: isolated, the kernel's crashes are its workers'."""
    code = main(["check", "--kernel", f"{module}:{kernel}", "--device", "cpu", "--profile", "premerge",
                 "--fixtures-dir", str(tmp_path / "fx"), *argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "internal error" not in err, err
    return code, out


def reproducer(out: str) -> Path:
    found = re.search(r"reproducer: (\S+\.json)", out)
    assert found, out
    return Path(found.group(1))


def replay(capsys, path: Path, *argv: str) -> tuple[int, str]:
    code = main(["replay", str(path), *argv])
    return code, capsys.readouterr().out


def cases_of(report: Path) -> list[dict]:
    """A report's cases, every field but their timings."""
    return [{k: v for k, v in c.items() if k not in ("seconds", "stages")}
            for c in json.loads(report.read_text())["cases"]]


def test_a_crash_without_an_isolation_flag_ends_as_an_isolated_run_does(capsys, tmp_path):
    # the default runs the search in a copy of this process: the segfault kills the copy, and the run goes on
    # isolated from that case, to the very cases, verdicts and minimal case that --isolate gives
    runs = {}
    for flag in ("--isolate", None):
        name = flag or "default"
        code, out = check(capsys, "segfaults_on_big_batches", tmp_path / name, *([flag] if flag else []),
                          "--report", str(tmp_path / f"{name}.json"))
        assert code == 1, out
        runs[name] = out
    assert cases_of(tmp_path / "default.json") == cases_of(tmp_path / "--isolate.json")
    out = runs["default"]
    assert "FAIL crashing_kernels:segfaults_on_big_batches: the kernel crashed: killed by SIGSEGV" in out
    assert "(in stage 'kernel')" in out
    fx = load_fixture(reproducer(out))
    assert fx.spec is not None and "SIGSEGV" in fx.meta["crash"]
    assert (list(fx.spec.seq_lens), fx.spec.num_heads, fx.spec.q_len) == ([1] * CRASH_BATCH, 1, 1)  # smallest
    code, out = replay(capsys, fx.json_path)
    assert code == 1, out
    assert "crashed again (same signal/error): killed by SIGSEGV" in out


@pytest.mark.parametrize("kernel, crash", [
    ("aborts_on_long_sequences", "killed by SIGABRT"),
    ("exits_on_long_sequences", f"its worker process exited with code {EXIT_CODE}"),
])
def test_a_crash_without_an_isolation_flag_is_shrunk_to_the_smallest_crashing_case_and_replays(
        capsys, tmp_path, kernel, crash):
    code, out = check(capsys, kernel, tmp_path)
    assert code == 1, out
    assert f"FAIL crashing_kernels:{kernel}: the kernel crashed: {crash}" in out and "(in stage 'kernel')" in out
    fx = load_fixture(reproducer(out))
    assert fx.spec is not None and crash in fx.meta["crash"]
    # the smallest crashing input: one sequence of CRASH_SEQ_LEN + 1 tokens, one head, one query token
    assert (list(fx.spec.seq_lens), fx.spec.num_heads, fx.spec.q_len) == ([CRASH_SEQ_LEN + 1], 1, 1)
    code, out = replay(capsys, fx.json_path)
    assert code == 1, out
    assert f"crashed again (same signal/error): {crash}" in out


def test_an_unseeded_search_gets_the_crash_back_through_its_example_database(capsys, tmp_path):
    # fuzzing with an example database draws from what it holds: the search cannot retrace the copy that died, so the
    # crash's choice sequence goes into the database, and the isolated search replays it first and shrinks it,
    # as far as --isolate's shrinking goes (supervise.py); simplify.py alone stops short of it
    code, out = check(capsys, "segfaults_on_big_batches", tmp_path, "--profile", "fuzz", "--minutes", "0.5",
                      "--hypothesis-db", str(tmp_path / "db"))
    assert code == 1, out
    assert "the kernel crashed: killed by SIGSEGV" in out
    fx = load_fixture(reproducer(out))
    assert fx.spec is not None
    assert (list(fx.spec.seq_lens), fx.spec.num_heads, fx.spec.q_len) == ([1] * CRASH_BATCH, 1, 1)


def test_a_kernel_stuck_in_native_code_is_a_crash_of_its_case_and_the_search_goes_on(capsys, tmp_path,
                                                                                       monkeypatch):
    # with no flag, the watchdog ends the search's copy of this process, and the search goes on isolated; each
    # stuck attempt costs the 0.3 s limit and the 0.2 s grace: the shrinking takes a few seconds
    monkeypatch.setenv(GRACE_ENV, "0.2")
    code, out = check(capsys, "hangs_in_native_code_on_big_batches", tmp_path, "--case-timeout", "0.3")
    assert code == 1, out
    assert "did not return within 0.3 s and could not be interrupted (stuck in native code)" in out
    fx = load_fixture(reproducer(out))
    assert fx.spec is not None and list(fx.spec.seq_lens) == [1] * CRASH_BATCH
    code, out = replay(capsys, fx.json_path, "--case-timeout", "0.3")  # the worker takes the grace too
    assert code == 1, out
    assert "crashed again (same signal/error): did not return within 0.3 s" in out


@pytest.mark.parametrize("kernel, exit_code, verdicts", [
    ("good", 0, {"pass", "skip"}),  # a correct kernel: every premerge case (a corner case is outside its envelope)
    ("wrong_scale", 1, {"pass", "fail"}),  # a faulty one: the search and its shrinking too
])
def test_isolation_and_supervision_give_the_same_cases_and_verdicts(capsys, tmp_path, kernel, exit_code, verdicts):
    reports = []
    for isolate in ("--isolate", "--no-isolate", None):  # None: supervised, check's default on the CPU
        report = tmp_path / f"{isolate}.json"
        code = main(["check", "--kernel", f"cli_kernels:{kernel}", "--device", "cpu", *([isolate] if isolate else []),
                     "--fixtures-dir", str(tmp_path / "fx"), "--report", str(report)])
        assert code == exit_code, capsys.readouterr()
        reports.append(cases_of(report))
    assert reports[0] == reports[1] == reports[2]  # every field: the ids, verdicts, errors (the same bits)...
    assert {c["verdict"] for c in reports[0]} == verdicts


def test_an_isolated_worker_imports_this_checkout_when_run_from_inside_another(tmp_path):
    # the command as installed, run from inside another checkout of mla_verify (here one that cannot be
    # imported): the fork server starts there, with the current directory first on its path
    (tmp_path / "mla_verify").mkdir()
    (tmp_path / "mla_verify" / "__init__.py").write_text('raise ImportError("the other checkout")\n')
    command = Path(sysconfig.get_path("scripts")) / "mla-verify"
    done = subprocess.run([str(command), "check", "--kernel", "cli_kernels:good", "--device", "cpu", "--isolate",
                           "--profile", "dev", "--max-examples", "2", "--fixtures-dir", "fx"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(TESTS)}, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cli_kernels:good: PASS -- 2 distinct cases" in done.stdout


def test_a_crash_that_takes_the_process_leaves_the_case_in_flight(capsys, tmp_path):
    done = subprocess.run([sys.executable, "-m", "mla_verify.cli", "check", "--no-isolate", "--device", "cpu",
                           "--kernel", "crashing_kernels:segfaults_on_big_batches", "--fixtures-dir", "fx"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": PYTHONPATH}, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == -signal.SIGSEGV, done.stdout + done.stderr  # nothing of this process survives
    recorded = re.search(r"the case in flight is kept in (\S+\.json)", done.stdout)
    assert recorded, done.stdout
    fx = load_fixture(tmp_path / recorded.group(1))
    assert fx.spec is not None and fx.spec.batch >= CRASH_BATCH
    code, out = replay(capsys, fx.json_path)
    assert code == 1, out
    # the record knew only that the process died; the isolated replay names the signal
    assert "crashed again: killed by SIGSEGV" in out


@pytest.mark.parametrize("isolate", ["--isolate", "--no-isolate", None])
def test_a_cuda_error_is_a_crash_of_the_running_case(capsys, tmp_path, isolate):
    code, out = check(capsys, "cuda_error_on_big_batches", tmp_path, *([isolate] if isolate else []))
    assert code == 1, out
    assert "the kernel crashed: CUDA error: an illegal memory access was encountered" in out
    fx = load_fixture(reproducer(out))
    assert fx.spec is not None and fx.spec.batch >= CRASH_BATCH
    if isolate != "--no-isolate":  # the worker (the search's copy, with no flag) is replaced and the search shrinks it
        assert list(fx.spec.seq_lens) == [1] * CRASH_BATCH
    else:  # this process's device would be unusable: the search ends at the first crash
        assert re.search(r"\(\d+ passed, 1 failed", out), out


def pytest_mla_kernel(tmp_path: Path, *argv: str, plain: bool = False) -> subprocess.CompletedProcess:
    """pytest under xdist, verifying the segfaulting kernel with its reproducers in tmp_path/fx; one torch thread
    (as `pytest -n auto` gives each worker on a 2-core machine), so that the worker can fork a supervised search.
    ``plain``: no xdist and no thread count of the user's (the plugin sets the CLI's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *(["-p", "no:xdist"] if plain else ["-n", "1"]),
                           "--mla-device", "cpu", "--mla-kernel", "crashing_kernels:segfaults_on_big_batches",
                           "--mla-fixtures-dir", "fx", *argv], capture_output=True, text=True,
                          env={**env, "PYTHONPATH": PYTHONPATH, **({} if plain else {"OMP_NUM_THREADS": "1"})},
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    return done


def test_pytest_mla_kernel_reports_a_crash_with_its_reproducer(tmp_path):
    done = pytest_mla_kernel(tmp_path)  # supervised by default: the crash is a copy's, then an isolated worker's
    assert "the process running the search died (killed by SIGSEGV" in done.stdout  # the test's stderr
    assert "the kernel crashed: killed by SIGSEGV" in done.stdout
    assert "crashed while running" not in done.stdout  # xdist's words for a worker it lost
    fx = load_fixture(tmp_path / reproducer(done.stdout))
    assert fx.meta["crash"].startswith("killed by SIGSEGV")
    assert fx.spec is not None and list(fx.spec.seq_lens) == [1] * CRASH_BATCH  # shrunk


def test_plain_pytest_supervises_the_search_as_check_does(tmp_path):
    # no -n, no OMP_NUM_THREADS: the plugin gives torch one thread on the CPU, as check does, so the test's process
    # can fork the supervised search (isolate.forkable) -- with torch's default count it would isolate every case
    done = pytest_mla_kernel(tmp_path, plain=True)
    assert "the process running the search died (killed by SIGSEGV" in done.stdout
    assert "the kernel crashed: killed by SIGSEGV" in done.stdout


def test_pytest_without_isolation_leaves_the_case_that_crashed_its_xdist_worker(capsys, tmp_path):
    done = pytest_mla_kernel(tmp_path, "--mla-isolate", "off")
    assert "crashed while running" in done.stdout  # the segfault took the xdist worker
    fx = load_fixture(tmp_path / "fx" / "in-flight-gw0.json")  # named by the worker xdist names
    assert fx.spec is not None and fx.spec.batch >= CRASH_BATCH
    code, out = replay(capsys, fx.json_path)
    assert code == 1, out
    assert "crashed again: killed by SIGSEGV" in out


@pytest.mark.parametrize("exc, fault", [
    (torch.AcceleratorError("CUDA error: an illegal memory access was encountered\nmore"),
     "CUDA error: an illegal memory access was encountered"),
    (RuntimeError("CUDA error: device-side assert triggered"), "CUDA error: device-side assert triggered"),
    (torch.OutOfMemoryError("CUDA out of memory"), None),  # a skip, not a crash
    (RuntimeError("shape mismatch"), None),
])
def test_device_fault_names_the_cuda_errors_that_end_a_context(exc, fault):
    assert device_fault(exc) == fault
