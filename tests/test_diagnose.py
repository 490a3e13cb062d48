"""diagnose names the misreading behind each cataloged mutant, and explains nothing for a correct kernel."""
from __future__ import annotations

import math

import pytest
import torch

from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.judge.diagnose import CATALOG, LSE_BASES, diagnose, relative_error
from mla_verify.kernels.mutants import MUTANTS, correct_kernel
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.reference import reference_decode
from mla_verify.run.harness import CaseResult, kernel_rerun, run_case

CATALOGED = sorted(name for name, m in MUTANTS.items() if m.diagnosis is not None)
# (a fault that shows only past 2^32 elements is judged on a GPU: tests/gpu/test_large_pool.py)
UNCATALOGED = sorted(name for name, m in MUTANTS.items() if m.diagnosis is None and m.device == "cpu")


def _run(name: str) -> CaseResult:
    m = MUTANTS[name]
    return run_case(TrtllmStyleBackend(name, m.fn), m.trigger, m.trigger_layout, "cpu", diagnose=False)


@pytest.mark.parametrize("name", CATALOGED)
def test_diagnosis_names_the_mutants_fault(name: str) -> None:
    m = MUTANTS[name]
    assert m.diagnosis in CATALOG or m.diagnosis in LSE_BASES
    result = _run(name)
    assert result.verdict == "fail" and result.out is not None, result.reason
    found = diagnose(result.problem, result.out, result.lse,
                     rerun=kernel_rerun(TrtllmStyleBackend(name, m.fn), m.trigger_layout))
    names = [e.name for e in found]
    assert m.diagnosis in names, f"{name}: expected {m.diagnosis}, got {names}"
    mine = found[names.index(m.diagnosis)]
    # ranked first, up to ties: misreadings that are the same arithmetic on this problem (1/sqrt(192) is
    # R1's scale without its mscale) differ only by rounding, well within 10% of each other
    assert mine.error <= 1.1 * found[0].error, f"{name}: {m.diagnosis} ranked below {names[0]}"
    assert str(mine).startswith(mine.description)


@pytest.mark.parametrize("name", UNCATALOGED)
def test_faults_outside_the_catalog_get_no_false_explanation(name: str) -> None:
    result = _run(name)
    if result.out is None:  # crashed: nothing to explain
        pytest.skip(result.reason)
    assert diagnose(result.problem, result.out, result.lse) == []


@pytest.mark.parametrize("spec", [
    ProblemSpec((37, 100), num_heads=4, page_size=32, bmm2_extra=0.5),
    ProblemSpec((128, 96), num_heads=2, page_size=32, q_len=4, seed=3),
    ProblemSpec((64, 300), num_heads=8, page_size=64, dtype="fp8", q_scale=0.5, k_scale=0.25, seed=4),
], ids=["bf16", "q_len4", "fp8"])
def test_correct_kernel_is_explained_by_nothing(spec: ProblemSpec) -> None:
    result = run_case(TrtllmStyleBackend("correct", correct_kernel), spec, MUTANTS["heads_reversed"].trigger_layout,
                      "cpu", diagnose=False)
    assert result.verdict == "pass", result.reason
    problem = build_problem(spec)
    assert diagnose(problem, result.out, result.lse) == []


def test_lse_base_is_read_in_the_promised_base() -> None:
    problem = build_problem(ProblemSpec((50,), num_heads=2, page_size=32))
    truth = reference_decode(problem)
    out = truth.out.to(torch.bfloat16)
    # a kernel promising natural log but returning base 2
    found = diagnose(problem, out, truth.lse_base2, lse_base=math.e, truth=truth)
    assert [e.name for e in found] == ["lse_base2"]
    assert diagnose(problem, out, truth.lse, lse_base=math.e, truth=truth) == []


def test_relative_error_requires_matching_nonfinite_positions() -> None:
    a = torch.tensor([1.0, float("nan"), 2.0])
    assert relative_error(a, a.clone()) == 0.0
    assert relative_error(a, torch.tensor([1.0, 3.0, 2.0])) == math.inf
    assert relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0])) == pytest.approx(1 / math.sqrt(2))


def test_misread_length_shorter_than_q_len_is_still_explained() -> None:
    # seq_len == q_len: reading one token less leaves query token 0 nothing to attend to (a NaN row)
    spec = ProblemSpec((4, 40), num_heads=2, page_size=32, q_len=4, seed=5)
    result = run_case(TrtllmStyleBackend("length_minus_1", MUTANTS["length_minus_1"].fn), spec,
                      MUTANTS["length_minus_1"].trigger_layout, "cpu", diagnose=False)
    assert result.verdict == "fail" and bool(result.out.isnan().any())
    rerun = kernel_rerun(TrtllmStyleBackend("length_minus_1", MUTANTS["length_minus_1"].fn),
                         MUTANTS["length_minus_1"].trigger_layout)
    assert "length_minus_1" in [e.name for e in diagnose(result.problem, result.out, result.lse, rerun=rerun)]
