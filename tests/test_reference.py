"""The reference, checked against three forms that share none of its code path.

(a) the unabsorbed MHA form (expanded k_nope and v, head dim 192, value dim 128) projected through W_UV;
(b) a naive float64 loop over batch, query token, head and KV position (tests/oracles.py);
(c) torch's scaled_dot_product_attention with an explicit bottom-right causal mask (tests/oracles.py).
Each is run across both dim presets, page sizes 1/16/32/64, q_len 1-4 and boundary lengths (1, page-1, page,
page+1). ``test_checks_have_teeth`` shows every check rejects a reference fed a subtly wrong problem.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from oracles import F64_TOL, naive_errors, row_rel_err, sdpa_decode

from mla_verify.core.dims import R1_SOFTMAX_SCALE
from mla_verify.judge.selfcheck import absorbed_problem, unabsorbed_error
from mla_verify.problems import reference
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.problem import DecodeProblem
from mla_verify.problems.reference import reference_decode

DIMS = (512, 256)  # kv_lora_rank of the two presets; qk_rope_head_dim is 64 for both
PAGES = (1, 16, 32, 64)
Q_LENS = (1, 2, 3, 4)
GRID = list(itertools.product(DIMS, PAGES, Q_LENS))
GRID_IDS = [f"L{rank}-page{page}-q{q}" for rank, page, q in GRID]


def boundary_lengths(page: int, q_len: int) -> tuple[int, ...]:
    """1, page-1, page, page+1 and a multi-page length -- those a q_len-token query can have."""
    candidates = {1, q_len, page - 1, page, page + 1, 3 * page + 2}
    return tuple(sorted(n for n in candidates if n >= q_len))


def boundary_spec(rank: int, page: int, q_len: int, **changes) -> ProblemSpec:
    spec = ProblemSpec(seq_lens=boundary_lengths(page, q_len), q_len=q_len, num_heads=3, page_size=page,
                       kv_lora_rank=rank, extra_pages=2, table_pad=1, pad_fill="oob",
                       bmm2_extra=0.75,  # != 1, so a reference that drops bmm2 is caught everywhere
                       seed=rank + 100 * page + 10 * q_len)
    return dataclasses.replace(spec, **changes)


# -- (a) the unabsorbed MHA form --------------------------------------------------------------------------

@pytest.mark.parametrize("rank,page,q_len", GRID, ids=GRID_IDS)
def test_matches_unabsorbed_mha_form(rank: int, page: int, q_len: int) -> None:
    p, q_nope, w_uk, w_uv = absorbed_problem(boundary_spec(rank, page, q_len, dtype="fp64", num_heads=4))
    assert unabsorbed_error(p, q_nope, w_uk, w_uv) < F64_TOL


# -- (b) a naive float64 loop ---------------------------------------------------------------------------

@pytest.mark.parametrize("rank,page,q_len", GRID, ids=GRID_IDS)
def test_matches_naive_loop(rank: int, page: int, q_len: int) -> None:
    p = build_problem(boundary_spec(rank, page, q_len, num_heads=2))
    ref = reference_decode(p)
    assert bool(torch.isfinite(ref.out).all()) and bool(torch.isfinite(ref.lse).all())
    # LSEs are O(1-10) here, so the same bound holds for them absolutely; NaN fails every comparison
    assert all(err < F64_TOL for err in naive_errors(ref, p))


# -- (c) torch's scaled_dot_product_attention -------------------------------------------------------------

@pytest.mark.parametrize("rank,page,q_len", GRID, ids=GRID_IDS)
def test_matches_sdpa(rank: int, page: int, q_len: int) -> None:
    p = build_problem(boundary_spec(rank, page, q_len, num_heads=4))
    assert row_rel_err(reference_decode(p).out, sdpa_decode(p)) < F64_TOL


@pytest.mark.parametrize("q_len", [1, 4])
def test_no_rope_dims_match_all_three_forms(q_len: int) -> None:
    """(512, 0): FlashInfer's fa2/fa3 take head_dim_kpe = 0 -- rows are the latent alone."""
    spec = boundary_spec(512, 16, q_len, num_heads=3, qk_rope_head_dim=0)
    p = build_problem(spec)
    assert p.query.shape[-1] == 512 and all(err < F64_TOL for err in naive_errors(reference_decode(p), p))
    assert row_rel_err(reference_decode(p).out, sdpa_decode(p)) < F64_TOL
    assert unabsorbed_error(*absorbed_problem(dataclasses.replace(spec, dtype="fp64"))) < F64_TOL


# -- fp8, other value distributions and scales -----------------------------------------------------------

FP8_CASES = [(rank, page, q_len) for rank in DIMS for page in (32, 64) for q_len in (1, 4)]


@pytest.mark.parametrize("rank,page,q_len", FP8_CASES, ids=[f"L{r}-page{p}-q{q}" for r, p, q in FP8_CASES])
def test_fp8_problem_matches_dequantized_forms(rank: int, page: int, q_len: int) -> None:
    # fp8 values with non-unit dequant scales: bmm1 = q_scale * k_scale * softmax_scale, bmm2 = k_scale
    p = build_problem(boundary_spec(rank, page, q_len, dtype="fp8", q_scale=0.25, k_scale=3.0, values="outliers"))
    ref = reference_decode(p)
    assert all(err < F64_TOL for err in naive_errors(ref, p))
    assert row_rel_err(ref.out, sdpa_decode(p)) < F64_TOL


@pytest.mark.parametrize("values", ["large", "constant", "outliers"])
def test_value_distributions_and_yarn_scale(values: str) -> None:
    # R1's YaRN scale on peaked, nearly uniform and spiky softmaxes
    spec = boundary_spec(512, 16, 2, values=values, softmax_scale=R1_SOFTMAX_SCALE)
    p = build_problem(spec)
    ref = reference_decode(p)
    assert all(err < F64_TOL for err in naive_errors(ref, p))
    assert row_rel_err(ref.out, sdpa_decode(p)) < F64_TOL


def test_lse_bases_are_consistent_and_distinct() -> None:
    # base-2 LSE = base-e LSE / ln 2: confusing them is off by ~40%, far outside any tolerance
    ref = reference_decode(build_problem(boundary_spec(512, 32, 1)))
    # rtol 1e-12: exp of a float64 LSE of size ~10 is off by ~10 * 2^-52 relative
    assert torch.allclose(torch.exp2(ref.lse_base2), torch.exp(ref.lse), rtol=1e-12, atol=0)
    assert float((ref.lse_base2 - ref.lse).abs().min()) > 0.1


# -- chunking and precision ------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk_bytes", [1, 1 << 18])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_chunking_does_not_change_a_bit(chunk_bytes: int, dtype: str) -> None:
    # ragged and unsorted: the default chunk takes every sequence in one padded group, chunk_bytes=1 one group
    # per sequence, 256 KiB a few groups of a few sequences each. Padding only adds exact zeros to each sum,
    # so the bits must not move (checked on CPU; a GPU BLAS may pick shape-dependent reduction orders).
    spec = ProblemSpec(seq_lens=(70, 2, 300, 64, 65, 129, 3, 200), q_len=2, num_heads=4, page_size=32,
                       dtype=dtype, table_pad=3, extra_pages=4, seed=5)
    p = build_problem(spec)
    whole, chunked = reference_decode(p), reference_decode(p, chunk_bytes=chunk_bytes)
    assert torch.equal(whole.out, chunked.out)
    assert torch.equal(whole.lse, chunked.lse)


def test_length_groups_do_not_change_a_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    # without the small-group floor the 70%-of-the-longest rule cuts these lengths into several groups, each
    # padded to its own longest; padding adds exact zeros, so the bits must not move (CPU, as above)
    spec = ProblemSpec(seq_lens=(900, 2, 300, 640, 65, 129, 3, 200), q_len=2, num_heads=4, page_size=16, seed=9)
    p = build_problem(spec)
    whole = reference_decode(p)
    monkeypatch.setattr(reference, "MIN_GROUP_BYTES", 0)
    lens = sorted(spec.seq_lens, reverse=True)
    assert len(list(reference._groups(lens, 16, 1, 1 << 40))) >= 5  # 900 640 | 300 | 200 | 129 | 65 | 3 2
    grouped = reference_decode(p)
    assert torch.equal(whole.out, grouped.out)
    assert torch.equal(whole.lse, grouped.lse)


def test_a_group_takes_a_small_rest_only_when_it_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    # page 1 and one byte a token, so lengths are bytes: after [1000, 900] the rest (100, 20, 10) would form two
    # groups under the 100-byte floor ([100] | [20, 10]). The group of 100 takes them all when its chunk has
    # room for every sequence left (one group's launches saved). With room for only two (a 200-byte chunk) it
    # takes none: taking 20 would leave 10 alone, a group saved nowhere and padding added.
    monkeypatch.setattr(reference, "MIN_GROUP_BYTES", 100)
    lens = [1000, 900, 100, 20, 10]

    def groups(chunk_bytes: int) -> list[list[int]]:
        return [lens[start:stop] for start, stop, _ in reference._groups(lens, 1, 1, chunk_bytes)]
    assert groups(1 << 40) == [[1000, 900], [100, 20, 10]]
    assert groups(200) == [[1000], [900], [100], [20, 10]]


def test_tf32_set_through_the_new_api_is_overridden_and_restored() -> None:
    # PyTorch >= 2.9 raises when the legacy allow_tf32 flag is read after fp32_precision was set; the reference
    # must neither crash on that nor leave its own setting behind
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "fp32_precision"):
        pytest.skip("this PyTorch has no fp32_precision setting")
    saved = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        p = build_problem(boundary_spec(512, 16, 2))
        assert all(err < F64_TOL for err in naive_errors(reference_decode(p), p))
        assert matmul.fp32_precision == "tf32"
    finally:
        matmul.fp32_precision = saved


@pytest.mark.parametrize("seq_len", [1, 100, 4096, 16384])
def test_float32_precision_within_documented_bound(seq_len: int) -> None:
    # reference.py documents the float32 mode as "below 1e-5" relative for T <= 64k tokens; outliers and the
    # R1 scale give the largest scores (and so the largest exp() error) our generator makes
    spec = ProblemSpec(seq_lens=(seq_len, max(1, seq_len // 3)), num_heads=4, page_size=64, values="outliers",
                       softmax_scale=R1_SOFTMAX_SCALE, seed=seq_len)
    p = build_problem(spec)
    exact, fast = reference_decode(p), reference_decode(p, precision=torch.float32)
    assert fast.out.dtype == torch.float32
    assert row_rel_err(fast.out, exact.out) < 1e-5
    # float32 holds an LSE of magnitude m only to ~m * 2^-24, so the LSE bound is relative once |lse| > 1
    lse_err = (fast.lse.double() - exact.lse).abs() / exact.lse.abs().clamp(min=1.0)
    assert float(lse_err.max()) < 1e-5


@pytest.mark.parametrize("chunk_bytes", [None, 1 << 16], ids=["one-group", "groups"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_fast_mode_within_its_bound(chunk_bytes: int | None, dtype: str) -> None:
    # The GPU harness's mode (bf16 products, fp32 sums, probabilities as two bf16 halves summed after the
    # product), here on CPU so CI runs its code path: a 64 KiB chunk makes several groups, and bmm2 is 0.75
    # (2.25 for fp8). Bound 3e-5 (2^-15): the halves hold each probability to 2^-17 and the fp32 sums over <= 304
    # positions add ~1e-6; measured 2.0e-6 and 2.2e-6. Dropping the low half gives 1.4e-3.
    extra = {"q_scale": 0.25, "k_scale": 3.0} if dtype == "fp8" else {}
    spec = ProblemSpec(seq_lens=(300, 3, 129, 64, 65, 17, 200), q_len=3, num_heads=8, page_size=16, dtype=dtype,
                       table_pad=2, extra_pages=3, bmm2_extra=0.75, seed=7, **extra)
    p = build_problem(spec)
    exact = reference_decode(p)
    fast = reference_decode(p, torch.float32, chunk_bytes=chunk_bytes, matmul="bf16-split")
    assert fast.out.dtype == torch.float32
    assert float((fast.out.double() - exact.out).norm() / exact.out.norm()) < 3e-5
    # an fp32 LSE of magnitude m is held to ~m * 2^-24 (as in the float32 test above)
    lse_err = (fast.lse.double() - exact.lse).abs() / exact.lse.abs().clamp(min=1.0)
    assert float(lse_err.max()) < 1e-5


# -- the checks have teeth -------------------------------------------------------------------------------

WRONG_SCALE = 1 / math.sqrt(576)  # the classic MLA bug: the absorbed row width instead of nope + rope


def _shorter_by_one(p: DecodeProblem) -> DecodeProblem:
    lens = p.seq_lens.clone()
    lens[-1] -= 1  # the longest sequence loses its last token (an off-by-one in the length)
    return dataclasses.replace(p, seq_lens=lens)


MISREADINGS = {
    "scale 1/sqrt(576)": lambda p: dataclasses.replace(p, bmm1_scale=WRONG_SCALE),
    "bmm2 scale dropped": lambda p: dataclasses.replace(p, bmm2_scale=1.0),
    "seq_len off by one": _shorter_by_one,
}


@pytest.mark.parametrize("misreading", list(MISREADINGS))
def test_checks_have_teeth(misreading: str) -> None:
    """A reference that sees a subtly wrong problem is rejected by all three independent checks."""
    wrong = MISREADINGS[misreading]
    spec = boundary_spec(512, 16, 2)
    p, q_nope, w_uk, w_uv = absorbed_problem(dataclasses.replace(spec, dtype="fp64"))
    assert 1 / math.sqrt(192) == pytest.approx(p.bmm1_scale, rel=1e-15)  # the right scale, which the mutant replaces
    # each misreading moves results by > 1e-4, six orders of magnitude above the tolerance the checks use
    assert unabsorbed_error(p, q_nope, w_uk, w_uv, reference_problem=wrong(p)) > F64_TOL * 1e6
    assert max(naive_errors(reference_decode(wrong(p)), p)) > F64_TOL * 1e6
    assert row_rel_err(reference_decode(wrong(p)).out, sdpa_decode(p)) > F64_TOL * 1e6
