"""DecodeProblem validation (one-line errors naming the field) and build_problem's poisoning and determinism."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

from mla_verify.core.bits import same_bits
from mla_verify.core.errors import ProblemError
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.problem import DecodeProblem

PAGE = 16
# lengths 5, 17, 33 use 1, 2 and 3 pages; two spare table columns hold out-of-range padding ids
VALID = ProblemSpec(seq_lens=(5, 17, 33), q_len=2, num_heads=2, page_size=PAGE, extra_pages=3, table_pad=2,
                    pad_fill="oob", seed=11)


@pytest.fixture
def problem() -> DecodeProblem:
    return build_problem(VALID)


def _with(p: DecodeProblem, **changes) -> DecodeProblem:
    return dataclasses.replace(p, **changes)


def _table_with(p: DecodeProblem, row: int, col: int, value: int) -> DecodeProblem:
    table = p.block_table.clone()
    table[row, col] = value
    return _with(p, block_table=table)


def _lens_with(p: DecodeProblem, row: int, value: int) -> DecodeProblem:
    lens = p.seq_lens.clone()
    lens[row] = value
    return _with(p, seq_lens=lens)


BAD: dict[str, tuple[str, Callable[[DecodeProblem], DecodeProblem]]] = {
    "query last dim": ("query", lambda p: _with(p, query=p.query[..., :-1])),
    "query last dim 512 (latent only)": ("query", lambda p: _with(p, query=p.query[..., :512])),
    "kv_cache last dim": ("kv_cache", lambda p: _with(p, kv_cache=p.kv_cache[..., :-1])),
    "kv_cache last dim 512 (latent only)": ("kv_cache", lambda p: _with(p, kv_cache=p.kv_cache[..., :512])),
    "seq_len past the table row": ("seq_lens", lambda p: _lens_with(p, 0, p.block_table.shape[1] * PAGE + 1)),
    "table row too narrow": ("seq_lens", lambda p: _with(p, block_table=p.block_table[:, :2])),
    "page id negative": ("block_table", lambda p: _table_with(p, 2, 1, -1)),
    "page id == pool size": ("block_table", lambda p: _table_with(p, 1, 0, p.num_pages)),
    "page id in the last used column": ("block_table", lambda p: _table_with(p, 2, 2, p.num_pages + 5)),
    "int64 block_table": ("block_table", lambda p: _with(p, block_table=p.block_table.long())),
    "int64 seq_lens": ("seq_lens", lambda p: _with(p, seq_lens=p.seq_lens.long())),
    "q_len > seq_len": ("seq_lens", lambda p: _lens_with(p, 0, p.q_len - 1)),
    "seq_len negative": ("seq_lens", lambda p: _lens_with(p, 1, -3)),
    "fewer table rows than batch": ("block_table", lambda p: _with(p, block_table=p.block_table[:-1])),
    "fewer seq_lens than batch": ("seq_lens", lambda p: _with(p, seq_lens=p.seq_lens[:-1])),
    "query with no tokens": ("query", lambda p: _with(p, query=p.query[:, :0])),
    "empty batch": ("query", lambda p: _with(p, query=p.query[:0])),
    "kv_cache with no pages": ("kv_cache", lambda p: _with(p, kv_cache=p.kv_cache[:0])),
    "kv_cache pages of 0 slots": ("kv_cache", lambda p: _with(p, kv_cache=p.kv_cache[:, :0])),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_problem_raises_one_line_naming_the_field(problem: DecodeProblem, case: str) -> None:
    field, corrupt = BAD[case]
    bad = corrupt(problem)
    with pytest.raises(ProblemError) as info:
        bad.validate()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{field}:"), message


def test_seq_len_below_zero_is_reported_even_for_q_len_one() -> None:
    p = build_problem(dataclasses.replace(VALID, q_len=1))
    with pytest.raises(ProblemError, match=r"^seq_lens: .*< 0"):
        _lens_with(p, 0, -1).validate()


def test_an_empty_request_is_a_problem_whatever_its_query_tokens() -> None:
    """kv_len 0: its query rows see no key (whether a kernel takes one is its envelope's, Envelope.empty_lse)."""
    p = build_problem(dataclasses.replace(VALID, seq_lens=(0, 37, 0), q_len=3))
    assert p.validate() is p and p.seq_lens.tolist() == [0, 37, 0]


def test_valid_problem_passes(problem: DecodeProblem) -> None:
    assert problem.validate() is problem


def test_padding_entries_may_hold_anything(problem: DecodeProblem) -> None:
    used = torch.arange(problem.block_table.shape[1])[None, :] < problem.pages_used()[:, None]
    padding = problem.block_table[~used]
    # the fixture really has out-of-range padding, or this test would prove nothing
    assert bool(((padding < 0) | (padding >= problem.num_pages)).all())
    for value in (-(2**31), -1, problem.num_pages, 2**31 - 1, 0):
        table = problem.block_table.clone()
        table[~used] = value
        _with(problem, block_table=table).validate()


def test_page_ids_at_the_pool_edges_are_accepted(problem: DecodeProblem) -> None:
    _table_with(problem, 2, 2, problem.num_pages - 1).validate()
    _table_with(problem, 2, 2, 0).validate()


# -- build_problem --------------------------------------------------------------------------------------

def _owned_slots(p: DecodeProblem) -> set[tuple[int, int]]:
    """(page, slot) of every real token, walked position by position through the block table."""
    owned: set[tuple[int, int]] = set()
    for b, n in enumerate(p.seq_lens.tolist()):
        for pos in range(n):
            key = (int(p.block_table[b, pos // p.page_size]), pos % p.page_size)
            assert key not in owned, f"two tokens share cache slot {key}"
            owned.add(key)
    return owned


@pytest.mark.parametrize("spec", [
    VALID,
    dataclasses.replace(VALID, dtype="fp8", pad_fill="garbage", q_scale=0.5, k_scale=2.0),
    dataclasses.replace(VALID, seq_lens=(1, 16, 15, 64), page_size=16, q_len=1, extra_pages=0, pad_fill="zero"),
    dataclasses.replace(VALID, seq_lens=(3, 1, 2), page_size=1, q_len=1, shuffle_pages=False, dtype="fp64"),
], ids=["bf16-oob", "fp8-garbage", "page-boundaries", "page1-fp64"])
def test_unused_cache_slots_are_nan_and_used_slots_are_not(spec: ProblemSpec) -> None:
    p = build_problem(spec)
    nan = p.kv_cache.float().isnan()  # [P, page, D]
    owned = _owned_slots(p)
    assert len(owned) == spec.total_tokens
    for page in range(p.num_pages):
        for slot in range(p.page_size):
            if (page, slot) in owned:
                assert not bool(nan[page, slot].any()), f"NaN in used slot ({page}, {slot})"
            else:
                assert bool(nan[page, slot].all()), f"unused slot ({page}, {slot}) is not all NaN"
    assert not bool(p.query.float().isnan().any())


def _same_problem_bits(a: DecodeProblem, b: DecodeProblem) -> bool:
    return all(same_bits(x, y) for x, y in ((a.query, b.query), (a.kv_cache, b.kv_cache),
                                            (a.block_table, b.block_table), (a.seq_lens, b.seq_lens)))


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_same_spec_gives_the_same_bits(dtype: str) -> None:
    spec = dataclasses.replace(VALID, dtype=dtype)
    a, b = build_problem(spec), build_problem(spec)
    assert _same_problem_bits(a, b)
    assert (a.bmm1_scale, a.bmm2_scale) == (b.bmm1_scale, b.bmm2_scale)


def test_different_seed_gives_different_values() -> None:
    a = build_problem(VALID)
    b = build_problem(dataclasses.replace(VALID, seed=VALID.seed + 1))
    assert not same_bits(a.query, b.query)
    assert not same_bits(a.kv_cache, b.kv_cache)
    assert not _same_problem_bits(a, b)
