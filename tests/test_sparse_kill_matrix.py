"""The sparse kill matrix, through the one pipeline dense kernels go through: each sparse mutant -- a kernel of
FlashMLA's sparse calling convention on CPU (mla_verify.kernels.mutants), called as any such kernel is -- fails
premerge with its minimal case at one request, and the diagnosis names its misreading, or says the case cannot
tell it from others, never a wrong name; each fails its trigger and is named there too; the correct kernel of
the same convention passes premerge, or the kills would mean nothing."""
import re
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings

from mla_verify.backends.user_kernel import (
    USER_FLASHMLA_SPARSE_ENVELOPE,
    envelope_from_overrides,
    kernel_backend,
    load_kernel,
)
from mla_verify.draw.sparse_strategies import sparse_corner_cases
from mla_verify.draw.strategies import budget_for
from mla_verify.judge.diagnose import CANDIDATES
from mla_verify.judge.sparse_catalog import CATALOG, SINK_IN_LSE
from mla_verify.kernels.flashmla_cpu import sparse_stand_in_backend
from mla_verify.kernels.mutants import SPARSE_MUTANTS, FaultySparseKernel, SparseFaults
from mla_verify.kinds import KINDS
from mla_verify.problems.sparse import SPARSE_LAYOUT
from mla_verify.run.engine import verify
from mla_verify.run.harness import run_case

SPARSE_KIND = KINDS["sparse"]
# premerge's corner cases catch every mutant; 12 drawn cases on top keep the CPU time small
DRAWN = 12


def mutant(name: str):
    """The kernel ``--kernel mla_verify.kernels.mutants:<name>`` runs."""
    return load_kernel(f"mla_verify.kernels.mutants:{name}")


def named(diagnosis: list[str]) -> tuple[bool, set[str]]:
    """Whether the diagnosis says the case cannot tell misreadings apart, and the misreadings it names."""
    return (any(d.startswith(CANDIDATES) for d in diagnosis),
            set(re.findall(r" \[(\w+)\] \(", " ".join(diagnosis))))


def test_the_correct_kernel_passes_premerge():
    result = verify(mutant("correct_sparse_kernel"), "cpu", "premerge", max_examples=DRAWN)
    assert result.verdict == "pass", result.failure and (result.failure.describe(), result.failure.failures)
    corners = len(sparse_corner_cases(mutant("correct_sparse_kernel").envelope))
    assert sum(c.verdict == "pass" for c in result.cases) >= corners  # the corner cases ran, not skipped


@pytest.mark.parametrize("name", sorted(SPARSE_MUTANTS))
def test_the_trigger_fails_and_the_diagnosis_names_the_mutant(name):
    m = SPARSE_MUTANTS[name]
    assert m.diagnosis in CATALOG or m.diagnosis == SINK_IN_LSE
    case = run_case(mutant(name), m.trigger, SPARSE_LAYOUT, "cpu")
    assert case.verdict == "fail"
    assert named(case.diagnosis) == (False, {m.diagnosis}), case.diagnosis


@pytest.mark.parametrize("name", sorted(SPARSE_MUTANTS))
def test_premerge_kills_mutant_at_one_request_and_names_it(name):
    m = SPARSE_MUTANTS[name]
    result = verify(mutant(name), "cpu", "premerge", max_examples=DRAWN)
    assert result.verdict == "fail", f"mutant {name} survived {len(result.cases)} premerge cases"
    failure = result.failure
    assert failure.spec.batch == 1, failure.describe()  # shrunk like a drawn failure, a corner case too
    tied, names = named(failure.diagnosis)
    assert m.diagnosis in names and (tied or names == {m.diagnosis}), failure.diagnosis


def test_premerge_is_deterministic():
    backend = kernel_backend(FaultySparseKernel(SparseFaults(use_topk_length=False)), "topk_length_ignored")
    runs = [verify(backend, "cpu", "premerge", max_examples=DRAWN) for _ in range(2)]
    assert [(c.id, c.verdict) for c in runs[0].cases] == [(c.id, c.verdict) for c in runs[1].cases]
    assert runs[0].failure is not None and runs[0].failure.id == runs[1].failure.id


def test_a_drawn_failure_is_shrunk_and_named():
    # the dev profile has no corner cases: the failure is drawn, then shrunk to the plainest problem that still
    # has a -1 entry -- one request, one head, topk 64 -- and diagnosed there
    backend = mutant("minus1_unmasked")
    result = verify(backend, "cpu", "dev", max_examples=30)
    shrunk = result.failure
    assert shrunk is not None
    assert (shrunk.spec.batch, shrunk.spec.num_heads, shrunk.spec.topk, shrunk.spec.q_len) == (1, 1, 64, 1)
    assert named(shrunk.diagnosis) == (False, {"minus1_read"}), shrunk.diagnosis


def test_the_sparse_metamorphic_relations_are_judged_as_each_allows():
    """The pool's pages moved keep the bits where the backend claims that (FlashMLA's sparse backend does, a kernel
    of one's own only if it declares it); a row's entries reordered changes the order of the sum, so it is judged
    by the tolerance model whatever is claimed -- and a kernel whose answer changes with where a row's -1 entries
    sit fails it."""
    spec = SPARSE_MUTANTS["minus1_unmasked"].trigger  # -1 entries scattered through each row
    relations = ("pages", "topk_order", "minus1_moved")
    for backend, pages in ((sparse_stand_in_backend(), "bits"), (mutant("correct_sparse_kernel"), "tolerance")):
        judged = {t: run_case(backend, spec, SPARSE_LAYOUT, "cpu", t) for t in relations}
        assert {t: (r.verdict, r.invariance) for t, r in judged.items()} == {
            "pages": ("pass", pages), "topk_order": ("pass", "tolerance"), "minus1_moved": ("pass", "tolerance")}

    kernel = FaultySparseKernel()

    def leading_minus1_wrong(*args, indices=None, **kwargs):  # right unless a row starts with -1
        out, lse = kernel(*args, indices=indices, **kwargs)
        return (out * 2 if bool((indices[..., 0] == -1).any()) else out), lse

    backend = kernel_backend(leading_minus1_wrong, "leading_minus1_wrong", "flashmla-sparse")
    assert run_case(backend, spec, SPARSE_LAYOUT, "cpu").verdict == "pass"  # no row of the trigger starts with -1
    moved = run_case(backend, spec, SPARSE_LAYOUT, "cpu", "minus1_moved")
    assert moved.verdict == "fail" and moved.reason.startswith(
        "with each row's -1 entries moved to its front: max |out - ref|"), moved.failures


def test_the_trtllm_sparse_face_is_the_same_correct_kernel_over_a_bf16_cache():
    """``FaultySparseKernel.trtllm_sparse`` (how fib/contract1.py hands the sparse kernels a bf16 pool): the correct
    kernel's face passes premerge on bf16 problems, called by Contract 1's trtllm-sparse convention."""
    backend = kernel_backend(FaultySparseKernel().trtllm_sparse, "face", "trtllm-sparse")
    backend.envelope = replace(backend.envelope, devices=("cpu",), formats=("bf16",))
    result = verify(backend, "cpu", "premerge", max_examples=DRAWN)
    assert result.verdict == "pass" and not any(c.verdict == "skip" for c in result.cases), result.failure


def test_a_sparse_envelope_of_named_head_counts_is_drawn_cornered_and_shrunk_inside_them():
    """SparseEnvelope.heads, as Envelope's: the drawn cases, the corner cases and the shrink steps take only the
    head counts it names; a kernel of one's own declares them as any other field."""
    env = replace(USER_FLASHMLA_SPARSE_ENVELOPE, heads=(24, 64), max_heads=64)
    assert envelope_from_overrides({"heads": [24, 64], "max_heads": 64}, USER_FLASHMLA_SPARSE_ENVELOPE) == env
    assert env.why_not(replace(SPARSE_MUTANTS["v_rope_dims"].trigger, num_heads=32)).endswith(
        "32 heads (supported: [24, 64])")
    corners = SPARSE_KIND.corner_cases(env, budget_for(torch.device("cpu")))
    assert corners and {c.spec.num_heads for c in corners} == {24, 64}

    @settings(max_examples=40, database=None, derandomize=True)
    @given(SPARSE_KIND.cases(env, budget_for(torch.device("cpu"))))
    def drawn(case):
        assert case.spec.num_heads in (24, 64) and env.why_not(case.spec, case.layout) is None
        assert all(c.spec.num_heads in (24, 64) for _, c in SPARSE_KIND.smaller(case, env))

    drawn()
