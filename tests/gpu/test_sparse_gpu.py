"""Sparse (top-k) decode backends on a real GPU, judged against the float64 sparse reference on that GPU.

Marked ``gpu``; each test skips with its backend's own reason where it cannot run ("install FlashMLA: ..."
without the wheel, "needs SM90 ..." elsewhere, FlashInfer missing). FlashMLA's grid crosses every format SM90
runs (V32, V32_NO_ROPE, V4) and scale convention with the head counts it pads (1, 64, 100 and 128), one and two
query tokens, topk 64 and 2048, -1 at the front, duplicates, sinks and (V4) topk_length. fa3-as-sparse runs the
bf16 and V32 caches. Then each backend's premerge run must pass -- the premerge every kind gets (corner cases,
drawn cases, the tolerance model with its baseline, poisoned output, repeatability, metamorphic relations).
"""
from __future__ import annotations

import pytest
import torch

from mla_verify.backends import get_backend
from mla_verify.problems.sparse import SPARSE_LAYOUT, SparseSpec
from mla_verify.run.engine import verify
from mla_verify.run.harness import run_case

pytestmark = pytest.mark.gpu


def _runnable(name: str):
    backend = get_backend(name)
    reason = backend.unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"{name}: {reason}")
    return backend


def _grid(formats: tuple[tuple[str, str], ...], heads: int, q_len: int) -> list[SparseSpec]:
    specs = []
    for i, (fmt, scales) in enumerate(formats):
        for topk, pages in ((64, 2), (2048, 40)):
            specs.append(SparseSpec(batch=3, q_len=q_len, num_heads=heads, topk=topk, page_size=64,
                                    used_pages=pages, extra_pages=2, fmt=fmt, scales=scales, invalid=0.1,
                                    invalid_front=i % 2 == 0, duplicates=i % 2 == 1,
                                    topk_lengths=(topk // 2, 0, topk) if fmt == "V4" else None,
                                    sink=("finite", "mixed", "none")[i % 3], softmax_scale=576 ** -0.5 * 1.25,
                                    seed=heads * 10 + q_len + i))
    return specs


FLASHMLA_FORMATS = (("V32", "pow2"), ("V32", "amax"), ("V32_NO_ROPE", "pow2"), ("V32_NO_ROPE", "amax"),
                    ("V4", "pow2"))


@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("heads", [1, 64, 100, 128])
def test_flashmla_sparse_grid(heads: int, q_len: int) -> None:
    backend = _runnable("flashmla-sparse")
    for spec in _grid(FLASHMLA_FORMATS, heads, q_len):
        case = run_case(backend, spec, SPARSE_LAYOUT, "cuda")
        assert case.verdict == "pass", f"{case.describe()}: {case.failures} {case.diagnosis}"


@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("heads", [1, 16, 128])
def test_fa3_sparse_grid(heads: int, q_len: int) -> None:
    backend = _runnable("fa3-sparse")
    for spec in _grid((("bf16", "pow2"), ("V32", "amax")), heads, q_len):
        case = run_case(backend, SparseSpec(**{**spec.to_json(), "sink": "none", "topk_lengths": None}),
                        SPARSE_LAYOUT, "cuda")
        assert case.verdict == "pass", f"{case.describe()}: {case.failures} {case.diagnosis}"


@pytest.mark.parametrize("name", ["flashmla-sparse", "fa3-sparse"])
def test_sparse_backend_passes_premerge(name: str) -> None:
    result = verify(_runnable(name), "cuda", "premerge")
    assert result.verdict == "pass", result.failure and (result.failure.describe(), result.failure.failures,
                                                         result.failure.diagnosis)
    assert sum(c.verdict == "pass" for c in result.cases) >= 40  # corner cases and drawn ones ran, not skipped
