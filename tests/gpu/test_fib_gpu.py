"""``check --fib-solution`` on a CUDA device: a python solution runs there as on CPU (isolated by default, each case
worker building the solution from its files), and a failing case's workload is judged by flashinfer-bench's
evaluator rules on the device -- for an MLA decode definition (the CPU peer, a dense mutant) and a DSA one (the
sparse stand-in, a sparse mutant), wrapped by mla_verify.fib.contract1 (tests/test_fib.py holds the CPU side). A
few minutes on an H100/H200, most of it process start-up and the DSA premerge's float64 reference.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mla_verify.fib.contract1 import write_solution
from mla_verify.fib.definition import read_definition

pytestmark = pytest.mark.gpu

DATASET = Path(__file__).resolve().parents[2] / "fixtures" / "fib"
DENSE = "mla_paged_decode_h16_ckv512_kpe64_ps64"
DSA = "dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64"


def check(tmp_path: Path, definition: str, kernel: str, *argv: str) -> subprocess.CompletedProcess:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the solution runs on --device cuda")
    pytest.importorskip("flashinfer_bench", reason="flashinfer-bench is not installed: pip install 'mla-verify[fib]'")
    path = next(DATASET.rglob(f"{definition}.json"))
    name = kernel.rpartition(":")[2].partition(".")[0]
    solution = write_solution(tmp_path / f"{name}.json", name, kernel,
                              read_definition(json.loads(path.read_text()), str(path)))
    return subprocess.run([sys.executable, "-m", "mla_verify.cli", "check", "--fib-solution", str(solution),
                           "--fib-dataset", str(DATASET), "--device", "cuda", "--fixtures-dir", "fx", *argv],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600,
                          env={**os.environ, "FIB_CACHE_PATH": str(tmp_path / "fib-cache")})


@pytest.mark.parametrize("definition, kernel", [
    (DENSE, "mla_verify.backends.cpu_peer:cpu_peer_decode"),
    (DSA, "mla_verify.kernels.mutants:correct_sparse_kernel.trtllm_sparse")])
def test_the_correct_kernel_as_a_solution_passes_on_cuda(tmp_path: Path, definition: str, kernel: str) -> None:
    done = check(tmp_path, definition, kernel)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"fib:{kernel.rpartition(':')[2].partition('.')[0]}: PASS" in done.stdout, done.stdout


@pytest.mark.parametrize("definition, kernel", [
    (DENSE, "mla_verify.kernels.mutants:halves_swapped"),
    (DSA, "mla_verify.kernels.mutants:v_rope_dims.trtllm_sparse")])
def test_a_mutant_fails_on_cuda_with_its_workload_judged_there(tmp_path: Path, definition: str, kernel: str) -> None:
    done = check(tmp_path, definition, kernel, "--profile", "dev")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "flashinfer-bench's evaluator on it: would flag it: INCORRECT_NUMERICAL" in done.stdout, done.stdout
