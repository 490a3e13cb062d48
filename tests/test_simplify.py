"""A failing corner case is reported near the smallest case that still fails, its incidental features dropped."""
from __future__ import annotations

from typing import Any

from mla_verify.backends.cpu_peer import cpu_peer_decode
from mla_verify.backends.trtllm_style import TRTLLM_ENVELOPE, TrtllmStyleBackend
from mla_verify.draw.strategies import Case
from mla_verify.kinds.dense import FEATURES
from mla_verify.problems.generate import ProblemSpec
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.run.engine import verify
from mla_verify.run.simplify import MAX_ATTEMPTS, simplify

WRAP_AT = 4_000  # the kernels below go wrong only on sequences longer than this
LONGEST = 16_384  # the end-to-end run's envelope: its longest corner case is 4x WRAP_AT (cheap on 2 cores)
# and at most this many sequences: the failure is one long sequence; the default's 1024-sequence cases only
# make the run's other corner and drawn cases slow (~20 s of the run's ~22 on 2 cores)
WIDEST = 16


def test_simplify_drops_features_and_approaches_the_shortest_failing_length():
    big = Case(ProblemSpec(seq_lens=(131_072, 7), q_len=2, num_heads=8, page_size=64, extra_pages=3, table_pad=2,
                           pad_fill="oob", bmm2_extra=1.5, softmax_scale=0.1352),
               LayoutSpec(cache_dims=4, page_stride_pad=5, table_width="pad128"), "pages")
    tried = []

    def fails(case: Case) -> bool:
        tried.append(case)
        return max(case.spec.seq_lens) > WRAP_AT

    small = simplify(big, TRTLLM_ENVELOPE, fails)
    s, layout = small.spec, small.layout
    assert max(s.seq_lens) <= 2 * WRAP_AT and s.batch == 1 and s.num_heads == 1 and s.q_len == 1
    assert (s.extra_pages, s.table_pad, s.pad_fill, s.bmm2_extra, s.softmax_scale) == (0, 0, "zero", 1.0, None)
    assert (layout.cache_dims, layout.page_stride_pad, layout.table_width, small.transform) == (3, 0, "native", "none")
    assert len(tried) <= MAX_ATTEMPTS + FEATURES  # the bound simplify promises: its sizes pass, then each feature once


def wraps(query: Any, kv_cache: Any, workspace: Any, qk_nope: int, rank: int, rope: int, block_tables: Any,
          seq_lens: Any, max_seq_len: int, **kwargs: Any) -> Any:
    """Correct, but attends to at most WRAP_AT keys (a position counter that wraps)."""
    return cpu_peer_decode(query, kv_cache, workspace, qk_nope, rank, rope, block_tables,
                           seq_lens.clamp(max=WRAP_AT), max_seq_len, **kwargs)


def test_premerge_reports_a_long_sequence_failure_near_its_shortest_length():
    # the longest-sequence corner case (LONGEST tokens) fails first; it must be reported near WRAP_AT
    envelope = TRTLLM_ENVELOPE.narrowed(max_seq_len=LONGEST, max_batch=WIDEST)
    result = verify(TrtllmStyleBackend("wraps", wraps, envelope), "cpu", "premerge", max_examples=4)
    assert result.verdict == "fail"
    assert WRAP_AT < max(result.failure.spec.seq_lens) <= 2 * WRAP_AT, result.failure.spec.describe()
