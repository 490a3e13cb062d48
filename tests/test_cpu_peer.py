"""The CPU peer agrees with the reference across its envelope, and the harness passes it.

Tolerance for the direct comparison: the peer accumulates in fp32 (relative error ~1e-6 over a few thousand
tokens) and rounds its output to bf16 once (at most half an ulp: 2^-8 relative, bf16 carrying 8 significant
bits). So each element may be off by 2^-8 |ref| plus an fp32 term; 1e-4 * max|ref| bounds the latter with
two orders of magnitude to spare.
LSE stays in fp32 throughout: 1e-4 absolute (base 2) is ~50x the fp32 error of values below 30.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import mla_verify.problems.reference
from mla_verify.backends.cpu_peer import CPU_PEER_ENVELOPE, cpu_peer_backend, cpu_peer_decode
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec, trtllm_args
from mla_verify.problems.reference import reference_decode
from mla_verify.run.harness import run_case

BASE = ProblemSpec(seq_lens=(1, 40, 300, 17), q_len=1, num_heads=8, page_size=16, extra_pages=2, table_pad=1,
                   seed=3)

CASES = [  # (spec changes, layout): the envelope's axes, each varied from the base
    ({}, LayoutSpec()),
    ({"page_size": 1}, LayoutSpec(page_stride_pad=2)),
    ({"page_size": 32, "q_len": 4, "seq_lens": (4, 33, 64, 129)}, LayoutSpec(cache_dims=4, table_width="pad128")),
    ({"page_size": 64, "num_heads": 128, "seq_lens": (70, 5)}, LayoutSpec(cache_dims=4, page_stride_pad=5)),
    ({"num_heads": 1, "q_len": 16, "seq_lens": (16, 600)}, LayoutSpec(pass_out=False)),
    ({"kv_lora_rank": 256, "num_heads": 3, "q_len": 2, "seq_lens": (2, 50)}, LayoutSpec(table_width="pad128")),
    ({"dtype": "fp8", "q_scale": 0.5, "k_scale": 2.0, "bmm2_extra": 1.5}, LayoutSpec(cache_dims=4)),
    ({"values": "large", "softmax_scale": 0.1352, "pad_fill": "garbage"}, LayoutSpec()),
    ({"values": "outliers", "shuffle_pages": False, "max_seq_len": 1000}, LayoutSpec(page_stride_pad=1)),
]


def _close_to_reference(spec: ProblemSpec, layout: LayoutSpec, **kwargs) -> None:
    problem = build_problem(spec)
    a = trtllm_args(problem, layout)
    d = problem.dims
    out = torch.full((spec.batch, spec.q_len, spec.num_heads, d.kv_lora_rank), float("inf"), dtype=torch.bfloat16)
    got, lse = cpu_peer_decode(a.query, a.kv_cache, None, d.qk_nope_head_dim, d.kv_lora_rank, d.qk_rope_head_dim,
                               a.block_tables, a.seq_lens, a.max_seq_len, out=out, bmm1_scale=problem.bmm1_scale,
                               bmm2_scale=problem.bmm2_scale, return_lse=True, **kwargs)
    ref = reference_decode(problem)
    assert got is out and lse.shape == (spec.batch * spec.q_len, spec.num_heads) and lse.dtype == torch.float32
    err = (got.double() - ref.out).abs()
    # 2^-8 relative: the bf16 output's rounding (half an ulp is 2^-9); 1e-4 of the largest value: fp32 sums over
    # up to ~600 tokens and the split merge (~1e-6 measured), while the mutants move outputs by > 1e-2
    allowed = 2.0 ** -8 * ref.out.abs() + 1e-4 * float(ref.out.abs().max())
    assert bool((err <= allowed).all()), f"max err {float(err.max()):.3g}"
    lse_err = (lse.double().view_as(ref.lse) - ref.lse_base2).abs().max()
    assert float(lse_err) < 1e-4  # fp32 sums of exp: ~1e-6; a base mix-up or a dropped split is off by > 0.1


@pytest.mark.parametrize("changes,layout", CASES, ids=[str(i) for i in range(len(CASES))])
def test_peer_matches_reference(changes: dict, layout: LayoutSpec) -> None:
    _close_to_reference(replace(BASE, **changes), layout)


@pytest.mark.parametrize("tokens_per_split", [1, 7, 64])
def test_many_small_splits_merge_to_the_same_answer(tokens_per_split: int) -> None:
    # one split per token (or an odd size) exercises the LSE merge hundreds of times per row
    _close_to_reference(replace(BASE, q_len=3, seq_lens=(3, 90)), LayoutSpec(), tokens_per_split=tokens_per_split)


@pytest.mark.parametrize("changes,layout", [({}, LayoutSpec(cache_dims=4, page_stride_pad=3, table_width="pad128")),
                                            ({"dtype": "fp8", "q_len": 2, "k_scale": 0.5, "seq_lens": (2, 99)},
                                             LayoutSpec()),
                                            ({"num_heads": 16, "page_size": 1}, LayoutSpec(pass_out=False))])
def test_harness_passes_the_peer(changes: dict, layout: LayoutSpec) -> None:
    result = run_case(cpu_peer_backend(), replace(BASE, **changes), layout, "cpu", transform="pages")
    assert result.verdict == "pass", result.failures


def test_peer_is_not_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args, **kwargs):
        raise AssertionError("the peer must not call the reference")
    monkeypatch.setattr(mla_verify.problems.reference, "reference_decode", forbidden)
    problem = build_problem(BASE)
    prepared = cpu_peer_backend().prepare(problem, LayoutSpec())
    out, lse = prepared.to_canonical(prepared.invoke())
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(lse).all())


def test_peer_envelope_is_wide() -> None:
    env = CPU_PEER_ENVELOPE
    assert env.devices == ("cpu", "cuda") and env.page_sizes is None and env.max_heads == 128
    assert set(env.dtypes) == {"bf16", "fp8"} and env.q_len == (1, 16) and set(env.cache_dims) == {3, 4}
    assert env.page_strided and set(env.table_widths) == {"native", "pad128"} and env.lse_base == 2.0
