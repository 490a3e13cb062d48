"""Ragged q_len (per-request query lengths, ProblemSpec.q_lens) outside any kernel: the reference's masking
against an oracle that shares none of its code, the comparison reading only the rows that are tokens, which
envelopes take it, the draws, the metamorphic batch reversal, simplification and the spec's JSON."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from oracles import F64_TOL, naive_decode, row_rel_err

from mla_verify.backends import all_backends, get_backend
from mla_verify.draw.strategies import Case, budget_for, cases, corner_cases
from mla_verify.judge.compare import baseline_result, compare
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec, csr_metadata
from mla_verify.problems.metamorphic import transform
from mla_verify.problems.problem import DecodeProblem
from mla_verify.problems.reference import reference_decode
from mla_verify.run.simplify import simplify

SPEC = ProblemSpec(seq_lens=(4, 17, 40, 33), q_len=4, q_lens=(1, 4, 2, 3), num_heads=3, page_size=16, extra_pages=2,
                   table_pad=1, seed=11)
FA_ENVELOPE = get_backend("fa2").envelope


def _alone(p: DecodeProblem, b: int) -> DecodeProblem:
    """Request b as a uniform one-request problem of its own q_lens[b] tokens."""
    n = p.q_lens[b]
    return DecodeProblem(p.query[b:b + 1, :n], p.kv_cache, p.block_table[b:b + 1], p.seq_lens[b:b + 1], p.dims,
                         p.bmm1_scale, p.bmm2_scale)


@pytest.mark.parametrize("window", [None, 5])
def test_each_ragged_request_is_the_uniform_problem_of_its_own_tokens(window: int | None) -> None:
    p = build_problem(replace(SPEC, window_left=window))
    ref = reference_decode(p)
    for b, n in enumerate(p.q_lens):
        out, lse, _ = naive_decode(replace(_alone(p, b), window_left=window))  # the oracle: no shared masking
        assert row_rel_err(ref.out[b, :n], out[0]) < F64_TOL
        assert float((ref.lse[b, :n] - lse[0]).abs().max()) < F64_TOL
    assert ref.valid is not None and ref.valid.tolist() == [[t < n for t in range(4)] for n in p.q_lens]


def test_ragged_requests_differ_from_the_padded_uniform_problem() -> None:
    """The masking is per request: with one q_len for all, the short requests' tokens see other positions."""
    ragged = reference_decode(build_problem(SPEC))
    uniform = reference_decode(build_problem(replace(SPEC, q_lens=None)))  # the same values, seed and all
    assert torch.equal(ragged.out[1], uniform.out[1])  # the request of q_len tokens is the same problem
    for b in (0, 2, 3):
        assert row_rel_err(ragged.out[b, :1], uniform.out[b, :1]) > 1e-3


def test_the_comparison_reads_only_the_rows_that_are_tokens() -> None:
    p = build_problem(SPEC)
    ref, baseline = reference_decode(p), baseline_result(p, "bf16")
    out, lse = ref.out.to(torch.bfloat16), ref.lse.float() / torch.log(torch.tensor(2.0))
    padding = ~p.valid_rows()
    for fill in (float("nan"), float("inf"), 1e4):  # whatever lies in a padding row is never read
        stats, failures = compare(out.masked_fill(padding[..., None, None], fill),
                                  lse.masked_fill(padding[..., None], fill), ref, baseline, "bf16", 2.0)
        assert failures == [] and stats.nonfinite == 0
    wrong = out.clone()
    wrong[0, 0, 1] += 1.0  # a token row: judged
    assert compare(wrong, None, ref, baseline, "bf16", None)[1]


def test_only_the_fa_paths_take_ragged_problems_and_the_others_say_why() -> None:
    layout = LayoutSpec(return_lse=False, pass_out=True)
    takers = []
    for backend in all_backends().values():
        if backend.kind != "dense":  # a sparse problem has no q_lens to be ragged in
            continue
        reason = backend.envelope.why_not(SPEC, layout)
        if reason is None or "per-request q_lens" not in reason:
            takers.append(backend.name)
        else:
            assert "per-request q_lens [1, 4, 2, 3] (this kernel takes one q_len for every request)" in reason
    assert sorted(takers) == ["fa-auto", "fa2", "fa3"]
    assert "per-request q_lens" in get_backend("cpu-peer").why_not(SPEC, layout, torch.device("cpu"))


@settings(max_examples=60, deadline=None, database=None)
@given(st.data())
def test_ragged_q_lens_are_drawn_only_where_the_envelope_takes_them(data: st.DataObject) -> None:
    budget = budget_for("cpu")
    assert data.draw(cases(get_backend("cpu-peer").envelope, budget)).spec.q_lens is None
    s = data.draw(cases(FA_ENVELOPE, budget)).spec
    if s.q_lens is not None:
        assert len(s.q_lens) == s.batch and all(1 <= n <= s.q_len for n in s.q_lens) and min(s.q_lens) < s.q_len
        build_problem(s)  # valid


def test_the_fa_envelope_draws_ragged_problems_and_premerge_has_one() -> None:
    from hypothesis import find

    # derandomized and without a database, so the same example every run. Only the query is asserted shrunk:
    # a batch past EXPLICIT_BATCH draws its lengths from a seed and Hypothesis's shrinker may stop there (the
    # engine's simplify step cuts the batch afterwards; tests/test_simplify.py)
    ragged = find(cases(FA_ENVELOPE, budget_for("cpu")), lambda c: c.spec.q_lens is not None,
                  settings=settings(database=None, derandomize=True))
    assert ragged.spec.q_len == 2 and min(ragged.spec.q_lens) == 1  # the shortest ragged query
    corners = [c for c in corner_cases(FA_ENVELOPE, budget_for("cpu")) if c.spec.q_lens is not None]
    assert len(corners) == 1 and corners[0].transform == "batch"
    q_lens, q_len = corners[0].spec.q_lens, corners[0].spec.q_len
    assert {1, q_len} <= set(q_lens)
    assert not any(c.spec.q_lens for c in corner_cases(get_backend("cpu-peer").envelope, budget_for("cpu")))


def test_batch_reversal_reverses_the_q_lens() -> None:
    p = build_problem(SPEC)
    moved, unmap = transform(p, "batch")
    assert moved.q_lens == (3, 2, 4, 1)
    ref, again = reference_decode(p), reference_decode(moved)
    out, lse = unmap(again.out, again.lse)
    assert torch.equal(out, ref.out) and torch.equal(lse, ref.lse)


def test_csr_query_offsets_follow_the_q_lens() -> None:
    lens = torch.tensor(SPEC.seq_lens, dtype=torch.int32)
    assert csr_metadata(lens, 4, 16, q_lens=SPEC.q_lens).qo_indptr.tolist() == [0, 1, 5, 7, 10]
    assert csr_metadata(lens, 4, 16).qo_indptr.tolist() == [0, 4, 8, 12, 16]


def test_simplify_drops_raggedness_unless_the_failure_needs_it() -> None:
    case = Case(SPEC, LayoutSpec())
    plain = simplify(case, FA_ENVELOPE, lambda c: c.spec.num_heads >= 1)  # fails whatever it is
    assert plain.spec.q_lens is None
    kept = simplify(case, FA_ENVELOPE, lambda c: c.spec.q_lens is not None and 1 in c.spec.q_lens)
    assert kept.spec.q_lens is not None and len(kept.spec.q_lens) == kept.spec.batch
    build_problem(kept.spec)


def test_the_spec_keeps_its_q_lens_in_json_and_id_only_when_ragged() -> None:
    assert ProblemSpec.from_json(SPEC.to_json()) == SPEC and SPEC.to_json()["q_lens"] == [1, 4, 2, 3]
    uniform = replace(SPEC, q_lens=None)
    assert "q_lens" not in uniform.to_json()  # the ids of every uniform case are unchanged
    assert uniform.case_id() != SPEC.case_id() and "q_lens=[1, 4, 2, 3]" in SPEC.describe()


@pytest.mark.parametrize("q_lens,match", [((1, 5, 1, 1), "q_lens"), ((1, 2), "q_lens"), ((0, 1, 1, 1), "q_lens")])
def test_malformed_q_lens_are_refused_naming_the_field(q_lens: tuple[int, ...], match: str) -> None:
    from mla_verify.core.errors import ProblemError

    with pytest.raises(ProblemError, match=match):
        build_problem(replace(SPEC, q_lens=q_lens))


def _with_nan_padding(p: DecodeProblem, out: torch.Tensor) -> torch.Tensor:
    return out.masked_fill(~p.valid_rows()[..., None, None], float("nan"))


@pytest.mark.parametrize("name", ["bmm2_missing", "scale_1_sqrt_576"])
def test_a_known_misreading_is_named_on_a_ragged_problem_whatever_its_padding_rows_hold(name: str) -> None:
    from mla_verify.judge.diagnose import diagnose

    p = build_problem(replace(SPEC, bmm2_extra=2.0))
    ref = reference_decode(p)
    misread = ref.out / 2.0 if name == "bmm2_missing" else reference_decode(replace(p, bmm1_scale=576 ** -0.5)).out
    found = diagnose(p, _with_nan_padding(p, misread), truth=ref)
    assert [e.name for e in found][:1] == [name]


def test_localization_names_the_wrong_token_rows_and_no_padding_row() -> None:
    from mla_verify.judge.localize import localize

    p = build_problem(SPEC)
    ref = reference_decode(p)
    out = ref.out.clone()
    out[2, 1] *= 1.5  # request 2's last token (it has 2)
    lines = localize(p, _with_nan_padding(p, out).to(torch.bfloat16), ref)
    assert "batch entry 2" in lines[0] and "query token 1" in lines[0], lines
    assert not any("NaN" in line for line in lines), lines


def test_a_user_kernel_cannot_declare_ragged_problems() -> None:
    from mla_verify.backends.user_kernel import envelope_from_overrides
    from mla_verify.core.errors import UsageError

    assert envelope_from_overrides({"ragged_q": False}).ragged_q is False
    with pytest.raises(UsageError, match="ragged_q.*one q_len for every request"):
        envelope_from_overrides({"ragged_q": True})


def test_localization_counts_only_token_rows() -> None:
    from mla_verify.judge.localize import localize

    p = build_problem(SPEC)
    ref = reference_decode(p)
    lines = localize(p, _with_nan_padding(p, ref.out * 1.5).to(torch.bfloat16), ref)  # every token row wrong
    tokens = sum(SPEC.q_lens) * SPEC.num_heads
    assert f"({tokens} of {tokens} rows wrong)" in lines[0], lines
    assert "right" not in lines[0], lines  # padding rows are not the "other rows"
