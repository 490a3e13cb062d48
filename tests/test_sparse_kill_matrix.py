"""The sparse kill matrix: each sparse mutant, behind FlashMLA's sparse calling convention on CPU
(mla_verify.kernels.sparse_mutants), fails its trigger and is named by the sparse diagnosis, and fails a premerge
run; the correct kernel behind the same convention passes premerge, or the kills would mean nothing."""
import pytest

from mla_verify.draw.sparse_strategies import sparse_corner_cases
from mla_verify.judge.sparse_judge import CATALOG, SINK_IN_LSE
from mla_verify.kernels.sparse_mutants import SPARSE_MUTANTS, SparseFaults, stand_in_backend
from mla_verify.run.sparse_case import run_sparse_case
from mla_verify.run.sparse_check import verify_sparse

# premerge's corner cases catch every mutant; 12 drawn cases on top keep the CPU time small (~5 s in all)
DRAWN = 12


def test_the_correct_kernel_passes_premerge():
    result = verify_sparse(stand_in_backend(), "cpu", "premerge", max_examples=DRAWN)
    assert result.verdict == "pass", result.failure and (result.failure.describe(), result.failure.failures)
    corners = len(sparse_corner_cases(stand_in_backend().envelope))
    assert sum(c.verdict == "pass" for c in result.cases) >= corners  # the corner cases ran, not skipped


@pytest.mark.parametrize("name", sorted(SPARSE_MUTANTS))
def test_the_trigger_fails_and_the_diagnosis_names_the_mutant(name):
    m = SPARSE_MUTANTS[name]
    assert m.diagnosis in CATALOG or m.diagnosis == SINK_IN_LSE
    case = run_sparse_case(stand_in_backend(m.faults, name), m.trigger, "cpu")
    assert case.verdict == "fail"
    assert case.diagnosis and case.diagnosis[0].startswith(m.diagnosis + ":"), case.diagnosis


@pytest.mark.parametrize("name", sorted(SPARSE_MUTANTS))
def test_premerge_kills_mutant(name):
    m = SPARSE_MUTANTS[name]
    result = verify_sparse(stand_in_backend(m.faults, name), "cpu", "premerge", max_examples=DRAWN)
    assert result.verdict == "fail", f"mutant {name} survived {len(result.cases)} premerge cases"


def test_premerge_is_deterministic():
    backend = stand_in_backend(SparseFaults(use_topk_length=False), "topk_length_ignored")
    runs = [verify_sparse(backend, "cpu", "premerge", max_examples=DRAWN) for _ in range(2)]
    assert [c.spec for c in runs[0].cases] == [c.spec for c in runs[1].cases]
    assert runs[0].failure is not None and runs[0].failure.spec == runs[1].failure.spec


def test_a_drawn_failure_is_shrunk_and_named():
    # the dev profile has no corner cases: the failure is drawn, then shrunk by Hypothesis to the plainest problem
    # that still has a -1 entry -- one request, one head, topk 64 -- and diagnosed there
    backend = stand_in_backend(SPARSE_MUTANTS["minus1_unmasked"].faults, "minus1_unmasked")
    result = verify_sparse(backend, "cpu", "dev", max_examples=30)
    shrunk = result.failure
    assert shrunk is not None
    assert (shrunk.spec.batch, shrunk.spec.num_heads, shrunk.spec.topk, shrunk.spec.q_len) == (1, 1, 64, 1)
    assert shrunk.diagnosis[0].startswith("minus1_read:")
