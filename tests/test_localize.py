"""localize.py: where a wrong output is wrong -- which rows, which keys, whence its NaN -- for faults the
diagnosis catalog lacks; and diagnose_safely, which falls back to it and never raises."""
from __future__ import annotations

import re
from dataclasses import replace

import faulty_kernels
import pytest
import torch
from test_kill_matrix import shows_what_is_wrong

from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.backends.user_kernel import load_kernel
from mla_verify.judge import localize as localize_module
from mla_verify.judge.diagnose import WHERE, diagnose, diagnose_safely, explained
from mla_verify.judge.localize import localize
from mla_verify.kernels.mutants import MUTANTS
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.problems.problem import DecodeProblem
from mla_verify.problems.reference import reference_decode
from mla_verify.records.failure import failure_lines
from mla_verify.run.engine import verify
from mla_verify.run.harness import CaseResult, run_case

SMALL = dict(kv_lora_rank=256, page_size=16)
FAULTY = ("upper_heads_rescaled", "splits_capped", "empty_split_nan")


def _run(name: str, spec: ProblemSpec) -> CaseResult:
    result = run_case(load_kernel(f"faulty_kernels:{name}"), spec, LayoutSpec(), "cpu")
    assert result.verdict == "fail", result.reason
    assert not explained(result.diagnosis), result.diagnosis  # these faults are outside the catalog
    return result


def _line(lines: list[str], start: str) -> str:
    found = [line for line in lines if line.startswith(WHERE + start)]
    assert len(found) == 1, lines
    return found[0]


def _attention(p: DecodeProblem, visible) -> torch.Tensor:
    """Test oracle, dense float64: query token t of sequence b attends to the positions where
    ``visible(b, t, positions)`` holds; bf16 output [B, Q, H, L]."""
    L, Q = p.dims.kv_lora_rank, p.q_len
    out = torch.empty(p.out_shape, dtype=torch.float64)
    for b, n in enumerate(p.seq_lens.tolist()):
        pages = p.block_table[b, : -(-n // p.page_size)].long()
        rows = p.kv_cache[pages].reshape(-1, p.kv_cache.shape[-1])[:n].double()
        for t in range(Q):
            keep = visible(b, t, torch.arange(n))
            s = p.query[b, t].double() @ rows[keep].T * p.bmm1_scale  # [H, kept]
            out[b, t] = torch.softmax(s, -1) @ rows[keep, :L] * p.bmm2_scale
    return out.to(torch.bfloat16)


def _causal(p: DecodeProblem, b: int, t: int) -> int:
    """The last position query token t of sequence b may see."""
    return int(p.seq_lens[b]) - p.q_len + t


# ---------------------------------------------------------------- which rows
def test_a_fault_in_heads_64_and_up_is_localized_to_them():
    spec = ProblemSpec((40, 70), num_heads=128, **SMALL)
    tile, H = faulty_kernels.HEAD_TILE, spec.num_heads
    result = _run("upper_heads_rescaled", spec)
    assert _line(result.diagnosis, "out is wrong") == (
        WHERE + f"out is wrong in heads {tile}-{H - 1}; right in heads 0-{tile - 1} "
        f"({spec.batch * (H - tile)} of {spec.batch * H} rows wrong)")
    assert _line(result.diagnosis, "the LSE is wrong").startswith(WHERE + f"the LSE is wrong in heads {tile}-{H - 1} ")
    # a scale on some heads is not a matter of which keys are read
    assert _line(result.diagnosis, "keys:").startswith(WHERE + "keys: no masking of KV positions explains")


@pytest.mark.parametrize("corrupt, wrong, right", [
    (lambda p, o: o[:, 1:].mul_(1.5), "query tokens after the first", "query token 0"),
    (lambda p, o: o[:, :, 2].neg_(), "head 2", "heads 0-1, 3"),
    (lambda p, o: o.mul_(1 + (p.seq_lens >= 60).view(-1, 1, 1, 1)),
     "the batch entries with seq_len >= 60: batch entries 1, 3 (seq_lens 60, 90)",
     "the batch entries with seq_len <= 41: batch entries 0, 2 (seq_lens 20, 41)"),
    (lambda p, o: o[1, 1, 0].neg_(), "batch entry 1 (seq_len 60) and query token 1 and head 0", None),
])
def test_wrong_rows_are_named_by_the_simplest_rule(corrupt, wrong, right):
    p = build_problem(ProblemSpec((20, 60, 41, 90), q_len=3, num_heads=4, **SMALL))
    truth = reference_decode(p)
    out = truth.out.to(torch.bfloat16)
    corrupt(p, out)
    line = _line(localize(p, out, truth), "out is wrong")
    assert line.startswith(WHERE + f"out is wrong in {wrong}; " + (f"right in {right} " if right else "the other"))


def test_query_tokens_are_named_by_position_when_that_fits():
    # q_len 4 over lengths 10 and 12: the tokens at positions >= 9 are tokens 3 of the first, 1-3 of the second
    p = build_problem(ProblemSpec((10, 12), q_len=4, num_heads=2, **SMALL))
    truth = reference_decode(p)
    out = truth.out.to(torch.bfloat16)
    positions = p.seq_lens[:, None] - p.q_len + torch.arange(p.q_len)
    out[positions >= 9] *= 3
    assert "the query tokens at positions >= 9" in _line(localize(p, out, truth), "out is wrong")


def test_an_output_that_is_right_everywhere_says_so():
    m = MUTANTS["out_ignored"]
    result = run_case(TrtllmStyleBackend(m.name, m.fn), m.trigger, m.trigger_layout, "cpu")
    assert result.verdict == "fail" and result.diagnosis[0].startswith(
        WHERE + "every row of out (batch entry, query token, head) is within its tolerance")


# ---------------------------------------------------------------- which keys
def test_keys_past_a_position_ignored_are_found():
    cap = faulty_kernels.MAX_SPLITS * faulty_kernels.SPLIT
    spec = ProblemSpec((100, cap + 44, cap + 134), q_len=2, num_heads=2, **SMALL)
    result = _run("splits_capped", spec)
    assert _line(result.diagnosis, "out is wrong").startswith(
        WHERE + f"out is wrong in the batch entries with seq_len >= {cap + 44}")
    assert _line(result.diagnosis, "keys:").startswith(WHERE + f"keys: KV positions >= {cap} are ignored --")


def test_long_sequences_are_searched_in_chunks(monkeypatch):
    monkeypatch.setattr(localize_module, "MAX_CHUNKS", 64)  # 400 positions: chunks of 8
    cap = faulty_kernels.MAX_SPLITS * faulty_kernels.SPLIT
    result = _run("splits_capped", ProblemSpec((400,), num_heads=1, **SMALL))
    assert _line(result.diagnosis, "keys:").startswith(
        WHERE + f"keys: KV positions >= {cap} are ignored (searched in steps of 8 positions) --")


def test_positions_past_32768_ignored_in_a_long_sequence():
    """A position index wrapping at 2^15: what a kernel attending to positions < 32768 only returns (for one
    query token, the reference of the sequence cut there)."""
    wrap = 1 << 15
    p = build_problem(ProblemSpec((wrap + 7232,), num_heads=1, **SMALL))
    out = reference_decode(replace(p, seq_lens=torch.tensor([wrap], dtype=torch.int32))).out.to(torch.bfloat16)
    assert _line(localize(p, out, reference_decode(p)), "keys:").startswith(
        WHERE + f"keys: KV positions >= {wrap} are ignored (searched in steps of ")


def test_a_causal_limit_one_too_far_is_found():
    # short sequences: one key more moves every row it reaches past its tolerance
    p = build_problem(ProblemSpec((8, 12), q_len=4, num_heads=2, **SMALL))
    out = _attention(p, lambda b, t, pos: pos <= _causal(p, b, t) + 1)
    lines = localize(p, out, reference_decode(p))
    assert _line(lines, "out is wrong").startswith(WHERE + "out is wrong in query tokens before the last; ")
    assert _line(lines, "keys:").startswith(WHERE + "keys: the causal limit is off by +1")


def test_a_per_row_key_rule_names_the_rows_and_the_key():
    # rows whose causal limit is a page's last slot read the next key too: positions 7 (batch 0, token 1),
    # 15 (batch 1, token 2) and 23 (batch 2, token 1) in 8-token pages -- no product of axes, nor a threshold;
    # one head, and short sequences: one key more moves each such row past its tolerance
    p = build_problem(ProblemSpec((10, 17, 26), q_len=4, num_heads=1, kv_lora_rank=256, page_size=8))
    page = p.page_size
    out = _attention(p, lambda b, t, pos: pos <= _causal(p, b, t) + int(_causal(p, b, t) % page == page - 1))
    lines = localize(p, out, reference_decode(p))
    assert _line(lines, "out is wrong").startswith(
        WHERE + f"out is wrong in the query tokens at positions at the last slot of a page (position % {page} == "
        f"{page - 1})")
    assert _line(lines, "keys:").startswith(WHERE + "keys: the causal limit is off by +1")


def test_rows_that_are_all_zero_are_said_to_read_no_key():
    # a kernel that cuts a page-aligned sequence to nothing writes 0 there: no masking of keys gives 0, so the
    # key search would say "the values are off" -- the wrong line to look at
    p = build_problem(ProblemSpec((16, 20), num_heads=2, **SMALL))
    out = reference_decode(p).out.to(torch.bfloat16)
    out[0] = 0
    lines = localize(p, out, reference_decode(p))
    assert _line(lines, "out is wrong").startswith(WHERE + "out is wrong in batch entry 0")
    assert _line(lines, "keys:").startswith(WHERE + "keys: none -- every finite wrong row of out is 0"), lines


@pytest.mark.parametrize("visible, words", [
    (lambda limit, w: lambda pos: pos <= limit, "the sliding window is ignored"),
    (lambda limit, w: lambda pos: (pos <= limit) & (pos >= limit - w + 1), "the sliding window starts 1 position late"),
])
def test_a_misread_sliding_window_is_found(visible, words):
    window = 10  # token t sees the 10 positions before its own, and its own
    p = build_problem(ProblemSpec((40, 70), q_len=2, num_heads=2, window_left=window, **SMALL))
    out = _attention(p, lambda b, t, pos: visible(_causal(p, b, t), window)(pos))
    assert _line(localize(p, out, reference_decode(p)), "keys:").startswith(WHERE + f"keys: {words}")


def test_one_missing_key_is_found_with_its_page_slot():
    p = build_problem(ProblemSpec((50, 90), num_heads=2, **SMALL))
    missing = 37
    out = _attention(p, lambda b, t, pos: pos != missing)
    line = _line(localize(p, out, reference_decode(p)), "keys:")
    page = p.page_size
    assert line.startswith(WHERE + f"keys: one key missing from each row: position {missing} "
                                   f"(block-table entry {missing // page}, slot {missing % page})")


# ---------------------------------------------------------------- whence NaN
def test_a_nan_from_a_fully_masked_split_is_not_blamed_on_reads_outside_the_sequence():
    spec = ProblemSpec((30, 150, 20, 190), num_heads=2, **SMALL)
    result = _run("empty_split_nan", spec)
    short = [b for b, n in enumerate(spec.seq_lens) if max(spec.seq_lens) - n >= faulty_kernels.SPLIT]
    nan = _line(result.diagnosis, "NaN in")
    assert f"batch entries {', '.join(map(str, short))} " in nan
    assert "the kernel makes them itself" in nan and "read from the unused cache slots" not in nan
    assert not any("a read outside the sequence" in f for f in result.failures)  # nor does compare.py


def test_a_nan_read_from_unused_slots_is_told_apart():
    m = MUTANTS["nan_leak_unmasked_tail"]
    backend = TrtllmStyleBackend(m.name, m.fn)
    result = run_case(backend, m.trigger, m.trigger_layout, "cpu", diagnose=False)
    truth = reference_decode(result.problem)

    def rerun(p: DecodeProblem) -> torch.Tensor | None:
        return run_case(backend, m.trigger, m.trigger_layout, "cpu", problem=p, diagnose=False).out

    told = _line(localize(result.problem, result.out, truth, rerun=rerun), "NaN in")
    assert "read from the unused cache slots" in told and "makes them itself" not in told
    assert "not told apart" in _line(localize(result.problem, result.out, truth), "NaN in")


# ---------------------------------------------------------------- fp8, and failing safely
def _rolled_cache_out(p: DecodeProblem) -> torch.Tensor:
    """What a kernel reading cache rows as [rope | latent] returns (the catalog's cache_rope_first)."""
    R = p.dims.qk_rope_head_dim
    wide = p.kv_cache.to(torch.bfloat16)
    rolled = torch.cat([wide[..., R:], wide[..., :R]], dim=-1).to(p.kv_cache.dtype)
    return reference_decode(replace(p, kv_cache=rolled)).out.to(torch.bfloat16)


def _fp8_problem(device: str) -> DecodeProblem:
    return build_problem(ProblemSpec((40, 100), num_heads=4, page_size=32, dtype="fp8", q_scale=0.5, k_scale=0.25,
                                     seed=2), device)


def _check_fp8_diagnosis(p: DecodeProblem) -> None:
    names = [e.name for e in diagnose(p, _rolled_cache_out(p.to("cpu")).to(p.device))]
    assert "cache_rope_first" in names, names
    truth = reference_decode(p, torch.float32)
    out = truth.out.to(torch.bfloat16)
    out[:, :, 2:] *= 2  # the upper half of the heads scaled
    lines = diagnose_safely(p, out, truth=truth)
    assert _line(lines, "out is wrong").startswith(WHERE + "out is wrong in heads 2-3; right in heads 0-1 ")


def test_fp8_problems_are_diagnosed():
    _check_fp8_diagnosis(_fp8_problem("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here: this diagnoses fp8 problems on one, "
                    "where fp8 tensors lack roll and indexing")
def test_fp8_problems_are_diagnosed_on_cuda():
    _check_fp8_diagnosis(_fp8_problem("cuda"))


def test_an_error_inside_diagnosis_is_one_line(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(localize_module, "localize", broken)
    p = build_problem(ProblemSpec((20,), num_heads=2, **SMALL))
    truth = reference_decode(p)
    lines = diagnose_safely(p, (truth.out * 2).to(torch.bfloat16), truth=truth)
    assert len(lines) == 1 and re.fullmatch(r"diagnosis failed: RuntimeError: boom at test_localize\.py:\d+ in broken",
                                            lines[0]), lines


# ---------------------------------------------------------------- every FAIL block says something
@pytest.mark.parametrize("name", FAULTY)
def test_premerge_fail_blocks_of_the_faulty_kernels_say_where(name):
    result = verify(load_kernel(f"faulty_kernels:{name}"), "cpu", "premerge")
    assert result.verdict == "fail"
    assert shows_what_is_wrong(result.failure), failure_lines(result.failure, None)
