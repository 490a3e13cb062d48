"""How isolated workers start (run/isolate.py): never with an inherited CUDA context, whatever the process
that starts them did to CUDA, and a worker that cannot start is one line (exit 2), never an internal error.

A CUDA-initialised parent is faked on this CPU machine the way torch marks one: a sitecustomize (which every
interpreter runs as it starts, the fork server included, as it would run an engine's plugin that calls
``torch.cuda.init()``) makes every process forked from one that imported torch a "bad fork", where torch
refuses CUDA. The kernel
``cli_kernels:needs_cuda`` is refused there, as a real CUDA kernel would be.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mla_verify.backends.user_kernel import load_kernel
from mla_verify.core.errors import UsageError
from mla_verify.run.isolate import Isolated

TESTS = Path(__file__).resolve().parent
SITECUSTOMIZE = '''
import os
import sys

def _forked():  # what torch's own fork handler does in the child of a process holding a CUDA context
    cuda = sys.modules.get("torch.cuda")  # a process without torch has no CUDA to initialise
    if cuda is not None:
        cuda._is_in_bad_fork = lambda: True

os.register_at_fork(after_in_child=_forked)
'''


def cuda_initialised(tmp_path: Path, *command: str,
                     sitecustomize: str = SITECUSTOMIZE) -> subprocess.CompletedProcess[str]:
    """``command`` from tmp_path, every interpreter it starts running ``sitecustomize`` first (by default,
    faking a CUDA-initialised process)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(sitecustomize)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(TESTS.parent), str(TESTS)])}
    return subprocess.run([sys.executable, *command], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=600)


def test_check_from_a_cuda_initialised_process_judges_its_cases_in_workers_that_do_not_inherit_it(tmp_path):
    done = cuda_initialised(tmp_path, "-m", "mla_verify.cli", "check", "--kernel", "cli_kernels:needs_cuda",
                            "--device", "cpu", "--isolate", "--profile", "dev", "--max-examples", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "cli_kernels:needs_cuda: PASS" in done.stdout
    assert "isolated workers start by spawn from now on" in done.stderr  # said once, and why
    assert done.stderr.count("start by spawn") == 1


def test_pytest_mla_kernel_from_a_cuda_initialised_process_judges_its_cases(tmp_path):
    """pytest's own process is the parent here (xdist's workers start as fresh interpreters, as this one
    does: ``pytest -n 2`` adds half a minute on this machine and nothing to what is tested; the GPU run,
    benchmarks/fresh_runner.py, uses it)."""
    # isolated: the default would fork this process, whose fake CUDA context torch.cuda.is_initialized() does not
    # report (a real one it does, and then the default is isolated: isolate.forkable)
    done = cuda_initialised(tmp_path, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--mla-device", "cpu",
                            "--mla-kernel", "cli_kernels:needs_cuda", "--mla-profile", "dev", "--mla-isolate", "on")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where CUDA cannot start")
def test_a_worker_that_cannot_start_cuda_says_so_in_one_line_before_the_first_case() -> None:
    judge = Isolated(load_kernel("cli_kernels:good"), torch.device("cuda"), None)
    with pytest.raises(UsageError) as raised:
        judge.start()
    message = str(raised.value)
    assert message.startswith("cli_kernels:good: the isolated worker could not start CUDA on cuda: "), message
    assert "Torch not compiled with CUDA enabled" in message and "\n" not in message
