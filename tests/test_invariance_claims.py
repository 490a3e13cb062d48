"""Metamorphic relations are judged by each backend's claim (``Envelope.bit_invariant``).

A kernel whose bits move with the batch order but whose values stay right -- what FlashMLA's whole-batch split-KV
schedule does, and what a plain PyTorch kernel's BLAS paths may do -- fails a bit-level claim and passes without
one, the moved bits then a note; a kernel that is *wrong* in one batch order fails either way. A user's kernel
claims nothing unless it declares it -- a sparse one too, whose row reorderings are judged within tolerance
whatever it claims. The case records which judgement was applied, and so do the report and ``check``.
"""
from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from precision_kernels import position_rounded, position_rounded_claiming_bits

from mla_verify.backends import get_backend
from mla_verify.backends.base import INVARIANT_BITS, INVARIANT_WITHIN_TOLERANCE
from mla_verify.backends.trtllm_style import TRTLLM_ENVELOPE, TrtllmStyleBackend
from mla_verify.backends.user_kernel import kernel_backend
from mla_verify.core.errors import UsageError
from mla_verify.kernels.mutants import FaultySparseKernel, correct_kernel
from mla_verify.problems.generate import ProblemSpec
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.problems.metamorphic import RELATIONS
from mla_verify.problems.sparse import SPARSE_LAYOUT, SPARSE_TRANSFORMS, SparseSpec
from mla_verify.records.failure import failure_lines
from mla_verify.records.report import invariance_counts, invariance_line
from mla_verify.run.engine import verify
from mla_verify.run.harness import run_case

# first and last lengths differ, so exactly one of the two batch orders has the longer sequence first
SPEC = ProblemSpec(seq_lens=(200, 7, 65), q_len=2, num_heads=8, page_size=32, seed=5)


def _order_dependent(nudge: Any) -> Any:
    """The correct kernel, its output then changed by ``nudge`` when the batch starts with its shorter end (SPEC
    reversed)."""
    def kernel(query: torch.Tensor, kv_cache: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        result = correct_kernel(query, kv_cache, *args, **kwargs)
        seq_lens = args[5]
        if int(seq_lens[0]) < int(seq_lens[-1]):
            nudge(result[0] if isinstance(result, tuple) else result)
        return result
    return kernel


def _one_ulp(out: torch.Tensor) -> None:
    """One bf16 ulp on the smallest nonzero element: new bits, a change far inside any tolerance."""
    flat = out.view(-1)
    i = int(torch.where(flat != 0, flat.float().abs(), float("inf")).argmin())
    flat.view(torch.int16)[i] += 1


def _ten_percent(out: torch.Tensor) -> None:
    out.mul_(1.1)


def _backend(nudge: Any, bits: bool) -> TrtllmStyleBackend:
    claim = RELATIONS if bits else ()
    return TrtllmStyleBackend(f"order-dependent-{bits}", _order_dependent(nudge),
                              TRTLLM_ENVELOPE.narrowed(bit_invariant=claim))


def test_order_dependent_bits_fail_a_bit_level_claim() -> None:
    result = run_case(_backend(_one_ulp, True), SPEC, LayoutSpec(), "cpu", transform="batch")
    assert result.verdict == "fail" and result.invariance == INVARIANT_BITS
    assert "not bit-identical with batch order reversed" in result.reason
    # the first output is right: the diagnosis is the relation's, not a search of that output's keys
    assert len(result.diagnosis) == 1 and "the relation broke: with batch order reversed, 1 of" in result.diagnosis[0]
    assert "KV positions" not in result.diagnosis[0]


def test_order_dependent_bits_pass_without_a_claim_and_are_a_note() -> None:
    result = run_case(_backend(_one_ulp, False), SPEC, LayoutSpec(), "cpu", transform="batch")
    assert result.verdict == "pass", result.failures
    assert result.invariance == INVARIANT_WITHIN_TOLERANCE and result.to_json()["invariance"] == "tolerance"
    assert result.notes == ["bits moved with batch order reversed, within tolerance (no bit-level invariance "
                            "claimed for it): 1 of 24576 output elements differ"]
    assert result.to_json()["notes"] == result.notes


def test_a_wrong_result_in_one_order_fails_without_a_claim() -> None:
    result = run_case(_backend(_ten_percent, False), SPEC, LayoutSpec(), "cpu", transform="batch", diagnose=False)
    assert result.verdict == "fail"
    assert result.reason.startswith("with batch order reversed (judged within tolerance: the kernel claims no "
                                    "bit-level invariance for it): ")


@pytest.mark.parametrize("transform", ["pages", "table"])
def test_a_claim_is_per_relation(transform: str) -> None:
    """Claiming the batch order only within tolerance leaves the other relations bit for bit."""
    backend = TrtllmStyleBackend("batch-only", _order_dependent(_one_ulp),
                                 TRTLLM_ENVELOPE.narrowed(bit_invariant=tuple(r for r in RELATIONS if r != "batch")))
    result = run_case(backend, SPEC, LayoutSpec(), "cpu", transform=transform)
    assert result.verdict == "pass" and result.invariance == INVARIANT_BITS
    assert run_case(backend, SPEC, LayoutSpec(), "cpu", transform="batch").invariance == INVARIANT_WITHIN_TOLERANCE


def test_a_nondeterministic_kernel_still_fails_without_a_claim() -> None:
    """Moved bits within tolerance send the case to the plain repeat, which tells nondeterminism apart: that is a
    failure whatever the relations claim."""
    calls = {"n": 0}

    def flaky(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        result = correct_kernel(*args, **kwargs)
        if calls["n"] > 1:  # every call after the first
            _one_ulp(result[0] if isinstance(result, tuple) else result)
        return result

    result = run_case(kernel_backend(flaky, "flaky"), SPEC, LayoutSpec(), "cpu", transform="pages")
    assert result.verdict == "fail" and result.reason.startswith("not bit-identical with a second identical call")
    assert not result.notes


def _pages_dependent(q: torch.Tensor, k_cache: torch.Tensor, *args: Any, indices: torch.Tensor, **kwargs: Any) -> Any:
    """The correct sparse kernel, one ulp off when the last page it reads has an odd number: its bits move with where
    its pages sit in the pool (the pages relation renumbers them), its values do not."""
    out, lse = FaultySparseKernel()(q, k_cache, *args, indices=indices, **kwargs)
    if int(indices.clamp_min(0).amax()) // k_cache.shape[1] % 2:
        _one_ulp(out)
    return out, lse


@pytest.mark.parametrize("claim", [True, False])
def test_a_sparse_kernel_is_held_to_its_claim_as_a_dense_one(claim: bool) -> None:
    """A sparse kernel of one's own: the pages relation is judged bit for bit only where it claims it (a moved bit
    then fails, named as the relation), else within tolerance (a moved bit is a note); a row reordered is judged
    within tolerance either way."""
    _pages_dependent.mla_verify_envelope = {"devices": ["cpu"], "bit_invariant": claim}  # type: ignore[attr-defined]
    backend = kernel_backend(_pages_dependent, "pages-dependent", "flashmla-sparse")
    spec = SparseSpec(batch=2, num_heads=2, topk=64, used_pages=3, extra_pages=2, seed=3)  # last page 3, moved to 4
    moved = run_case(backend, spec, SPARSE_LAYOUT, "cpu", "pages")
    if claim:
        assert moved.verdict == "fail" and moved.invariance == INVARIANT_BITS
        assert moved.reason.startswith("not bit-identical with the pool's pages permuted (indices renumbered): 1 of ")
        assert len(moved.diagnosis) == 1 and "the relation broke: with the pool's pages permuted" in moved.diagnosis[0]
    else:
        assert moved.verdict == "pass" and moved.invariance == INVARIANT_WITHIN_TOLERANCE, moved.failures
        # out is [batch 2, 1 token, 2 heads, 512]
        assert moved.notes == ["bits moved with the pool's pages permuted (indices renumbered), within tolerance (no "
                               "bit-level invariance claimed for it): 1 of 2048 output elements differ"]
    reordered = run_case(backend, spec, SPARSE_LAYOUT, "cpu", "topk_order")
    assert reordered.invariance == INVARIANT_WITHIN_TOLERANCE and not reordered.notes


def test_the_backends_claims() -> None:
    for name in ("flashmla", "flashmla-fp8"):  # whole-batch split-KV schedule
        assert get_backend(name).envelope.bit_invariant == tuple(r for r in RELATIONS if r != "batch"), name
    for name in ("fa2", "fa3", "fa-auto", "trtllm-gen", "cpu-peer"):
        assert get_backend(name).envelope.bit_invariant == RELATIONS, name
    for name in ("flashmla-sparse", "fa3-sparse", "trtllm-gen-sparse"):  # a row reordered: within tolerance anyway
        assert get_backend(name).envelope.bit_invariant == tuple(SPARSE_TRANSFORMS), name


def test_a_users_kernel_claims_nothing_unless_it_declares_it() -> None:
    assert kernel_backend(correct_kernel, "mine").envelope.bit_invariant == ()

    def declared(*args: Any, **kwargs: Any) -> Any:
        return correct_kernel(*args, **kwargs)

    for value, claim in ((True, RELATIONS), (False, ()), (["pages", "batch"], ("pages", "batch")), ([], ())):
        declared.mla_verify_envelope = {"bit_invariant": value}  # type: ignore[attr-defined]
        assert kernel_backend(declared, "mine").envelope.bit_invariant == claim
    declared.mla_verify_envelope = {"bit_invariant": ["batch", "order"]}  # type: ignore[attr-defined]
    with pytest.raises(UsageError, match="envelope field 'bit_invariant' must be true .* got \\['batch', 'order'\\]"):
        kernel_backend(declared, "mine")


def test_the_report_says_which_judgement_was_applied() -> None:
    cases = [SimpleNamespace(invariance=v, notes=n) for v, n in
             (("tolerance", ["moved"]), ("bits", []), ("bits", []), ("", []), ("tolerance", []))]
    counts = invariance_counts(cases)
    assert counts == {"tolerance": 2, "bits": 2, "moved": 1}
    assert invariance_line("flashmla", counts) == (
        "flashmla: metamorphic relations judged within tolerance (no bit-level claim) on 2 cases, bit for bit on 2; "
        "bits moved within tolerance on 1 (notes, not failures)")
    assert invariance_line("fa3", {"bits": 5}) is None
    assert invariance_line("fa3-sparse", {"tolerance": 1, "bits": 3}, "sparse") == (
        "fa3-sparse: metamorphic relations judged within tolerance (a row's reordered entries, or no bit-level claim) "
        "on 1 case, bit for bit on 3")


# --- acceptance (#38): a correct kernel that is not bit-invariant, with and without a claim ----------------------

def test_a_correct_kernel_without_bit_invariance_passes_premerge_and_a_fuzz() -> None:
    """precision_kernels.position_rounded rounds the requests at odd positions differently: reversing the batch
    moves bits, never values. Premerge and a seeded fuzz pass it; the moved bits are notes. (A 2-minute fuzz of it:
    docs/verified.md.)"""
    backend = kernel_backend(position_rounded, "precision_kernels:position_rounded")
    premerge = verify(backend, "cpu", "premerge")
    assert premerge.verdict == "pass", premerge.failure and premerge.failure.failures
    assert any(c.notes and c.metamorphic == "batch" for c in premerge.cases)
    fuzz = verify(backend, "cpu", "fuzz", seed=7, minutes=0.1)  # six seconds of it: the 2-minute run is recorded
    assert fuzz.verdict == "pass", fuzz.failure and fuzz.failure.failures
    assert all(c.invariance in ("", INVARIANT_WITHIN_TOLERANCE) for c in fuzz.cases)


def test_a_kernel_claiming_bit_invariance_it_lacks_fails_shrunk_with_the_relation_named() -> None:
    backend = kernel_backend(position_rounded_claiming_bits, "precision_kernels:position_rounded_claiming_bits")
    result = verify(backend, "cpu", "premerge")
    failure = result.failure
    assert result.verdict == "fail" and failure is not None
    assert failure.reason.startswith("not bit-identical with batch order reversed: ")
    # shrunk to the smallest batch a reversal can move: two requests, one head, one query token
    assert (failure.spec.batch, failure.spec.num_heads, failure.spec.q_len) == (2, 1, 1), failure.describe()
    block = "\n".join(failure_lines(failure, None))
    assert "the relation broke: with batch order reversed" in block and "KV positions" not in block, block


def test_an_isolated_case_keeps_its_notes_across_the_process_boundary() -> None:
    """A case judged in a worker comes back through result_header/decoded: every plain field it carries, the notes
    of bits moved within tolerance among them, must arrive (on CUDA, isolation is the default)."""
    import dataclasses

    from mla_verify.problems.generate import ProblemSpec
    from mla_verify.problems.layouts import LayoutSpec
    from mla_verify.run.harness import CaseResult
    from mla_verify.run.isolate import decoded, result_header

    sent = CaseResult("k", ProblemSpec(seq_lens=(3,)), LayoutSpec(), "batch", "pass", invariance="tolerance",
                      notes=["bits moved with batch order reversed, within tolerance"], resolved_backend="fa3")
    back = decoded("k", sent.spec, sent.layout, sent.metamorphic, json.loads(json.dumps(result_header(sent))), {})
    skipped = {"spec", "layout", "metamorphic", "backend", "problem", "out", "lse", "stats", "first_failing"}
    for f in dataclasses.fields(CaseResult):
        if f.name not in skipped:
            assert getattr(back, f.name) == getattr(sent, f.name), f.name
