"""The diagnosis never names a misreading it cannot confirm: output that is NaN where the reference is finite
is re-judged with finite poison; misreadings that tie are told apart on shorter sequences or listed as
candidates; wrong rows holding other rows' answers (batch entries, heads, query tokens) are named as a
mapping; and `mla-verify check` prints the first failing case's diagnosis when it tells more than the minimal
case's."""
from __future__ import annotations

import os
from pathlib import Path

import faulty_kernels  # noqa: F401 - load_kernel finds the kernels by module name
import pytest
import torch

from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.backends.user_kernel import load_kernel
from mla_verify.cli.main import main
from mla_verify.judge.diagnose import CANDIDATES, WHERE, diagnose_safely, explained
from mla_verify.kernels.mutants import MUTANTS
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.problems.reference import reference_decode
from mla_verify.run.harness import CaseResult, run_case

SMALL = dict(kv_lora_rank=256, page_size=16, num_heads=2)


def _faulty(name: str, spec: ProblemSpec, layout: LayoutSpec = LayoutSpec()) -> CaseResult:
    result = run_case(load_kernel(f"faulty_kernels:{name}"), spec, layout, "cpu")
    assert result.verdict == "fail", result.reason
    return result


@pytest.mark.parametrize("name, spec, layout", [
    # one token in page 0, the spare page after it all NaN: the kernel's whole output is NaN, as is that of
    # every misreading that reads a slot past the token (seq_len + 1, to the end of the page)
    ("next_page_read", ProblemSpec((1,), extra_pages=1, pad_fill="zero", **SMALL), LayoutSpec()),
    # page 1 of the pool starts one NaN row later than the kernel assumes: its tokens read as NaN
    ("page_stride_ignored", ProblemSpec((17, 3), pad_fill="zero", **SMALL), LayoutSpec(page_stride_pad=1)),
], ids=["skips_a_real_page", "ignores_the_page_stride"])
def test_all_nan_output_gets_no_false_misreading(name: str, spec: ProblemSpec, layout: LayoutSpec) -> None:
    result = _faulty(name, spec, layout)
    assert bool(result.out[0].isnan().all())  # the case is the one the fix is about
    assert not explained(result.diagnosis), result.diagnosis


@pytest.mark.parametrize("mutant, other", [("reads_to_page_end", "length_plus_1"),
                                           ("length_plus_1", "full_page_read")])
def test_reading_to_the_page_end_is_told_apart_from_one_token_more(mutant: str, other: str) -> None:
    # 31 and 63 tokens in 32-token pages: reading to the page end is reading one token more (a NaN slot),
    # so the case alone ties
    m = MUTANTS[mutant]
    result = run_case(TrtllmStyleBackend(mutant, m.fn), ProblemSpec((31, 63), num_heads=2, page_size=32),
                      LayoutSpec(), "cpu")
    assert result.verdict == "fail", result.reason
    named = " ".join(result.diagnosis)
    assert f"[{m.diagnosis}]" in named and f"[{other}]" not in named, result.diagnosis


def test_misreadings_no_case_can_part_are_listed_as_candidates() -> None:
    # R1's softmax scale is 1/sqrt(192) x mscale^2: on it, a fixed 1/sqrt(192) is also "mscale missing"
    m = MUTANTS["scale_fixed_192"]
    result = run_case(TrtllmStyleBackend("scale_fixed_192", m.fn), m.trigger, m.trigger_layout, "cpu")
    assert result.diagnosis[0].startswith(CANDIDATES), result.diagnosis
    assert "scale_1_sqrt_192" in result.diagnosis[0] and "yarn_mscale_missing" in result.diagnosis[0]


def test_rows_holding_other_rows_answers_are_named_as_a_mapping() -> None:
    result = _faulty("batch_entries_swapped", ProblemSpec((20, 33, 7), **SMALL))
    assert not explained(result.diagnosis), result.diagnosis
    assert WHERE + "rows hold other rows' right answers: batch entries 0 and 1 swapped" in result.diagnosis


@pytest.mark.parametrize("axis, order, words", [
    # heads rotated by one: no catalogued misreading (heads_reversed is the reversal), each head another's
    (2, [1, 2, 3, 0], "head 0 holds head 1's, head 1 holds head 2's, head 2 holds head 3's, head 3 holds head 0's"),
    # causal decode: query tokens 0 and 2 see different keys, so each holds the other's answer, not its own
    (1, [2, 1, 0], "query tokens 0 and 2 swapped"),
], ids=["heads_rotated", "query_tokens_swapped"])
def test_heads_and_query_tokens_holding_others_answers_are_named(axis: int, order: list[int], words: str) -> None:
    p = build_problem(ProblemSpec((40, 23), q_len=3, **{**SMALL, "num_heads": 4}))
    truth = reference_decode(p, precision=torch.float32)
    out = truth.out.index_select(axis, torch.tensor(order)).to(torch.bfloat16)  # row i holds row order[i]'s
    lines = diagnose_safely(p, out)
    assert not explained(lines), lines
    assert WHERE + "rows hold other rows' right answers: " + words in lines, lines


def test_dropping_page_aligned_sequences_last_page_is_told_on_screen(tmp_path: Path, capsys,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # the minimal case (one page-aligned sequence) cannot show which sequences are wrong; the first failing
    # case, a batch of lengths aligned and not, can, and `mla-verify check` prints it, not only the report
    # (check's CPU settings -- one torch thread -- must not outlast this test: the environment's count wins)
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads())))
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", os.environ.get("THP_MEM_ALLOC_ENABLE", "1"))
    code = main(["check", "--kernel", "faulty_kernels:aligned_last_page_dropped", "--device", "cpu",
                 "--profile", "premerge", "--fixtures-dir", str(tmp_path)])
    screen = capsys.readouterr().out
    assert code == 1, screen
    assert "the batch entries with seq_len a multiple of the page size" in screen, screen
    assert "as if it read no key" in screen and "the values are off" not in screen, screen
