"""Isolated runs started from processes that initialised CUDA as Python started (a sitecustomize calling
``torch.cuda.init()``, which the fork server runs too) judge their cases: their workers never inherit the
context (run/isolate.py). The CPU tests (tests/test_worker_start.py) fake such a parent; these use a real one.
"""
from __future__ import annotations

import pytest
import torch
from test_worker_start import cuda_initialised

pytestmark = pytest.mark.gpu
INIT = "import torch\ntorch.cuda.init()\n"


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the parent initialises CUDA")


def test_check_fa3_from_a_cuda_initialised_process_judges_its_cases(tmp_path) -> None:
    done = cuda_initialised(tmp_path, "-m", "mla_verify.cli", "check", "--backend", "fa3", "--device", "cuda",
                            "--profile", "dev", sitecustomize=INIT)
    if "fa3 cannot run" in done.stderr:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fa3: PASS" in done.stdout and "start by spawn" in done.stderr


def test_pytest_n2_mla_kernel_from_cuda_initialised_workers_judges_its_cases(tmp_path) -> None:
    pytest.importorskip("xdist")
    done = cuda_initialised(tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:mla_verify", "-p",
                            "mla_verify.pytest_plugin", "-n", "2", "--mla-device", "cuda", "--mla-kernel",
                            "cli_kernels:needs_cuda", "--mla-profile", "dev", sitecustomize=INIT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 passed" in done.stdout
