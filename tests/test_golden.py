"""Known-answer tests: the committed golden problems and their float64 answers (fixtures/golden/)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from oracles import naive_decode

from mla_verify.backends import get_backend
from mla_verify.judge.compare import baseline_result, compare
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.problems.reference import ReferenceResult, reference_decode
from mla_verify.records.fixtures import load_fixture
from mla_verify.records.golden import GOLDEN

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "golden"
# The reference recomputed in float64 on any CPU: only the summation order of the BLAS may differ.
# Outputs are convex combinations of O(1) values over <= 200 tokens, so rounding is ~200 * 2^-53 ~ 2e-14;
# 1e-12 leaves 50x for that and still catches any real change (a wrong scale moves answers by > 1e-3).
SAME_MATH_TOL = 1e-12
# The naive per-token loop (tests/oracles.py) sums in a different order again (one dot product at a time): same bound.
NAIVE_TOL = 1e-12


@pytest.fixture(scope="module", params=sorted(GOLDEN))
def golden(request):
    return load_fixture(GOLDEN_DIR / request.param)


def test_committed_set_matches_the_script():
    assert sorted(p.stem for p in GOLDEN_DIR.glob("*.json")) == sorted(GOLDEN)


def test_golden_metadata(golden):
    assert golden.spec == GOLDEN[golden.meta["name"]]
    assert golden.tensors["ref_out"].dtype == torch.float64


def test_reference_reproduces_the_stored_answer(golden):
    ref = reference_decode(golden.problem, precision=torch.float64)
    assert (ref.out - golden.tensors["ref_out"]).abs().max().item() <= SAME_MATH_TOL
    assert (ref.lse - golden.tensors["ref_lse"]).abs().max().item() <= SAME_MATH_TOL


def test_stored_answer_matches_the_naive_definition(golden):
    out, lse, _ = naive_decode(golden.problem)
    assert (out - golden.tensors["ref_out"]).abs().max().item() <= NAIVE_TOL
    assert (lse - golden.tensors["ref_lse"]).abs().max().item() <= NAIVE_TOL


def test_cpu_peer_matches_the_stored_answer(golden):
    """An independent kernel-style implementation agrees with the stored answer within the tolerance model."""
    backend = get_backend("cpu-peer")
    prepared = backend.prepare(golden.problem, LayoutSpec())
    out, lse = prepared.to_canonical(prepared.invoke())
    stored = ReferenceResult(golden.tensors["ref_out"], golden.tensors["ref_lse"])
    baseline = baseline_result(golden.problem, golden.spec.dtype)
    stats, failures = compare(out, lse, stored, baseline, golden.spec.dtype, backend.envelope.lse_base)
    assert failures == [], failures
    assert stats.error_ratio < 1
