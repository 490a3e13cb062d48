"""A GPU kernel that faults on some inputs only gets a verdict (docs/judging.md, "A crash"): isolated, the
search shrinks the fault to the smallest input that makes it, and its reproducer faults again on replay; in
process, the CUDA error is a crash of the running case, exit 1, never "internal error".

The kernels (tests/crashing_kernels.py) are correct up to CRASH_SEQ_LEN tokens and read past their cache pool
beyond it: through torch's indexing (a device-side assert) and through a Triton kernel (an illegal memory
access). Each run is a subprocess: a faulted CUDA context is unusable for the rest of its process. About 2 min
on an H200, most of it process start-up. A sparse kernel gets the same treatment
(tests/crashing_sparse_kernels.py: FlashMLA's sparse decode, which gathers past its pool on an index at or past
CRASH_SLOT).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from crashing_kernels import CRASH_SEQ_LEN
from crashing_sparse_kernels import CRASH_SLOT, gathers_past_its_pool

from mla_verify.problems.sparse import SparseSpec

pytestmark = pytest.mark.gpu

TESTS = Path(__file__).resolve().parents[1]
PYTHONPATH = os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])
FAULTS = {"gathers_past_its_pool": "CUDA error: device-side assert triggered",
          "reads_far_past_its_pool": "CUDA error: an illegal memory access was encountered"}


def mla_verify(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mla_verify.cli", *argv], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": PYTHONPATH}, cwd=cwd, timeout=600)


def needs(kernel: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the kernel's fault is a CUDA error")
    if kernel == "reads_far_past_its_pool":
        pytest.importorskip("triton", reason="the illegal access is a Triton kernel's")


def check_crashes(tmp_path: Path, kernel: str, isolate: str) -> str:
    """``check`` of a faulting kernel: exit 1, the fault named as a crash, never "internal error"; its stdout."""
    needs(kernel)
    done = mla_verify("check", "--kernel", f"crashing_kernels:{kernel}", "--device", "cuda", isolate,
                      "--fixtures-dir", "fx", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"the kernel crashed: {FAULTS[kernel]}" in done.stdout, done.stdout
    assert "internal error" not in done.stderr
    return done.stdout


@pytest.mark.parametrize("kernel", list(FAULTS))
def test_an_isolated_gpu_fault_is_shrunk_and_replays(tmp_path, kernel):
    out = check_crashes(tmp_path, kernel, "--isolate")
    found = re.search(r"reproducer: (\S+\.json)", out)
    assert found, out
    minimal = re.search(r"minimal case: B=(\d+) H=(\d+) q_len=(\d+) .* seq_lens=\[([\d, ]+)\]", out)
    assert minimal, out
    # the smallest input that faults: one request of CRASH_SEQ_LEN + 1 tokens, one head, one query token
    assert minimal.groups() == ("1", "1", "1", str(CRASH_SEQ_LEN + 1)), minimal.group(0)
    again = mla_verify("replay", found.group(1), cwd=tmp_path)
    assert again.returncode == 1, again.stdout + again.stderr
    assert f"crashed again (same signal/error): {FAULTS[kernel]}" in again.stdout, again.stdout


@pytest.mark.parametrize("kernel", list(FAULTS))
def test_an_in_process_gpu_fault_is_a_crash_of_its_case(tmp_path, kernel):
    out = check_crashes(tmp_path, kernel, "--no-isolate")
    assert re.search(r"reproducer: (\S+\.json)", out), out


def test_an_isolated_sparse_gpu_fault_is_shrunk_and_replays(tmp_path):
    if (reason := gathers_past_its_pool.unavailable_reason(torch.device("cuda"))) is not None:
        pytest.skip(reason)
    done = mla_verify("check", "--kernel", "crashing_sparse_kernels:gathers_past_its_pool", "--device", "cuda",
                      "--fixtures-dir", "fx", cwd=tmp_path)  # isolated: the default on CUDA
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"the kernel crashed: {FAULTS['gathers_past_its_pool']}" in done.stdout, done.stdout
    assert "internal error" not in done.stderr
    found = re.search(r"reproducer: (\S+\.json)", done.stdout)
    assert found, done.stdout
    spec = SparseSpec.from_json(json.loads((tmp_path / found.group(1)).read_text())["spec"])
    # as on the CPU (tests/test_sparse_crash.py): the plainest problem whose pool holds a slot past CRASH_SLOT
    assert (spec.batch, spec.q_len, spec.num_heads, spec.topk, spec.invalid) == (1, 1, 1, 64, 0.0), spec
    pages = spec.used_pages + spec.extra_pages
    assert (pages - 1) * spec.page_size <= CRASH_SLOT < pages * spec.page_size, spec
    again = mla_verify("replay", found.group(1), cwd=tmp_path)
    assert again.returncode == 1, again.stdout + again.stderr
    assert f"crashed again (same signal/error): {FAULTS['gathers_past_its_pool']}" in again.stdout, again.stdout
