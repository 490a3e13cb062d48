"""Batch-order invariance is judged by each backend's claim (``Backend.batch_invariance``).

A kernel whose bits move with the batch order but whose values stay right -- what FlashMLA's whole-batch split-KV
schedule does -- fails a bit-level claim and passes a tolerance claim; a kernel that is *wrong* in one batch
order fails either way. The case records which judgement was applied, and so do the report and ``check``.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mla_verify.backends import get_backend
from mla_verify.backends.base import INVARIANT_BITS, INVARIANT_WITHIN_TOLERANCE
from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.kernels.mutants import correct_kernel
from mla_verify.problems.generate import ProblemSpec
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.records.report import invariance_counts, invariance_line
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


def _backend(nudge: Any, claim: str) -> TrtllmStyleBackend:
    backend = TrtllmStyleBackend(f"order-dependent-{claim}", _order_dependent(nudge))
    backend.batch_invariance = claim
    return backend


def test_order_dependent_bits_fail_a_bit_level_claim() -> None:
    result = run_case(_backend(_one_ulp, INVARIANT_BITS), SPEC, LayoutSpec(), "cpu", transform="batch")
    assert result.verdict == "fail" and result.invariance == INVARIANT_BITS
    assert "not bit-identical with batch order reversed" in result.reason


def test_order_dependent_bits_pass_a_tolerance_claim() -> None:
    result = run_case(_backend(_one_ulp, INVARIANT_WITHIN_TOLERANCE), SPEC, LayoutSpec(), "cpu", transform="batch")
    assert result.verdict == "pass", result.failures
    assert result.invariance == INVARIANT_WITHIN_TOLERANCE and result.to_json()["invariance"] == "tolerance"


def test_a_wrong_result_in_one_order_fails_a_tolerance_claim() -> None:
    result = run_case(_backend(_ten_percent, INVARIANT_WITHIN_TOLERANCE), SPEC, LayoutSpec(), "cpu",
                      transform="batch", diagnose=False)
    assert result.verdict == "fail"
    assert "batch order reversed (judged within tolerance, the backend's claim)" in result.reason


@pytest.mark.parametrize("transform", ["pages", "table"])
def test_a_tolerance_claim_covers_the_batch_order_only(transform: str) -> None:
    """Page moves and table widths do not reach a schedule: they stay bit for bit under either claim."""
    result = run_case(_backend(_one_ulp, INVARIANT_WITHIN_TOLERANCE), SPEC, LayoutSpec(), "cpu", transform=transform)
    assert result.verdict == "pass" and result.invariance == INVARIANT_BITS


def test_the_backends_claims() -> None:
    assert get_backend("flashmla").batch_invariance == INVARIANT_WITHIN_TOLERANCE  # whole-batch split-KV schedule
    assert get_backend("flashmla-fp8").batch_invariance == INVARIANT_WITHIN_TOLERANCE
    for name in ("fa2", "fa3", "fa-auto", "trtllm-gen", "cpu-peer"):
        assert get_backend(name).batch_invariance == INVARIANT_BITS, name


def test_the_report_says_which_judgement_was_applied() -> None:
    cases = [SimpleNamespace(invariance=v) for v in ("tolerance", "bits", "bits", "", "tolerance")]
    counts = invariance_counts(cases)
    assert counts == {"tolerance": 2, "bits": 2}
    assert invariance_line("flashmla", counts) == ("flashmla: batch order judged within tolerance (its claim) on "
                                                   "2 cases, the other metamorphic checks bit for bit on 2")
    assert invariance_line("fa3", {"bits": 5}) is None
