"""The tolerance model's floor: a baseline that happens to be very accurate does not make a correct kernel fail."""
from __future__ import annotations

import math

import torch

from mla_verify.judge.compare import _expected_bf16_rounding, compare, lse_allowed
from mla_verify.judge.localize import localize
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.reference import reference_decode

# heavy-tailed values: a few large outputs dominate the norm, where the baseline's luck was seen on an H200
SPEC = ProblemSpec(seq_lens=(63, 198), num_heads=1, page_size=64, bmm2_extra=1.5625, values="outliers", seed=7)


def test_expected_rounding_matches_rounding_to_bf16():
    r = torch.randn(200_000, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3
    actual = float((r.to(torch.bfloat16).double() - r).norm())
    assert abs(float(_expected_bf16_rounding(r)) - actual) < 0.01 * actual  # 2e5 samples: ~0.3% spread


def test_an_exact_baseline_does_not_fail_a_kernel_that_only_rounds_its_output():
    ref = reference_decode(build_problem(SPEC))
    exact_baseline = ref  # the luckiest baseline there can be: no error at all
    kernel = ref.out.to(torch.bfloat16)  # a perfect kernel: the exact answer, rounded to its bf16 output
    stats, failures = compare(kernel, None, ref, exact_baseline, "bf16", None)
    assert not failures, failures


def test_the_floor_still_fails_a_wrong_scale():
    problem = build_problem(SPEC)
    ref = reference_decode(problem)
    wrong = reference_decode(problem.__class__(**{**problem.__dict__, "bmm1_scale": problem.bmm1_scale * 1.05}))
    stats, failures = compare(wrong.out.to(torch.bfloat16), None, ref, ref, "bf16", None)
    assert any("relative L2" in f for f in failures), failures


def _lse_case():
    # large scores (peaked queries, a big softmax scale): rounding q * scale to bf16 moves the LSE past 2e-3
    problem = build_problem(ProblemSpec(seq_lens=(40, 300), q_len=2, num_heads=4, page_size=64, values="large",
                                        softmax_scale=0.3, seed=11))
    from mla_verify.judge.compare import baseline_result
    return problem, reference_decode(problem), baseline_result(problem, "bf16")


def test_an_lse_as_far_off_as_the_baselines_passes_and_a_base_mixup_fails():
    problem, ref, base = _lse_case()
    base_err = float((base.lse.double() - ref.lse).abs().max())
    assert base_err > 2e-3  # the fixed bound alone would fail a kernel that rounds like the baseline
    kernel_lse = ref.lse + 2 * (base.lse.double() - ref.lse)  # twice the baseline's LSE error, base e -> 2 below
    out = ref.out.to(torch.bfloat16)
    _, failures = compare(out, kernel_lse / math.log(2), ref, base, "bf16", 2.0)
    assert not failures, failures
    assert bool(((kernel_lse - ref.lse).abs() > lse_allowed(ref.lse, 0.0)).any())  # past the fixed part alone
    _, mixup = compare(out, kernel_lse, ref, base, "bf16", 2.0)  # natural log where base 2 is due
    assert any("LSE" in f for f in mixup)
    # the localization of a failure reads the same bound: it does not call this LSE wrong
    assert not any("LSE" in line for line in localize(problem, out, ref, kernel_lse / math.log(2), 2.0))
