"""The ranges where released MLA kernels broke (docs/judging.md, "Where kernels broke"): each is drawn, judged
soundly, and catches its kernel -- scores far from zero, split edges under the causal mask, requests of no KV
token, pages past 2^31 and 2^32 elements (here at scaled-down wrap points: the real ones are a GPU's,
tests/gpu/test_large_pool.py), and sparse rows whose first top-k blocks are all -1."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mla_verify.backends.base import INVARIANT_BITS, INVARIANT_WITHIN_TOLERANCE
from mla_verify.backends.cpu_peer import cpu_peer_backend
from mla_verify.backends.flashinfer_wrapper import FA_FP8_ARITHMETIC
from mla_verify.backends.flashmla import FLASHMLA_FP8_ARITHMETIC
from mla_verify.backends.trtllm_style import TRTLLM_ENVELOPE, TrtllmStyleBackend
from mla_verify.draw.edges import split_edges
from mla_verify.draw.strategies import budget_for, corner_cases
from mla_verify.judge.compare import baseline_result, compare
from mla_verify.kernels.flashmla_cpu import CPU_ENVELOPE, stand_in_backend
from mla_verify.kernels.mutants import MUTANTS, Faults, FaultyKernel, correct_kernel
from mla_verify.kinds.dense import DENSE_KIND, large_pool_reason
from mla_verify.problems import metamorphic
from mla_verify.problems.arithmetic import Arithmetic
from mla_verify.problems.generate import EXTREME_DOT, EXTREME_VALUES, ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.problems.metamorphic import LARGE_POOL, high_page_ids
from mla_verify.problems.reference import reference_decode
from mla_verify.run.engine import verify
from mla_verify.run.harness import NOT_BIT_IDENTICAL, SKIP_DEVICE, run_case

CORRECT = TrtllmStyleBackend("correct_kernel", correct_kernel)


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("values", EXTREME_VALUES)
def test_extreme_rows_are_far_from_any_sentinel_and_judged_as_tightly_as_normal_ones(values: str, dtype: str) -> None:
    spec = ProblemSpec((37, 100), q_len=2, num_heads=4, page_size=32, dtype=dtype, values=values, q_scale=2.0,
                       k_scale=0.5, seed=3)
    p = build_problem(spec)
    q, k = p.query.float(), p.kv_cache.float().flatten(0, 1)
    raw = torch.einsum("bqhd,td->bqht", q, k)
    raw = raw[torch.isfinite(raw)]  # the pool's unused (NaN) slots left out
    sign = -1 if values == "far_below" else 1
    assert bool((raw * sign >= EXTREME_DOT).all())
    if dtype == "fp8":  # the values the kernel multiplies are fp8's: within its range, no dequant scale divides them
        assert float(q.abs().max()) <= 448 and float(k[torch.isfinite(k)].abs().max()) <= 448
    # the offset is common to a row's keys, so the softmax cancels it: the baseline's relative error is that of
    # normal values on the same problem (within a small factor), not a loosened allowance
    rel = {}
    for kind in ("normal", values):
        problem = build_problem(dataclasses.replace(spec, values=kind))
        ref, base = reference_decode(problem), baseline_result(problem, dtype)
        rel[kind] = float((base.out.double() - ref.out).norm() / ref.out.norm())
    assert rel[values] < 4 * rel["normal"], rel
    assert run_case(CORRECT, spec, LayoutSpec(), "cpu", "pages").verdict == "pass"


def test_fp8_problems_are_not_drawn_at_the_extremes() -> None:
    """generate.py's FP8_VALUE_KINDS: at |q.k| >= 1.5e5 an fp8 kernel's error is not bounded by a multiple of its
    emulated baseline's (measured on an H100), so neither the corner cases nor the drawn ones go there in fp8; bf16
    ones still do."""
    from hypothesis import HealthCheck, given, settings

    budget = budget_for(torch.device("cpu"))
    fp8, bf16 = TRTLLM_ENVELOPE.narrowed(dtypes=("fp8",)), TRTLLM_ENVELOPE.narrowed(dtypes=("bf16",))
    assert not [c for c in corner_cases(fp8, budget) if c.spec.values in EXTREME_VALUES]
    assert {c.spec.values for c in corner_cases(bf16, budget)} >= set(EXTREME_VALUES)
    seen: set[str] = set()

    @settings(max_examples=150, database=None, derandomize=True, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(DENSE_KIND.cases(fp8, budget, True))
    def draw(case) -> None:  # type: ignore[no-untyped-def]
        seen.add(case.spec.values)

    draw()
    assert seen and not seen & set(EXTREME_VALUES), seen


def test_a_baseline_that_is_not_finite_fails_the_case_rather_than_every_bound_passing() -> None:
    """NaN fails no comparison: were the baseline NaN, every bound would be NaN and any output would pass."""
    problem = build_problem(ProblemSpec((9,), num_heads=2, page_size=32, seed=1))
    ref = reference_decode(problem)
    base = baseline_result(problem, "bf16")
    base.out[0, 0, 0, 0] = float("nan")
    _, failures = compare(ref.out.to(torch.bfloat16), None, ref, base, "bf16", None)
    assert any("is not finite on this problem" in f for f in failures), failures


def test_a_drawn_case_finds_the_finite_sentinel() -> None:
    """No corner case (the dev profile): one drawn case in seven has extreme values, and it is shrunk and named."""
    m = MUTANTS["finite_sentinel"]
    result = verify(TrtllmStyleBackend(m.name, m.fn), "cpu", "dev", max_examples=40)
    assert result.verdict == "fail" and result.failure is not None
    assert result.failure.spec.values == "far_below" and result.failure.spec.batch == 1, result.failure.describe()
    assert any(f"[{m.diagnosis}]" in d for d in result.failure.diagnosis), result.failure.diagnosis


def test_premerge_holds_sequences_just_past_each_split_size() -> None:
    cases = corner_cases(TRTLLM_ENVELOPE, budget_for("cpu"))
    q = 4  # trtllm's q_len 1..16: four query tokens, so rows 0..2 see none of a split that starts 1..3 back
    want = {s + d for s in (64, 128, 256, 512, 1024) for d in range(1, q)}
    assert any(set(c.spec.seq_lens) == want and c.spec.q_len == q for c in cases)
    assert split_edges((256,), 3, (1,)) == (255, 256, 257, 258)


def test_an_empty_split_unguarded_is_caught_at_a_256_token_split() -> None:
    kernel = FaultyKernel(Faults(guard_empty_split=False))
    spec = ProblemSpec((257, 40), q_len=2, num_heads=2, page_size=32)
    assert run_case(TrtllmStyleBackend("unguarded", kernel), spec, LayoutSpec(), "cpu").verdict == "fail"
    assert run_case(CORRECT, spec, LayoutSpec(), "cpu").verdict == "pass"


EMPTY = ProblemSpec((0, 37, 0, 100), q_len=2, num_heads=4, page_size=64, seed=4)


def test_an_empty_request_is_out_0_and_lse_minus_inf_in_the_reference() -> None:
    ref = reference_decode(build_problem(EMPTY))
    assert bool((ref.out[[0, 2]] == 0).all()) and bool(torch.isneginf(ref.lse[[0, 2]]).all())
    assert bool(torch.isfinite(ref.lse[[1, 3]]).all())


def test_empty_requests_are_judged_by_each_convention() -> None:
    assert TRTLLM_ENVELOPE.why_not(EMPTY, LayoutSpec()).endswith("a request with kv_len 0")  # not taken by default
    assert run_case(cpu_peer_backend(), EMPTY, LayoutSpec(), "cpu", "batch").verdict == "pass"  # -inf
    flashmla = stand_in_backend(correct_kernel, CPU_ENVELOPE)  # +inf, FlashMLA's
    assert run_case(flashmla, EMPTY, LayoutSpec(pass_out=False), "cpu").verdict == "pass"

    def finite_lse(*args, **kwargs):  # right, but a finite LSE for the empty requests' rows
        out, lse = cpu_peer_backend().fn(*args, **kwargs)
        return out, torch.nan_to_num(lse, neginf=0.0)

    wrong = TrtllmStyleBackend("finite_lse", finite_lse, cpu_peer_backend().envelope)
    result = run_case(wrong, EMPTY, LayoutSpec(), "cpu")
    assert result.verdict == "fail" and "LSE is not -inf at 16 of the 16 rows with no valid key" in result.failures


def test_empty_lse_convention_is_exact() -> None:
    problem = build_problem(EMPTY)
    ref, base = reference_decode(problem), baseline_result(problem, "bf16")
    lse2 = ref.lse / math.log(2.0)
    assert compare(ref.out, lse2, ref, base, "bf16", 2.0)[1] == []
    assert compare(ref.out, lse2, ref, base, "bf16", 2.0, empty_lse=math.inf)[1] == [
        "LSE is not +inf at 16 of the 16 rows with no valid key"]


@pytest.mark.parametrize("arithmetic", [FLASHMLA_FP8_ARITHMETIC, FA_FP8_ARITHMETIC["fa2"]], ids=lambda a: a.name)
def test_empty_requests_in_a_declared_arithmetic(arithmetic: Arithmetic) -> None:
    """A baseline that emulates a kernel's arithmetic computes the other requests, each with its own part of a
    split schedule made from the whole batch (FlashMLA's: the empty requests take their share of it too)."""
    problem = build_problem(dataclasses.replace(EMPTY, seq_lens=(0, 300, 0, 100), dtype="fp8"))
    ref, base = reference_decode(problem), baseline_result(problem, "fp8", arithmetic)
    assert bool((base.out[[0, 2]] == 0).all()) and bool(torch.isneginf(base.lse[[0, 2]]).all())
    assert compare(base.out, base.lse / math.log(2.0), ref, base, "fp8", 2.0, arithmetic.emulation)[1] == []


def test_high_pages_sit_past_both_wraps_and_across_them() -> None:
    stride = 36864  # 64 tokens of 576 values
    ids = high_page_ids(5, stride)
    starts = [i * stride for i in ids]
    assert starts[0] >= 2**32 > starts[2] and starts[2] + stride > 2**32  # past, and across, 2^32
    assert 2**32 > starts[1] >= 2**31 > starts[3] and starts[3] + stride > 2**31  # past, and across, 2^31
    assert len(set(ids)) == 5 and ids[0] == high_page_ids(1, stride)[0]


def test_a_cpu_run_skips_the_large_pool_with_its_reason() -> None:
    spec = ProblemSpec((37, 100), num_heads=2, page_size=32)
    result = run_case(CORRECT, spec, LayoutSpec(), "cpu", LARGE_POOL)
    assert result.verdict == "skip" and result.skip_kind == SKIP_DEVICE
    assert "pages past 2^32 elements need a 8.0 GiB pool" in result.reason and "a CPU run" in result.reason


def test_a_batch_of_empty_requests_is_sized_by_the_one_page_its_pool_has() -> None:
    """Every request empty: the pool still has a page (build_problem), which the large pool moves past 2^32
    elements. The memory estimate counted no page and raised inside an H200's isolated worker, ending the main
    job (results:h200/2026-12-06b/README.md, call2)."""
    spec = ProblemSpec((0, 0), num_heads=2, page_size=64, extra_pages=0)
    assert spec.pool_pages == build_problem(spec).num_pages == 1
    reason = large_pool_reason(spec, LayoutSpec(), torch.device("cpu"))
    # the one page goes first past 2^32 elements (high_page_ids): 2^32 bf16 values and a page, 8.0 GiB
    assert reason is not None and "need a 8.0 GiB pool" in reason and "a CPU run" in reason


@pytest.mark.parametrize("claimed", [True, False], ids=["bits claimed", "no claim"])
def test_offsets_kept_in_too_few_bits_are_caught_by_the_high_pages(monkeypatch: pytest.MonkeyPatch,
                                                                   claimed: bool) -> None:
    """The relation at wrap points of 2^16 and 2^17 elements (a pool of a few hundred kB): a kernel that keeps its
    element offsets in 17 bits reads other pages there. The relation moves data, not arithmetic: judged bit for bit
    where the backend claims it (the correct kernel gives the same bits), else within tolerance -- a page read from
    the wrong place fails either way."""
    monkeypatch.setattr(metamorphic, "WRAPS", (2**16, 2**17))
    relation = DENSE_KIND.relations[LARGE_POOL]
    monkeypatch.setitem(DENSE_KIND.relations, LARGE_POOL, dataclasses.replace(relation, why_not=None))
    envelope = TRTLLM_ENVELOPE if claimed else TRTLLM_ENVELOPE.narrowed(bit_invariant=())
    spec = ProblemSpec((37, 70), num_heads=2, page_size=32)  # pages of 32 x 576 = 18432 elements
    right = run_case(TrtllmStyleBackend("correct_kernel", correct_kernel, envelope), spec, LayoutSpec(), "cpu",
                     LARGE_POOL)
    assert right.verdict == "pass" and not right.notes
    assert right.invariance == (INVARIANT_BITS if claimed else INVARIANT_WITHIN_TOLERANCE)
    short = TrtllmStyleBackend("offsets_17bit", FaultyKernel(Faults(offset_bits=17)), envelope)
    assert run_case(short, spec, LayoutSpec(), "cpu").verdict == "pass"  # a small pool: right
    result = run_case(short, spec, LayoutSpec(), "cpu", LARGE_POOL)
    assert result.verdict == "fail", result.reason
    assert result.reason.startswith(f"{NOT_BIT_IDENTICAL} with the pages moved" if claimed else
                                    "with the pages moved past 2^31 and 2^32 elements of a NaN-filled pool (judged "
                                    "within tolerance: the kernel claims no bit-level invariance for it): "), \
        result.reason
