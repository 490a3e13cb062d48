"""The sparse reference against two independent forms: dense decode (indices listing every position) and a
naive float64 loop written from the definition; and its precision modes against float64."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from oracles import F64_TOL, row_rel_err

from mla_verify.core.errors import ProblemError
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.reference import reference_decode
from mla_verify.problems.sparse import SparseDecodeProblem, SparseSpec, build_sparse_problem
from mla_verify.problems.sparse_reference import sparse_reference


def naive_sparse(p: SparseDecodeProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, natural lse) in float64, one (request, token, head, entry) at a time, from the definition."""
    rows = p.kv_cache.reshape(-1, p.kv_cache.shape[-1]).double()
    out = torch.zeros(p.out_shape, dtype=torch.float64)
    lse = torch.empty(p.out_shape[:3], dtype=torch.float64)
    for b in range(p.batch):
        limit = p.indices.shape[-1] if p.topk_length is None else int(p.topk_length[b])
        for i in range(p.q_len):
            keys = [int(s) for s in p.indices[b, i, :limit] if int(s) != -1]
            for h in range(p.num_heads):
                if not keys:
                    lse[b, i, h] = math.inf
                    continue
                q = p.query[b, i, h].double()
                scores = [p.softmax_scale * float(q @ rows[s]) for s in keys]
                top = max(scores)
                weights = [math.exp(x - top) for x in scores]
                total = sum(weights)
                lse[b, i, h] = top + math.log(total)
                acc = sum(w * rows[s, :p.d_v] for w, s in zip(weights, keys)) / total
                if p.attn_sink is not None:
                    acc = acc / (1 + math.exp(float(p.attn_sink[h]) - float(lse[b, i, h])))
                out[b, i, h] = acc
    return out, lse


CASES = {
    "v32 dup sinks": SparseSpec(num_heads=3, topk=64, page_size=16, used_pages=3, duplicates=True, sink="mixed",
                                invalid=0.3),
    "no-rope front -1 lengths": SparseSpec(num_heads=2, q_len=2, topk=64, page_size=8, used_pages=5, fmt="V32_NO_ROPE",
                                           scales="amax", invalid_front=True, topk_lengths=(30, 0), sink="finite"),
    "v4 extreme": SparseSpec(batch=1, num_heads=2, topk=64, page_size=4, used_pages=20, extra_pages=3, fmt="V4",
                             values="extreme"),
    "all masked": SparseSpec(batch=1, num_heads=2, topk=64, invalid=1.0, sink="finite"),
}


@pytest.mark.parametrize("name", CASES)
def test_reference_matches_naive_loop(name):
    p = build_sparse_problem(CASES[name])
    ref = sparse_reference(p)
    out, lse = naive_sparse(p)
    assert torch.equal(ref.lse.isinf(), lse.isinf())
    gap = torch.where(lse.isfinite(), ref.lse - lse, 0.0)
    assert float(gap.abs().max()) < F64_TOL * 1e3  # lse ~ 1e1..1e3: relative 1e-10
    nonzero = out.norm(dim=-1) > 0
    assert torch.equal(ref.out.norm(dim=-1) > 0, nonzero)
    if bool(nonzero.any()):
        assert row_rel_err(ref.out[nonzero], out[nonzero]) < F64_TOL


def test_empty_rows_are_zero_with_infinite_lse():
    ref = sparse_reference(build_sparse_problem(CASES["all masked"]))
    assert bool((ref.out == 0).all()) and bool((ref.lse == math.inf).all())


def test_equals_dense_decode_when_every_position_is_listed():
    dense = build_problem(ProblemSpec((37, 100), num_heads=4, page_size=16, extra_pages=2, seed=3))
    rows = [(dense.block_table[b, torch.arange(n) // 16].long() * 16 + torch.arange(n) % 16)
            for b, n in enumerate(dense.seq_lens.tolist())]
    indices = torch.full((2, 1, 128), -1, dtype=torch.int32)
    for b, r in enumerate(rows):
        indices[b, 0, :len(r)] = r.flip(0).to(torch.int32)  # order does not matter to attention
    sparse = SparseDecodeProblem(dense.query, dense.kv_cache, indices, dense.bmm1_scale).validate()
    want, got = reference_decode(dense), sparse_reference(sparse)
    assert row_rel_err(got.out, want.out) < F64_TOL
    assert float((got.lse - want.lse).abs().max()) < F64_TOL


def test_duplicates_count_twice():
    p = build_sparse_problem(SparseSpec(batch=1, num_heads=2, topk=64, invalid=0.0))
    doubled = p.indices.clone()
    doubled[..., 1] = doubled[..., 0]
    twice = sparse_reference(dataclasses.replace(p, indices=doubled))
    once = sparse_reference(dataclasses.replace(p, indices=torch.where(
        torch.arange(64) == 1, -1, doubled).to(torch.int32)))
    # slot 0 counted twice adds its exp(score) once more to the sum: lse = log(e^lse_once + e^s0)
    s0 = p.softmax_scale * (p.query[0, 0].double() @ p.kv_cache.reshape(-1, 576)[int(doubled[0, 0, 0])].double())
    assert torch.allclose(twice.lse[0, 0], torch.logaddexp(once.lse[0, 0], s0), atol=1e-9)  # float64 sums: ~1e-15 apart


@pytest.mark.parametrize("mode, tol", [
    # fp32 scores of 576-term bf16 products: ~1e-6 relative (reference.py's bound 4e-6 at 16k terms)
    ((torch.float32, "exact"), 4e-6),
    # bf16-split: the probabilities to 2^-17 ~ 8e-6 relative, fp32 sums
    ((torch.float32, "bf16-split"), 2e-5),
])
def test_precision_modes_agree_with_float64(mode, tol):
    p = build_sparse_problem(dataclasses.replace(CASES["v32 dup sinks"], sink="finite"))
    want, got = sparse_reference(p), sparse_reference(p, *mode)
    assert row_rel_err(got.out, want.out) < tol


def test_out_of_pool_index_is_a_problem_error():
    p = build_sparse_problem(SparseSpec(batch=1, num_heads=2))
    bad = p.indices.clone()
    bad[0, 0, 3] = p.slots
    with pytest.raises(ProblemError, match=r"indices\[0, 0, 3\].*neither -1 nor a slot"):
        dataclasses.replace(p, indices=bad).validate()


def test_the_lse_of_a_row_with_no_key_must_be_inf_and_a_nan_one_is_off():
    from mla_verify.kinds.sparse import SPARSE_KIND

    problem = build_sparse_problem(SparseSpec(batch=2, num_heads=4, fmt="bf16", invalid=0.0, topk_lengths=(0, 64)),
                                   "cpu")
    ref = sparse_reference(problem)
    assert SPARSE_KIND.judge_output(problem, ref.out.bfloat16(), ref.lse, math.e)[1] == []
    lse = ref.lse.clone()
    lse[1, 0, 2] = float("nan")
    lse[0, 0, 1] = 0.0  # the row of request 0 has no key: its LSE must be +inf
    failures = SPARSE_KIND.judge_output(problem, ref.out.bfloat16(), lse, math.e)[1]
    assert failures[0] == "LSE is not +inf at 1 of the 4 rows with no valid key", failures
    assert failures[1].startswith("LSE (base e) off at batch 1, token 0, head 2: kernel nan"), failures
