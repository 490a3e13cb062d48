"""Sparse cases get the crash verdict dense ones get (test_crash.py): with no flag (supervised) or isolated, a
sparse kernel that segfaults or aborts on an index past its pool fails its case as a crash, the search shrinks it
to a smallest crashing case, and its reproducer crashes again on replay; in this process, a CUDA error is a
crash of the running case (exit 1), and a crash that takes the process leaves the case in flight behind.
Isolation and supervision change no case and no verdict of a kernel that does not crash."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from crashing_sparse_kernels import CRASH_SLOT
from test_crash import PYTHONPATH, cases_of, check, replay, reproducer

from mla_verify.backends import named_backend
from mla_verify.problems.sparse import SPARSE_LAYOUT, SparseSpec
from mla_verify.run.engine import verify
from mla_verify.run.supervise import IN_PROCESS, ISOLATED, SUPERVISED, search

KERNELS = "crashing_sparse_kernels"


@pytest.mark.parametrize("kernel, signal_name, flag", [("segfaults_on_large_index", "SIGSEGV", "--isolate"),
                                                       ("aborts_on_large_index", "SIGABRT", None)])
def test_a_sparse_crash_is_shrunk_to_a_smallest_crashing_case_and_replays(capsys, tmp_path, kernel, signal_name,
                                                                         flag):
    # with no flag the search runs in a copy of this process and goes on isolated once the kernel kills it: the
    # segfault's run checks that this gives the very cases of an isolated run
    for name in (["--isolate", "default"] if flag else ["default"]):
        code, out = check(capsys, kernel, tmp_path / name, *([name] if name != "default" else []), "--report",
                          str(tmp_path / f"{name}.json"), module=KERNELS)
        assert code == 1, out
    if flag:
        assert cases_of(tmp_path / "default.json") == cases_of(tmp_path / f"{flag}.json")
    assert f"the kernel crashed: killed by {signal_name}" in out and "(in stage 'kernel')" in out
    meta = json.loads(reproducer(out).read_text())
    assert signal_name in meta["crash"]
    spec = SparseSpec.from_json(meta["spec"])
    # smallest: one request of one query token and one head, topk 64, no -1 entry, and a pool of one page more
    # than the most pages that hold no slot at or past CRASH_SLOT
    assert (spec.batch, spec.q_len, spec.num_heads, spec.topk, spec.invalid) == (1, 1, 1, 64, 0.0), spec
    pages = spec.used_pages + spec.extra_pages
    assert (pages - 1) * spec.page_size <= CRASH_SLOT < pages * spec.page_size, spec
    code, out = replay(capsys, reproducer(out))
    assert code == 1, out
    assert f"crashed again (same signal/error): killed by {signal_name}" in out


def test_a_sparse_crash_that_takes_the_process_leaves_the_case_in_flight(capsys, tmp_path):
    done = subprocess.run([sys.executable, "-m", "mla_verify.cli", "check", "--no-isolate", "--device", "cpu",
                           "--kernel", f"{KERNELS}:segfaults_on_large_index", "--fixtures-dir", "fx"],
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": PYTHONPATH}, cwd=tmp_path,
                          timeout=300)
    assert done.returncode == -signal.SIGSEGV, done.stdout + done.stderr  # nothing of this process survives
    recorded = re.search(r"the case in flight is kept in (\S+\.json)", done.stdout)
    assert recorded, done.stdout
    code, out = replay(capsys, tmp_path / recorded.group(1))
    assert code == 1, out
    # the record knew only that the process died; the isolated replay names the signal
    assert "crashed again: killed by SIGSEGV" in out


def test_a_cuda_error_in_process_is_a_crash_of_the_running_sparse_case(capsys, tmp_path):
    code, out = check(capsys, "cuda_error_on_large_index", tmp_path, "--no-isolate", module=KERNELS)
    assert code == 1, out
    assert "the kernel crashed: CUDA error: an illegal memory access was encountered" in out
    assert re.search(r"\(\d+ passed, 1 failed", out), out  # this process's device would be unusable: the end
    assert json.loads(reproducer(out).read_text())["crash"].startswith("CUDA error")


@pytest.fixture
def one_torch_thread():
    """A supervised search forks this process, which needs one torch thread (isolate.forkable); every run of a
    comparison then has the same count (CPU sums round by it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("kernel, verdict", [("correct_sparse_kernel", "pass"), ("tile_scale_shifted", "fail")])
def test_isolation_and_supervision_give_the_same_sparse_cases_and_verdicts(kernel, verdict, one_torch_thread):
    target = f"mla_verify.kernels.mutants:{kernel}"
    runs = [search(named_backend(target), "cpu", "premerge", how, max_examples=5)
            for how in (ISOLATED, IN_PROCESS, SUPERVISED)]
    seen = [[(c.spec.case_id(), c.verdict, c.failures, c.diagnosis) for c in r.cases] for r in runs]
    assert seen[0] == seen[1] == seen[2]  # the same cases, verdicts, errors (the same bits) and diagnoses
    assert [r.verdict for r in runs] == [verdict] * 3
    failures = [None if r.failure is None else (r.failure.spec, r.failure.failures, r.failure.diagnosis)
                for r in runs]
    assert failures[0] == failures[1] == failures[2]


def test_out_of_memory_skips_the_sparse_case_as_the_dense_harness_does():
    """On a shared GPU an allocation can fail for reasons outside the kernel: a skip, not a FAIL."""
    from crashing_sparse_kernels import out_of_memory_on_large_index

    from mla_verify.run.harness import OUT_OF_MEMORY, run_case

    spec = SparseSpec(batch=1, num_heads=64, topk=64, page_size=64, used_pages=4, invalid=0.0)
    result = run_case(out_of_memory_on_large_index, spec, SPARSE_LAYOUT, "cpu")
    assert (result.verdict, result.reason, result.failures) == ("skip", OUT_OF_MEMORY, [])


def test_a_flaky_sparse_kernel_is_reported_not_an_internal_error():
    """Hypothesis raises Flaky when the minimal case passes on its replay: the failure seen is the report."""
    from crashing_sparse_kernels import every_third_call_wrong

    run = verify(every_third_call_wrong, "cpu", "dev")
    assert run.verdict == "fail" and run.failure is not None and run.failure.failures
