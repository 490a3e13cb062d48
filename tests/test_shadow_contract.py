"""Shadow mode's pre-call checks (mla_verify/shadow/contract.py) and its reading of a call as a problem
(shadow_problem.py), on hand-made arguments: each finding fires on the mistake it names and on nothing else."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from mla_verify.backends.cpu_peer import cpu_peer_decode
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec, trtllm_args
from mla_verify.problems.reference import reference_decode
from mla_verify.shadow.contract import (
    ERROR,
    WARNING,
    KernelContract,
    ModelFacts,
    PagedArgs,
    check_layout,
    check_lengths,
    check_scales,
)
from mla_verify.shadow.entries import LiveCall
from mla_verify.shadow.judge import precheck
from mla_verify.shadow.problem import compact, describing_spec, live_problem

SPEC = ProblemSpec(seq_lens=(37, 100, 5), num_heads=4, page_size=32, extra_pages=3, table_pad=1, seed=5)
# DeepSeek-R1's softmax scale, written out: 1/sqrt(128 + 64) * (0.1 ln 40 + 1)^2
PLAIN = 1 / math.sqrt(192)
R1 = PLAIN * (0.1 * math.log(40) + 1) ** 2
ABSORBED = 1 / math.sqrt(576)
CONTRACT = KernelContract("k")


def paged(layout: LayoutSpec = LayoutSpec(), spec: ProblemSpec = SPEC, **changes) -> PagedArgs:
    problem = build_problem(spec)
    a = trtllm_args(problem, layout)
    args = PagedArgs(a.query, a.kv_cache, a.block_tables, a.seq_lens, problem.dims.kv_lora_rank,
                     problem.dims.qk_rope_head_dim, problem.bmm1_scale, problem.bmm2_scale,
                     qk_nope_head_dim=128, max_seq_len=a.max_seq_len)
    return replace(args, **changes)


def only(findings, severity: str, field: str, blocking: bool | None = None) -> str:
    assert len(findings) == 1, findings
    f = findings[0]
    assert (f.severity, f.field) == (severity, field), f
    if blocking is not None:
        assert f.blocking == blocking
    return f.message


# --- scales

@pytest.mark.parametrize("scale", [PLAIN, R1, R1 * (1 + 3e-7)])  # 3e-7: the same scale computed in float32
def test_the_softmax_conventions_pass(scale: float) -> None:
    assert check_scales(paged(bmm1_scale=scale), ModelFacts()) == []


@pytest.mark.parametrize("scale,named", [(ABSORBED, "1/sqrt(576), the absorbed width"),
                                         (ABSORBED * R1 / PLAIN, "1/sqrt(576) * mscale^2"),
                                         (R1 * R1 / PLAIN, "mscale^2 applied twice")])
def test_known_scale_mistakes_are_errors_naming_the_right_scale(scale: float, named: str) -> None:
    message = only(check_scales(paged(bmm1_scale=scale), ModelFacts()), ERROR, "bmm1_scale")
    assert named in message and f"{PLAIN:.6g}" in message and f"{R1:.6g}" in message


def test_a_model_said_to_use_yarn_must_have_its_mscale() -> None:
    facts = ModelFacts(yarn_factor=40)
    assert check_scales(paged(bmm1_scale=R1), facts) == []
    assert "YaRN's mscale^2 missing" in only(check_scales(paged(bmm1_scale=PLAIN), facts), ERROR, "bmm1_scale")


def test_an_unknown_scale_is_a_warning_listing_every_convention_compared() -> None:
    message = only(check_scales(paged(bmm1_scale=0.1), ModelFacts()), WARNING, "bmm1_scale")
    assert "matches no known softmax convention" in message
    for value in (PLAIN, R1, ABSORBED):
        assert f"{value:.6g}" in message


def test_qk_nope_comes_from_the_call_or_is_said_to_be_assumed() -> None:
    nope_64 = paged(bmm1_scale=1 / math.sqrt(64 + 64), qk_nope_head_dim=64)
    assert check_scales(nope_64, ModelFacts()) == []
    unknown = paged(bmm1_scale=0.1, qk_nope_head_dim=None)
    assert "qk_nope_head_dim assumed 128" in check_scales(unknown, ModelFacts())[0].message
    assert check_scales(replace(unknown, bmm1_scale=1 / math.sqrt(128)), ModelFacts(qk_nope_head_dim=64)) == []


def test_fp8_scales_are_judged_only_when_known() -> None:
    fp8 = replace(SPEC, dtype="fp8", q_scale=0.5, k_scale=4.0, softmax_scale=R1)  # bmm1 = 2 * R1
    args = paged(spec=fp8, bmm2_scale=4.0)
    assert check_scales(args, ModelFacts()) == []  # unknown dequant scales: any bmm1 could be right
    assert check_scales(args, ModelFacts(fp8_scales=(0.5, 4.0))) == []
    dropped = check_scales(replace(args, bmm1_scale=R1), ModelFacts(fp8_scales=(0.5, 4.0)))
    assert "without the fp8 dequant scales" in only(dropped, ERROR, "bmm1_scale")


def test_bmm2_on_a_bf16_cache_is_a_warning() -> None:
    assert "not fp8" in only(check_scales(paged(bmm1_scale=R1, bmm2_scale=0.5), ModelFacts()), WARNING, "bmm2_scale")


# --- shapes, ranks, strides, out

def test_the_usual_layouts_pass() -> None:
    for layout in (LayoutSpec(), LayoutSpec(cache_dims=4), LayoutSpec(page_stride_pad=3, table_width="pad128")):
        assert check_layout(paged(layout), CONTRACT) == [] and check_lengths(paged(layout)) == []


def test_a_cache_rank_the_kernel_does_not_take_is_blocking() -> None:
    message = only(check_layout(paged(), KernelContract("k4", cache_dims=(4,))), ERROR, "kv_cache", blocking=True)
    assert "takes only 4-D [pages, 1, page_size, D]" in message
    assert check_layout(paged(LayoutSpec(cache_dims=4)), KernelContract("k4", cache_dims=(4,))) == []


def test_flashmlas_cache_order_handed_to_a_trtllm_style_kernel_is_named() -> None:
    args = paged()
    flashmla_order = args.kv_cache.unsqueeze(2)  # [P, page, 1, D]
    message = only(check_layout(replace(args, kv_cache=flashmla_order), CONTRACT), ERROR, "kv_cache", blocking=True)
    assert "FlashMLA's [blocks, page, 1, D] order" in message


def test_strided_rows_are_blocking_and_strided_tokens_a_warning() -> None:
    args = paged()
    P, page, D = args.kv_cache.shape
    wide = torch.zeros(P, page, 2 * D, dtype=args.kv_cache.dtype)
    assert "contiguous memory" in only(check_layout(replace(args, kv_cache=wide[..., ::2]), CONTRACT),
                                       ERROR, "kv_cache", blocking=True)
    assert "only whole pages may be strided" in only(check_layout(replace(args, kv_cache=wide[..., :D]), CONTRACT),
                                                    WARNING, "kv_cache")


def test_the_out_buffer_must_fit_the_call() -> None:
    args = paged()
    B, Q, H, _ = args.query.shape
    flat = torch.empty(B * Q, H, 512, dtype=torch.bfloat16)
    assert "writes (3, 1, 4, 512)" in only(check_layout(replace(args, out=flat), CONTRACT), ERROR, "out", True)
    fp32 = torch.empty(B, Q, H, 512)
    assert "dtype torch.float32" in only(check_layout(replace(args, out=fp32), CONTRACT), ERROR, "out", False)
    strided = torch.empty(B, Q, H, 1024, dtype=torch.bfloat16)[..., ::2]
    assert "not contiguous" in only(check_layout(replace(args, out=strided), CONTRACT), WARNING, "out")


def test_a_table_too_narrow_for_the_lengths_is_blocking() -> None:
    args = paged()
    narrow = args.block_table[:, :2]  # sequence 1 (100 tokens, 32-token pages) needs 4
    message = only(check_lengths(replace(args, block_table=narrow)), ERROR, "block_tables", blocking=True)
    assert "rows of 2 entries, but seq_lens[1] = 100 needs 4 pages of 32 tokens" in message


def test_a_max_seq_len_below_the_longest_sequence_is_an_error() -> None:
    message = only(check_lengths(paged(max_seq_len=64)), ERROR, "max_seq_len", blocking=False)
    assert "64 is below the longest sequence (100)" in message


def test_table_entries_outside_the_pool_are_refused_by_the_problems_own_validation() -> None:
    args = paged()
    bad = args.block_table.clone()
    bad[1, 2] = args.kv_cache.shape[0]  # one past the last page
    pre = precheck(LiveCall(replace(args, block_table=bad), CONTRACT), ModelFacts())
    assert pre.problem is None
    assert "outside the pool" in only(pre.blocking, ERROR, "block_table", blocking=True)


# --- the call as a problem

def test_a_good_call_is_read_without_copies_and_its_layout_recovered() -> None:
    layout = LayoutSpec(cache_dims=4, page_stride_pad=3, table_width="pad128", pass_out=False, return_lse=True)
    args = paged(layout)
    pre = precheck(LiveCall(args, CONTRACT, pass_out=False, return_lse=True), ModelFacts())
    assert pre.findings == [] and pre.problem is not None
    assert pre.problem.kv_cache.data_ptr() == args.kv_cache.data_ptr() and pre.problem.query is args.query
    assert pre.layout == layout
    native = precheck(LiveCall(paged(), CONTRACT, pass_out=True), ModelFacts())  # 5 columns: not a multiple of 4
    assert native.layout == LayoutSpec(return_lse=False)


def test_a_declared_envelope_is_checked_at_its_severity() -> None:
    from mla_verify.backends.base import Envelope

    envelope = Envelope(devices=("cpu",), page_sizes=(64,), dims=((512, 64),), dtypes=("bf16",), cache_dims=(3, 4),
                        table_widths=("native", "pad128"))
    narrow = KernelContract("k", envelope=envelope)
    message = only(precheck(LiveCall(paged(), narrow), ModelFacts()).findings, ERROR, "call")
    assert "page size 32" in message


def test_the_describing_spec_states_the_problem_and_cannot_regenerate_it() -> None:
    problem = live_problem(paged())
    spec = describing_spec(problem)
    assert (spec.seq_lens, spec.num_heads, spec.page_size, spec.table_pad, spec.extra_pages) == \
           (SPEC.seq_lens, 4, 32, 1, 3)
    assert spec.bmm1_scale == problem.bmm1_scale and spec.bmm2_scale == problem.bmm2_scale
    with pytest.raises(Exception, match="live"):
        build_problem(spec)


def test_compacting_keeps_the_numbers_and_only_the_pages_read() -> None:
    problem = live_problem(paged())
    small = compact(problem)
    assert small.num_pages == int(problem.pages_used().sum()) < problem.num_pages
    assert torch.equal(reference_decode(small).out, reference_decode(problem).out)
    one = compact(problem, [1])
    assert one.batch == 1 and one.num_pages == 4
    assert torch.equal(reference_decode(one).out, reference_decode(problem).out[1:2])
    # the kernel sees the same rows too: a kernel's output does not depend on page ids
    def peer(p):
        return cpu_peer_decode(p.query, p.kv_cache, None, 128, 512, 64, p.block_table, p.seq_lens, 100)
    assert torch.equal(peer(small), peer(problem))


def test_compacting_keeps_the_window_and_the_kept_rows_query_lengths() -> None:
    spec = replace(SPEC, q_len=3, q_lens=(2, 3, 1), window_left=7)
    problem = build_problem(spec)
    assert describing_spec(problem).window_left == 7 and describing_spec(problem).q_lens == (2, 3, 1)
    two = compact(problem, [0, 2])
    assert (two.window_left, two.q_lens) == (7, (2, 1))
    # a dropped window or q_lens would attend to more tokens and change these rows
    assert torch.equal(reference_decode(two).out, reference_decode(problem).out[[0, 2]])
