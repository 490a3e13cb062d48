"""Out of memory is the machine's state, never the kernel's fault: at every stage of a case it is a counted
skip with its reason, diagnosis errors are one line, and a run draws smaller cases after an OOM."""
from __future__ import annotations

import pytest
import torch

from mla_verify.backends.trtllm_style import TRTLLM_ENVELOPE, TrtllmStyleBackend
from mla_verify.core import memory
from mla_verify.core.errors import UsageError
from mla_verify.draw.strategies import Budget
from mla_verify.kernels.mutants import MUTANTS, correct_kernel
from mla_verify.kinds.dense import DenseKind
from mla_verify.problems import metamorphic
from mla_verify.problems.generate import ProblemSpec
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.run import harness
from mla_verify.run.engine import verify
from mla_verify.run.harness import SKIP_MEMORY, run_case

SPEC = ProblemSpec(seq_lens=(5, 40), q_len=2, num_heads=2, page_size=32, kv_lora_rank=256, seed=3)
LAYOUT = LayoutSpec()


def oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def cuda_oom_kernel(*args, **kwargs):
    raise RuntimeError("CUDA error: out of memory")  # how a kernel's own failed allocation surfaces


def cublas_oom_kernel(*args, **kwargs):  # a matmul whose cuBLAS workspace could not be allocated
    raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")


@pytest.mark.parametrize("stage", ["build", "reference", "baseline", "compare"])
def test_oom_in_a_stage_of_the_suite_is_a_memory_skip(monkeypatch, stage):
    monkeypatch.setattr(*((harness, stage) if stage == "compare" else (DenseKind, stage)), oom)
    r = run_case(TrtllmStyleBackend("correct", correct_kernel), SPEC, LAYOUT, "cpu", "pages")
    assert (r.verdict, r.skip_kind) == ("skip", SKIP_MEMORY), r.failures
    assert "out of device memory" in r.reason and not r.failures


def test_oom_in_the_metamorphic_transform_is_a_memory_skip(monkeypatch):
    monkeypatch.setattr(metamorphic, "transform", oom)
    r = run_case(TrtllmStyleBackend("correct", correct_kernel), SPEC, LAYOUT, "cpu", "pages")
    assert (r.verdict, r.skip_kind) == ("skip", SKIP_MEMORY)


class _OomPrepare(TrtllmStyleBackend):
    def prepare(self, problem, layout):
        oom()


@pytest.mark.parametrize("backend", [_OomPrepare("oom-prepare", correct_kernel),
                                     TrtllmStyleBackend("oom-kernel", cuda_oom_kernel),
                                     TrtllmStyleBackend("cublas-kernel", cublas_oom_kernel)],
                         ids=["prepare", "kernel", "cublas"])
def test_oom_in_the_backend_is_a_memory_skip_not_a_failure(backend):
    r = run_case(backend, SPEC, LAYOUT, "cpu")
    assert (r.verdict, r.skip_kind) == ("skip", SKIP_MEMORY), r.failures


def test_other_kernel_errors_still_fail():
    def raises(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    assert run_case(TrtllmStyleBackend("bad", raises), SPEC, LAYOUT, "cpu").verdict == "fail"


@pytest.mark.parametrize("error, line", [
    (torch.OutOfMemoryError("no memory"), "diagnosis skipped: out of device memory"),
    (NotImplementedError('"roll_cuda" not implemented'), "diagnosis failed: ")])
def test_diagnosis_errors_are_one_line_and_the_failure_stands(monkeypatch, error, line):
    import mla_verify.judge.diagnose as diagnose

    def broken(*args, **kwargs):
        raise error
    monkeypatch.setattr(diagnose, "diagnose", broken)
    r = run_case(TrtllmStyleBackend("scale", MUTANTS["scale_sqrt_576"].fn), SPEC, LAYOUT, "cpu")
    assert r.verdict == "fail"
    assert len(r.diagnosis) == 1 and r.diagnosis[0].startswith(line)


def test_a_run_draws_smaller_cases_after_an_oom():
    limit = 300  # cached tokens: the kernel "runs out of memory" on any case above it

    def small_memory(query, kv_cache, *args, **kwargs):
        if kv_cache.shape[0] * kv_cache.shape[-2] > limit:
            oom()
        return correct_kernel(query, kv_cache, *args, **kwargs)

    budget = Budget(units=200_000, max_batch=16, max_seq_len=2000, max_tokens=1 << 14, max_rows=1 << 10)
    backend = TrtllmStyleBackend("small-memory", small_memory, TRTLLM_ENVELOPE.narrowed(devices=("cpu",)))
    result = verify(backend, "cpu", "dev", max_examples=40, budget=budget)
    skipped = [i for i, c in enumerate(result.cases) if c.skip_kind == SKIP_MEMORY]
    assert skipped and result.verdict == "pass"
    assert budget.cap_tokens is not None and budget.cap_tokens < 1 << 14
    after = result.cases[skipped[0] + 1:]
    assert sum(c.skip_kind == SKIP_MEMORY for c in after) < len(after) / 2  # the rest mostly fits


def test_sharers_of_one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # the CI machine's view, also on a GPU host
    assert memory.device_sharers({}) == 1
    assert memory.device_sharers({memory.SHARERS_ENV: "3"}) == 3
    assert memory.device_sharers({"PYTEST_XDIST_WORKER_COUNT": "16"}) == 16  # no GPU: all on one device
    for bad in ("three", "0", "-2"):  # a typo must not silently size every case for one process
        with pytest.raises(UsageError, match=memory.SHARERS_ENV):
            memory.device_sharers({memory.SHARERS_ENV: bad})
