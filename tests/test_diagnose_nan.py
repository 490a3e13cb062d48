"""The diagnosis never names a misreading it cannot confirm: output that is NaN where the reference is finite
is re-judged with finite poison; misreadings that tie are told apart on shorter sequences or listed as
candidates; wrong rows holding other rows' answers are named as a mapping; and the first failing case's
diagnosis reaches the FAIL block when it tells more than the minimal case's."""
from __future__ import annotations

import faulty_kernels  # noqa: F401 - load_kernel finds the kernels by module name
import pytest

from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.backends.user_kernel import load_kernel
from mla_verify.judge.diagnose import CANDIDATES, WHERE, explained
from mla_verify.kernels.mutants import MUTANTS
from mla_verify.problems.generate import ProblemSpec
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.records.failure import failure_lines
from mla_verify.run.engine import verify
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


def test_dropping_page_aligned_sequences_last_page_is_told_on_screen() -> None:
    # the minimal case (one page-aligned sequence) cannot show which sequences are wrong; the first failing
    # case, a batch of lengths aligned and not, can, and the FAIL block prints it
    result = verify(load_kernel("faulty_kernels:aligned_last_page_dropped"), "cpu", "premerge")
    block = "\n".join(failure_lines(result.failure, None))
    assert "the batch entries with seq_len a multiple of the page size" in block, block
