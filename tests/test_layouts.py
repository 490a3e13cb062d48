"""layouts.py round trips: every kernel layout holds exactly the canonical problem's data, in shared storage."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from mla_verify.core.bits import same_bits
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import (
    LayoutSpec,
    canonical_cache,
    csr_metadata,
    csr_to_block_table,
    padded_width,
    page_counts,
    strided_pool,
    trtllm_args,
    used_entries,
    wrapper_args,
)
from mla_verify.problems.problem import DecodeProblem

# lengths cover a single token, a partial last page, an exact page multiple and several pages
SPEC = ProblemSpec(seq_lens=(1, 17, 32, 70), q_len=1, num_heads=4, page_size=16, extra_pages=3, table_pad=1,
                   pad_fill="oob", seed=5)


@pytest.fixture(params=[16, 32, 1], ids=lambda p: f"page{p}")
def problem(request: pytest.FixtureRequest) -> DecodeProblem:
    return build_problem(replace(SPEC, page_size=request.param))


def test_default_layout_is_the_canonical_vllm_cache_itself(problem: DecodeProblem) -> None:
    a = trtllm_args(problem, LayoutSpec())
    assert a.kv_cache is problem.kv_cache and a.pool is problem.kv_cache  # [num_blocks, block_size, 576]
    assert a.query is problem.query and a.seq_lens is problem.seq_lens


def test_4d_cache_is_a_view_that_round_trips(problem: DecodeProblem) -> None:
    a = trtllm_args(problem, LayoutSpec(cache_dims=4))
    P, page, D = problem.kv_cache.shape
    assert a.kv_cache.shape == (P, 1, page, D)
    assert a.kv_cache.data_ptr() == problem.kv_cache.data_ptr()
    assert same_bits(canonical_cache(a.kv_cache), problem.kv_cache)
    assert canonical_cache(problem.kv_cache) is problem.kv_cache


def test_canonical_cache_rejects_a_4d_cache_with_more_than_one_head() -> None:
    with pytest.raises(ValueError, match=r"\[P, 1, page, D\]"):
        canonical_cache(torch.zeros(2, 2, 4, 8))


@pytest.mark.parametrize("cache_dims", [3, 4])
def test_page_strided_view_equals_canonical_and_lives_in_a_larger_nan_pool(problem: DecodeProblem,
                                                                           cache_dims: int) -> None:
    pad = 3
    a = trtllm_args(problem, LayoutSpec(cache_dims=cache_dims, page_stride_pad=pad))
    P, page, D = problem.kv_cache.shape
    view = canonical_cache(a.kv_cache)
    assert not view.is_contiguous() and view.stride(0) == (page + pad) * D
    assert a.pool.shape == (P, page + pad, D) and view.data_ptr() == a.pool.data_ptr()
    assert same_bits(view, problem.kv_cache)
    assert bool(torch.isnan(a.pool[:, page:].float()).all())  # the gaps are poison


def test_strided_pool_without_padding_is_the_cache_itself(problem: DecodeProblem) -> None:
    view, backing = strided_pool(problem.kv_cache, 0)
    assert view is problem.kv_cache and backing is problem.kv_cache


@pytest.mark.parametrize("width,page,expected", [(1, 64, 2), (2, 64, 2), (3, 64, 4), (5, 32, 8), (1, 1, 128),
                                                 (129, 1, 256), (3, 128, 3), (3, 256, 3)])
def test_padded_width_is_the_next_multiple_of_128_over_page(width: int, page: int, expected: int) -> None:
    assert padded_width(width, page) == expected


def test_pad128_table_keeps_the_native_columns_and_only_widens(problem: DecodeProblem) -> None:
    native = trtllm_args(problem, LayoutSpec()).block_tables
    padded = trtllm_args(problem, LayoutSpec(table_width="pad128")).block_tables
    step = max(1, 128 // problem.page_size)
    assert padded.shape[1] % step == 0 and padded.shape[1] >= native.shape[1]
    assert padded.shape[1] - native.shape[1] < step
    assert torch.equal(padded[:, :native.shape[1]], native) and padded.dtype == torch.int32
    assert padded.is_contiguous()


@pytest.mark.parametrize("page", [1, 16, 64])
def test_page_counts_and_used_entries_follow_their_definition(page: int) -> None:
    lens = [1, page - 1, page, page + 1, 3 * page + 2]
    lens = [n for n in lens if n >= 1]
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want = [math.ceil(n / page) for n in lens]  # a sequence of n tokens spans ceil(n / page) pages
    assert page_counts(seq_lens, page).tolist() == want
    width = max(want) + 2  # two padding columns past the longest sequence
    assert used_entries(seq_lens, page, width).tolist() == [[j < k for j in range(width)] for k in want]
    csr = csr_metadata(seq_lens, 2, page)  # no table: zero page ids, as the planners' checks need
    assert csr.kv_indptr.tolist() == [sum(want[:b]) for b in range(len(want) + 1)]
    assert csr.qo_indptr.tolist() == [2 * b for b in range(len(want) + 1)]
    assert csr.kv_indices.tolist() == [0] * sum(want) and csr.kv_len_arr is seq_lens


def test_csr_metadata_round_trips_to_the_used_part_of_the_block_table(problem: DecodeProblem) -> None:
    w = wrapper_args(problem, LayoutSpec())
    used = problem.pages_used()
    assert w.kv_indptr.tolist() == [0, *torch.cumsum(used, 0).tolist()]
    assert w.qo_indptr.tolist() == list(range(0, (problem.batch + 1) * problem.q_len, problem.q_len))
    assert torch.equal(w.kv_len_arr, problem.seq_lens)
    for t in (w.qo_indptr, w.kv_indptr, w.kv_indices, w.kv_len_arr):
        assert t.dtype == torch.int32
    table = csr_to_block_table(w.kv_indptr, w.kv_indices, fill=-7)
    cols = torch.arange(table.shape[1])[None, :]
    live = cols < used[:, None]
    assert torch.equal(table[live], problem.block_table[:, :table.shape[1]][live])
    assert bool((table[~live] == -7).all())


@pytest.mark.parametrize("pad", [0, 2])
def test_split_query_and_cache_are_views_of_one_storage(problem: DecodeProblem, pad: int) -> None:
    L = problem.dims.kv_lora_rank
    w = wrapper_args(problem, LayoutSpec(page_stride_pad=pad))
    itemsize = problem.kv_cache.element_size()
    # ckv and kpe are adjacent column ranges of the same pool: no copy, kpe starts L elements after ckv
    assert w.ckv.data_ptr() == w.pool.data_ptr()
    assert w.kpe.data_ptr() == w.ckv.data_ptr() + L * itemsize
    assert w.ckv.stride() == w.kpe.stride()
    assert same_bits(torch.cat([w.ckv, w.kpe], dim=-1), problem.kv_cache)
    q = problem.query
    assert w.q_nope.data_ptr() == q.data_ptr() and w.q_pe.data_ptr() == q.data_ptr() + L * q.element_size()
    rows = q.reshape(problem.batch * problem.q_len, problem.num_heads, -1)
    assert same_bits(torch.cat([w.q_nope, w.q_pe], dim=-1), rows)


def test_multi_token_queries_get_q_len_rows_per_request() -> None:
    p = build_problem(replace(SPEC, q_len=3, seq_lens=(3, 20)))
    w = wrapper_args(p, LayoutSpec())
    assert w.qo_indptr.tolist() == [0, 3, 6] and w.q_nope.shape[0] == 6
    assert torch.equal(w.q_nope[3:6], p.query[1, :, :, :p.dims.kv_lora_rank])
