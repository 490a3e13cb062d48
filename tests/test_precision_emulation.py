"""A kernel is judged against a baseline in its declared arithmetic (problems/arithmetic.py, judge/emulation.py).

- The emulation is the declared arithmetic: it gives the bits of ``precision_kernels.declared_kernel``, which
  makes the same roundings per request and per block and shares no code with it.
- A kernel that rounds exactly as it declares passes; one that rounds one step more than it declares fails, on
  a problem where that step shows (an fp8 output path where the values are near-constant or there is one key;
  e4m3 probabilities where a kernel declares bf16 ones, on unit-normal values) -- the plain baseline, which
  assumes e4m3 probabilities for every fp8 kernel, let the latter through.
- The declarations are the kernels' source: FlashMLA's dense fp8 (and its split schedule, against the schedule
  the wheel returned on an H200), FlashInfer fa2/fa3 with an fp8 cache, fa-auto by the kernel it resolved to.
- Hopper's fp8 accumulation model truncates each step's terms below the largest one's leading bit.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from precision_kernels import declared_kernel

from mla_verify.backends import get_backend
from mla_verify.backends.flashinfer_wrapper import FA_FP8_ARITHMETIC
from mla_verify.backends.flashmla import FLASHMLA_FP8_ARITHMETIC, flashmla_fp8_splits, splits_from_metadata
from mla_verify.backends.trtllm_style import TRTLLM_ENVELOPE, TrtllmStyleBackend
from mla_verify.judge.compare import baseline_result
from mla_verify.judge.emulation import accumulate
from mla_verify.problems.arithmetic import DEFAULT, REVERSE, SCALE_ON_SCORES, SUM_FP32, SUM_ROUNDED, Accumulator
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.run.harness import run_case

ENVELOPE = TRTLLM_ENVELOPE.narrowed(devices=("cpu",), page_sizes=(64,), dims=((512, 64),), dtypes=("fp8",),
                                    cache_dims=(3,), q_len=(1, 1), heads=None, max_heads=16)
LAYOUT = LayoutSpec(return_lse=True)
# near-constant values at the fuzz failure's length (513: a split of one key past 8 full blocks), one key per
# request with non-power-of-two scales, unit-normal values over several splits, outliers
CONSTANT = ProblemSpec(seq_lens=(513,), num_heads=1, dtype="fp8", q_scale=0.2977, values="constant", seed=2)
ONE_KEY = ProblemSpec(seq_lens=(1, 1, 1), num_heads=3, dtype="fp8", q_scale=2.0, k_scale=4.33, seed=3)
NORMAL = ProblemSpec(seq_lens=(700, 65, 130), num_heads=4, dtype="fp8", q_scale=0.5, k_scale=0.7, bmm2_extra=1.3,
                     seed=4)
OUTLIERS = ProblemSpec(seq_lens=(300, 64), num_heads=2, dtype="fp8", values="outliers", seed=6)
DECLARED = {"flashmla-fp8": FLASHMLA_FP8_ARITHMETIC, "fa2-fp8": FA_FP8_ARITHMETIC["fa2"],
            "fa3-fp8": FA_FP8_ARITHMETIC["fa3"]}


def _backend(name: str, extra: str | None = None) -> TrtllmStyleBackend:
    backend = TrtllmStyleBackend(name, declared_kernel(DECLARED[name], extra), ENVELOPE)
    backend.arithmetic = {"fp8": DECLARED[name]}
    return backend


@pytest.mark.parametrize("name", sorted(DECLARED))
@pytest.mark.parametrize("spec", [CONSTANT, ONE_KEY, NORMAL, OUTLIERS], ids=["constant", "one_key", "normal",
                                                                          "outliers"])
def test_the_emulation_gives_the_declared_kernels_bits(name: str, spec: ProblemSpec) -> None:
    problem = build_problem(spec)
    emulated = baseline_result(problem, "fp8", DECLARED[name])
    prepared = _backend(name).prepare(problem, LAYOUT)
    out, lse = prepared.to_canonical(prepared.invoke())
    # the same roundings in another order of fp32 sums (a batched product against a per-request one): a P on a
    # rounding boundary may fall the other way, so all but a few elements are bit-identical, none off by more
    # than 1% of the output's scale, and the LSE agrees to fp32 rounding
    same = (emulated.out == out).double().mean()
    assert same > 0.99, f"{same:.4f} of the output bit-identical"
    assert float((emulated.out.double() - out.double()).abs().max()) <= 1e-2 * float(out.double().abs().max())
    assert torch.allclose(emulated.lse, lse * math.log(2.0), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", sorted(DECLARED))
def test_a_kernel_that_rounds_as_it_declares_passes(name: str) -> None:
    for spec in (CONSTANT, ONE_KEY, NORMAL, OUTLIERS):
        result = run_case(_backend(name), spec, LAYOUT, "cpu", diagnose=False)
        assert result.verdict == "pass", (spec.describe(), result.failures)
        assert result.stats is not None and result.stats.emulation == DECLARED[name].name


@pytest.mark.parametrize("name,extra,spec", [
    ("flashmla-fp8", "out_e4m3", CONSTANT), ("flashmla-fp8", "out_e4m3", ONE_KEY),
    ("fa2-fp8", "p_e4m3", NORMAL), ("fa3-fp8", "p_e4m3", NORMAL), ("fa3-fp8", "out_e4m3", ONE_KEY)])
def test_a_kernel_that_rounds_one_step_more_than_it_declares_fails(name: str, extra: str, spec: ProblemSpec) -> None:
    result = run_case(_backend(name, extra), spec, LAYOUT, "cpu", diagnose=False)
    assert result.verdict == "fail" and "> allowed" in result.reason, result.failures
    assert f"baseline (emulating {DECLARED[name].name})" in result.reason  # which emulation judged it


def test_the_plain_baseline_let_e4m3_probabilities_through_a_bf16_kernel() -> None:
    """Before #38 an fp8 kernel was held to e4m3 probabilities whatever it computed with: fa3's arithmetic with P
    in e4m3 passed. Its declaration (bf16 P) catches it (the test above)."""
    plain = TrtllmStyleBackend("fa3-fp8-undeclared", declared_kernel(FA_FP8_ARITHMETIC["fa3"], "p_e4m3"), ENVELOPE)
    assert run_case(plain, NORMAL, LAYOUT, "cpu", diagnose=False).verdict == "pass"


def test_the_backends_declare_their_sources_arithmetic() -> None:
    flashmla = get_backend("flashmla-fp8")
    assert flashmla.arithmetic_for("fp8") is FLASHMLA_FP8_ARITHMETIC
    assert get_backend("flashmla").arithmetic_for("bf16") == DEFAULT
    a = FLASHMLA_FP8_ARITHMETIC  # sgl-project/FlashMLA csrc/extension/sm90/dense_fp8 (backends/flashmla.py)
    assert (a.scale, a.p_dtype, a.p_block, a.order, a.row_sum) == (SCALE_ON_SCORES, "e4m3", 64, REVERSE, SUM_FP32)
    assert a.qk == a.pv == Accumulator(k_step=32, bits=13) and a.splits is flashmla_fp8_splits
    fa2, fa3 = FA_FP8_ARITHMETIC["fa2"], FA_FP8_ARITHMETIC["fa3"]  # FlashInfer 0.7.4 mla.cuh, mla_hopper.cuh
    assert (fa2.p_dtype, fa2.p_block, fa2.row_sum) == ("bf16", 32, SUM_ROUNDED)
    assert (fa3.p_dtype, fa3.p_block, fa3.row_sum) == ("bf16", 64, SUM_FP32)
    assert get_backend("fa2").arithmetic_for("fp8") is fa2 and get_backend("fa3").arithmetic_for("fp8") is fa3
    auto = get_backend("fa-auto")
    assert auto.arithmetic_for("fp8", "fa2") is fa2 and auto.arithmetic_for("fp8", "fa3") is fa3
    assert auto.arithmetic_for("bf16", "fa3") == DEFAULT  # bf16 caches: the calibrated plain baseline


def test_the_schedule_port_is_the_wheels_schedule() -> None:
    """flashmla_fp8_splits against what get_mla_decoding_metadata returned on an H200 (tests/
    flashmla_fp8_schedules.json): the same splits, and the split counts of num_splits."""
    recorded = json.loads((Path(__file__).parent / "flashmla_fp8_schedules.json").read_text())["sets"]
    for name, s in recorded.items():
        splits = splits_from_metadata(s["tile_scheduler_metadata"], s["seq_lens"])
        assert flashmla_fp8_splits(s["seq_lens"], s["rows_per_kv_head"], s["sm_count"]) == splits, name
        counts = [b - a for a, b in zip(s["num_splits"], s["num_splits"][1:])]
        assert [len(x) for x in splits] == counts, name


def test_the_fp8_accumulator_truncates_each_term_below_the_largest() -> None:
    model = Accumulator(k_step=4, bits=3)
    acc = torch.tensor([[8.0]])  # the largest term: its leading bit 2^3, so units of 2^(3 - 3) = 1
    a = torch.tensor([[1.0, 1.0, -1.0, 1.0]])
    b = torch.tensor([[0.75], [1.5], [1.5], [3.0]])
    # 0.75 -> 0, 1.5 -> 1, -1.5 -> -1 (toward zero), 3 -> 3: 8 + 3 = 11, where exact sums give 8 + 3.75
    assert accumulate(acc, a, b, model).item() == 11.0
    # a second step starts from that sum: 11 has its leading bit at 2^3 too, and 0.5 is truncated away
    a2, b2 = torch.tensor([[1.0] * 8]), torch.tensor([[0.75]] * 4 + [[0.5]] * 4)
    assert accumulate(acc, a2, b2, model).item() == 8.0
    # wide enough, the model is the exact sum
    wide = Accumulator(k_step=4, bits=40)
    assert accumulate(acc, a, b, wide).item() == 8.0 + 3.75


def test_the_fp8_accumulator_stays_finite_near_fp32s_smallest_numbers() -> None:
    """An accumulator rescaled down to a subnormal (its running max far above a later block's): its unit of
    truncation would be 2^-155, which fp32 rounds to 0, and 0/0 made one output element NaN on an H200 (a fuzz
    case with outlier values and a 16385-key request, results:h200/2026-12-06b/README.md, call3)."""
    model = Accumulator(k_step=4, bits=13)
    acc = torch.tensor([[2.0 ** -142]])  # leading bit 2^-142: units of 2^-155 unclamped
    a, b = torch.tensor([[0.0, 0.0, 0.0, 0.0]]), torch.tensor([[1.0]] * 4)
    got = accumulate(acc, a, b, model).item()
    assert math.isfinite(got)
    # kept to fp32's own floor, 2^-149: the accumulator's 2^-142 is a whole number of such units
    assert got == 2.0 ** -142
