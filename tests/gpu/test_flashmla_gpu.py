"""DeepSeek's FlashMLA dense decode on a real GPU, judged against the reference on that GPU.

Marked ``gpu``; skips with the backend's own reason where it cannot run: "install FlashMLA: ..." without the
``flash_mla`` package, "needs SM90 ..." on another GPU. The grid crosses the head counts FlashMLA's own tests use
(1, 3, 9, 63, 64, 126, 128, and the TP ones) with q_len 1, 2 and 4 (causal), lengths at page edges and past
one split, the cache page-strided and not, the table at native and padded width. The acceptance run is
``verify(..., "premerge")``; with MLA_VERIFY_GPU_RECORD=DIR it writes DIR/flashmla.json.
"""
from __future__ import annotations

import pytest
import torch
from test_flashinfer_gpu import MIN_PASS, _cuda, _runnable, acceptance_run

from mla_verify.core.dims import R1_SOFTMAX_SCALE
from mla_verify.problems.generate import ProblemSpec
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.run.harness import run_case

pytestmark = pytest.mark.gpu

NAME = "flashmla"
HEADS = (1, 3, 8, 9, 16, 32, 63, 64, 126, 128)


def _flashmla():
    """The backend and its device; "install FlashMLA: ..." comes first, even where no GPU is visible."""
    backend = _runnable(NAME, torch.device("cuda"))
    return backend, _cuda()


@pytest.mark.parametrize("q_len", [1, 2, 4])
@pytest.mark.parametrize("heads", HEADS)
def test_flashmla_grid(heads: int, q_len: int) -> None:
    backend, device = _flashmla()
    lens = tuple(max(q_len, n) for n in (1, 63, 64, 65, 140, 4096, 16385))
    layouts = (LayoutSpec(pass_out=False), LayoutSpec(page_stride_pad=3, table_width="pad128", pass_out=False))
    for i, layout in enumerate(layouts):
        spec = ProblemSpec(seq_lens=lens, q_len=q_len, num_heads=heads, page_size=64,
                           softmax_scale=R1_SOFTMAX_SCALE, bmm2_extra=1.25, extra_pages=3, table_pad=2,
                           values=("normal", "outliers")[i], seed=heads * 10 + q_len + 1000 * i)
        result = run_case(backend, spec, layout, device, transform=("pages", "batch")[i])
        assert result.verdict == "pass", f"{result.describe()}: {result.reason} {result.failures}"


def test_flashmla_passes_the_premerge_run() -> None:
    backend, device = _flashmla()
    record = acceptance_run(backend, device)
    assert record["passed"] >= MIN_PASS, record["skip_reasons"]
