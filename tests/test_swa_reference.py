"""The sliding window (``window_left``) in the reference, checked against forms that share no code with it.

Query token i of a request sits at position p = seq_len - q_len + i and sees positions p - window_left .. p.
``tests/oracles.py`` writes that out twice: a float64 loop that starts each token's sum at its window, and SDPA
with a banded mask. The reference must agree with both, and with the unabsorbed MHA form, across windows of 0,
1, page-1, page and longer than every sequence, q_len 1 and 4, partial and full pages; and a window must make a
difference where it cuts a sequence (so the agreement is not vacuous).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from oracles import F64_TOL, naive_decode, naive_errors, row_rel_err, sdpa_decode

from mla_verify.backends.base import Envelope
from mla_verify.core.errors import ProblemError
from mla_verify.judge.selfcheck import absorbed_problem, unabsorbed_error
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.problems.reference import reference_decode
from mla_verify.records.fixtures import load_fixture, save_fixture

PAGE = 16
LENS = (1, 5, PAGE - 1, PAGE, PAGE + 1, 3 * PAGE + 2, 70)
WINDOWS = (0, 1, PAGE - 1, PAGE, 40, 1000)  # 1000: longer than every sequence, the window never cuts
GRID = [(w, q) for w in WINDOWS for q in (1, 4)]


def windowed(window: int, q_len: int, **changes) -> ProblemSpec:
    return ProblemSpec(seq_lens=tuple(n for n in LENS if n >= q_len), q_len=q_len, num_heads=3, page_size=PAGE,
                       kv_lora_rank=64, qk_rope_head_dim=32, extra_pages=2, table_pad=1, softmax_scale=0.3,
                       bmm2_extra=1.5, window_left=window, seed=window + q_len, **changes)


@pytest.mark.parametrize("window,q_len", GRID, ids=[f"w{w}-q{q}" for w, q in GRID])
def test_windowed_reference_matches_the_naive_loop_and_sdpa(window: int, q_len: int) -> None:
    p = build_problem(windowed(window, q_len))
    result = reference_decode(p)
    out_err, lse_e_err, lse_2_err = naive_errors(result, p)
    assert out_err < F64_TOL and lse_e_err < F64_TOL and lse_2_err < F64_TOL
    assert row_rel_err(result.out, sdpa_decode(p)) < F64_TOL


@pytest.mark.parametrize("window", [0, 1, PAGE, 40])
def test_a_window_that_cuts_a_sequence_changes_the_answer(window: int) -> None:
    """The oracles' windowed answer is not the plain causal one (the 70-token sequence is cut by every window)."""
    p = build_problem(windowed(window, 4))
    plain = replace(p, window_left=None)
    assert row_rel_err(naive_decode(p)[0], naive_decode(plain)[0]) > 1e-3
    assert row_rel_err(reference_decode(p).out, reference_decode(plain).out) > 1e-3


def test_a_window_longer_than_every_sequence_is_plain_causal_attention() -> None:
    p = build_problem(windowed(1000, 4))
    assert row_rel_err(reference_decode(p).out, reference_decode(replace(p, window_left=None)).out) < F64_TOL


@pytest.mark.parametrize("q_len", [1, 4])
def test_windowed_reference_matches_the_unabsorbed_form(q_len: int) -> None:
    spec = replace(windowed(PAGE, q_len, dtype="fp64"), kv_lora_rank=256, qk_rope_head_dim=64)
    assert unabsorbed_error(*absorbed_problem(spec)) < F64_TOL


@pytest.mark.parametrize("matmul,precision,tol", [
    # fp32 products of bf16 inputs are exact and the sums stay below ~4e-6 relative (tests/test_reference.py)
    ("exact", torch.float32, 1e-5),
    # bf16-split: the probabilities in two bf16 halves, 2^-17 relative, plus the fp32 sums
    ("bf16-split", torch.float32, 1e-5),
])
def test_the_fast_modes_keep_the_window(matmul: str, precision: torch.dtype, tol: float) -> None:
    p = build_problem(windowed(PAGE, 4))
    fast = reference_decode(p, precision, matmul=matmul)
    assert row_rel_err(fast.out, naive_decode(p)[0]) < tol


def test_small_chunks_give_the_same_windowed_answer() -> None:
    """Groups of one sequence each (the smallest chunk) against one group for all: the window is per token."""
    p = build_problem(windowed(PAGE, 4))
    whole, chunked = reference_decode(p), reference_decode(p, chunk_bytes=1)
    assert row_rel_err(chunked.out, whole.out) < F64_TOL


def test_the_window_is_validated_in_one_line() -> None:
    with pytest.raises(ProblemError, match=r"^window_left: must be None or an int >= 0, got -1$"):
        build_problem(windowed(-1, 1))


def test_spec_json_has_no_window_unless_set_so_old_case_ids_stand() -> None:
    plain = ProblemSpec(seq_lens=(5, 9))
    assert "window_left" not in plain.to_json()
    assert ProblemSpec.from_json(plain.to_json()) == plain
    spec = replace(plain, window_left=512)
    assert spec.to_json()["window_left"] == 512 and ProblemSpec.from_json(spec.to_json()) == spec
    assert spec.case_id() != plain.case_id() and "window_left=512" in spec.describe()
    assert "window" not in plain.describe()


def test_a_fixture_keeps_the_window(tmp_path) -> None:
    spec = windowed(PAGE, 4)
    problem = build_problem(spec)
    path = save_fixture(tmp_path, "w", problem, {"spec": spec.to_json(), "layout": LayoutSpec().to_json()})
    loaded = load_fixture(path)
    assert loaded.problem.window_left == PAGE and loaded.spec == spec
    plain = save_fixture(tmp_path, "p", replace(problem, window_left=None), {})
    assert load_fixture(plain).problem.window_left is None


def test_envelopes_take_only_their_windows() -> None:
    spec, layout = ProblemSpec(seq_lens=(5,)), LayoutSpec()
    assert Envelope(devices=("cpu",)).why_not(spec, layout) is None
    assert "window_left 512 (supported: [None])" in Envelope().why_not(replace(spec, window_left=512), layout)
    sliding = Envelope(windows=(512,))
    assert sliding.why_not(replace(spec, window_left=512), layout) is None
    assert "window_left None (supported: [512])" in sliding.why_not(spec, layout)


def test_envelopes_take_only_their_batch_sizes_and_q_lens() -> None:
    env = Envelope(q_len=(1, 4), q_lens=(1, 4), batch_sizes=(1, 2, 4), max_batch=4)
    layout = LayoutSpec()
    assert env.why_not(ProblemSpec(seq_lens=(9, 9), q_len=4), layout) is None
    assert "batch 3 (supported: (1, 2, 4))" in env.why_not(ProblemSpec(seq_lens=(9, 9, 9)), layout)
    assert "q_len 2 (supported: (1, 4))" in env.why_not(ProblemSpec(seq_lens=(9,), q_len=2), layout)


def test_window_0_sees_only_the_token_itself() -> None:
    """The definition at its smallest: each query token's output is its own cache row's latent part."""
    spec = windowed(0, 4)
    p = build_problem(spec)
    L = spec.kv_lora_rank
    for b, n in enumerate(spec.seq_lens):
        for i in range(spec.q_len):
            position = n - spec.q_len + i
            row = p.kv_cache[p.block_table[b, position // PAGE], position % PAGE, :L].double()
            got = reference_decode(p).out[b, i]
            assert torch.allclose(got, spec.bmm2_scale * row.expand_as(got), rtol=0, atol=1e-12)
