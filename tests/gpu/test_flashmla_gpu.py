"""DeepSeek's FlashMLA dense decode on a real GPU -- bf16 (``flashmla``) and per-tensor fp8 (``flashmla-fp8``) --
judged against the reference on that GPU; what the wheel does with a stale schedule; shadow mode catching it.

Marked ``gpu``; skips with the backend's own reason where it cannot run: "install FlashMLA: ..." without the
``flash_mla`` package, "needs SM90 ..." on another GPU, and flashmla-fp8 without the sgl-flash-mla wheel. The
grids cross the head counts FlashMLA's own tests use (1, 3, 9, 63, 64, 126, 128, and the TP ones) with q_len 1, 2
and 4 (causal), lengths at page edges and past one split, the cache page-strided and not, the table at native
and padded width, and the batch reversed (judged within tolerance: FlashMLA's claim). The acceptance runs are
``verify(..., "premerge")``; with MLA_VERIFY_GPU_RECORD=DIR they write DIR/flashmla.json and
DIR/flashmla-fp8.json, and the stale-schedule probe DIR/flashmla-stale-schedule.json.

The stale-schedule tests come last and reuse a schedule only for longer sequences than it was made for (the
engine's next step), so a kernel that trusts the old schedule reads fewer blocks, never past the table.
"""
from __future__ import annotations

import io
import json
import math
import re
import warnings
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_flashinfer_gpu import MIN_PASS, RECORD_DIR, _cuda, _runnable, acceptance_run

from mla_verify.core.dims import R1_SOFTMAX_SCALE
from mla_verify.core.platform import platform_info
from mla_verify.judge.compare import baseline_result, compare
from mla_verify.kinds.dense import DENSE_KIND
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.run.harness import run_case
from mla_verify.shadow import ShadowError, shadow

pytestmark = pytest.mark.gpu

HEADS = (1, 3, 8, 9, 16, 32, 63, 64, 126, 128)
LAYOUTS = (LayoutSpec(pass_out=False), LayoutSpec(page_stride_pad=3, table_width="pad128", pass_out=False))


def _ready(name: str):
    """The backend and its device; "install FlashMLA: ..." comes first, even where no GPU is visible."""
    backend = _runnable(name, torch.device("cuda"))
    return backend, _cuda()


def _grid(name: str, heads: int, q_len: int, **spec) -> None:
    backend, device = _ready(name)
    lens = tuple(max(q_len, n) for n in (1, 63, 64, 65, 140, 4096, 16385))
    for i, layout in enumerate(LAYOUTS):
        case = ProblemSpec(seq_lens=lens, q_len=q_len, num_heads=heads, page_size=64, softmax_scale=R1_SOFTMAX_SCALE,
                           bmm2_extra=1.25, extra_pages=3, table_pad=2, values=("normal", "outliers")[i],
                           seed=heads * 10 + q_len + 1000 * i)
        result = run_case(backend, replace(case, **spec), layout, device, transform=("pages", "batch")[i])
        assert result.verdict == "pass", f"{result.describe()}: {result.reason} {result.failures}"


@pytest.mark.parametrize("q_len", [1, 2, 4])
@pytest.mark.parametrize("heads", HEADS)
def test_flashmla_grid(heads: int, q_len: int) -> None:
    _grid("flashmla", heads, q_len)


@pytest.mark.parametrize("q_len", [1, 2])
@pytest.mark.parametrize("heads", [1, 16, 128])
def test_flashmla_without_rope(heads: int, q_len: int) -> None:
    """head_size_k 512 (dims (512, 0)): accepted by the wheel's dense_decode check; proven here."""
    _grid("flashmla", heads, q_len, qk_rope_head_dim=0)


@pytest.mark.parametrize("q_len", [1, 2, 4])
@pytest.mark.parametrize("heads", [1, 16, 64, 128])
def test_flashmla_fp8_grid(heads: int, q_len: int) -> None:
    _grid("flashmla-fp8", heads, q_len, dtype="fp8", q_scale=2.0, k_scale=0.375)


@pytest.mark.parametrize("name", ["flashmla", "flashmla-fp8"])
def test_flashmla_passes_the_premerge_run(name: str) -> None:
    backend, device = _ready(name)
    record = acceptance_run(backend, device)
    assert record["passed"] >= MIN_PASS, record["skip_reasons"]


# --- the stale schedule -------------------------------------------------------------------------------------------

FIRST = ProblemSpec(seq_lens=(64, 65, 200, 1), num_heads=16, page_size=64, softmax_scale=R1_SOFTMAX_SCALE, seed=7)
LATER = replace(FIRST, seq_lens=(4096, 9000, 20000, 3000), seed=8)  # the same shapes, far longer sequences


def _decode(flash_mla, spec: ProblemSpec, meta, device: torch.device):
    p = build_problem(spec, device)
    out, lse = flash_mla.flash_mla_with_kvcache(p.query, p.kv_cache.unsqueeze(2), p.block_table, p.seq_lens, 512,
                                                meta, softmax_scale=p.bmm1_scale, causal=True, use_legacy=True)
    torch.cuda.synchronize(device)
    return p, out, lse


def _judged(p, out, lse) -> list[str]:
    return compare(out, lse.transpose(1, 2), DENSE_KIND.reference(p), baseline_result(p, "bf16"), "bf16", math.e)[1]


def test_what_the_wheel_does_with_a_stale_schedule() -> None:
    """Reused for longer sequences, the schedule is silently stale: no error is raised, and the output is wrong (as
    measured on the H200, 2026-12-04: docs/backends.md). The finding is recorded too (a warning in pytest's
    summary, and MLA_VERIFY_GPU_RECORD)."""
    _ready("flashmla")
    device = _cuda()
    import flash_mla

    meta, _ = flash_mla.get_mla_metadata()
    _decode(flash_mla, FIRST, meta, device)
    made = meta.tile_scheduler_metadata.clone()
    p, stale_out, stale_lse = _decode(flash_mla, LATER, meta, device)  # must not raise: the reuse is unchecked
    _, fresh_out, _ = _decode(flash_mla, LATER, flash_mla.get_mla_metadata()[0], device)
    failures = _judged(p, stale_out, stale_lse)
    differ = int((stale_out.view(torch.int16) != fresh_out.view(torch.int16)).sum())
    finding = {"schedule_kept": bool(torch.equal(made, meta.tile_scheduler_metadata)),
               "elements_differing_from_a_fresh_schedule": differ, "of": stale_out.numel(),
               "judged_against_the_reference": failures or "within tolerance",
               "first": FIRST.to_json(), "later": LATER.to_json(), "platform": platform_info().to_json()}
    if RECORD_DIR:
        path = Path(RECORD_DIR) / "flashmla-stale-schedule.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(finding, indent=1) + "\n")
    warnings.warn(f"FlashMLA stale schedule: {json.dumps({k: finding[k] for k in list(finding)[:4]})}", stacklevel=1)
    assert finding["schedule_kept"], "the wheel rebuilt the schedule: the hazard is not what its Python says"
    assert failures, "the stale schedule gave a right answer: docs/backends.md says it is silently wrong"
    assert not _judged(*_decode(flash_mla, LATER, flash_mla.get_mla_metadata()[0], device))  # fresh: right


def test_a_stale_schedule_for_another_batch_size_is_refused() -> None:
    """The one stale reuse the wheel catches: num_splits is checked against the batch size before the launch."""
    _ready("flashmla")
    device = _cuda()
    import flash_mla

    meta, _ = flash_mla.get_mla_metadata()
    _decode(flash_mla, FIRST, meta, device)
    with pytest.raises(RuntimeError, match=r"num_splits must have shape \(batch_size\+1\)"):
        _decode(flash_mla, replace(LATER, seq_lens=LATER.seq_lens[:3]), meta, device)


def test_shadow_mode_catches_a_stale_schedule_at_its_call_site(tmp_path: Path) -> None:
    """The planted integration bug: one FlashMLASchedMeta kept across decode steps. Layers of one step sharing it
    are fine (no report); the next step's call is reported, naming this file and line."""
    _ready("flashmla")
    device = _cuda()
    import flash_mla

    with shadow("strict", stream=io.StringIO(), summary=False, fixtures_dir=tmp_path) as session:
        meta, _ = flash_mla.get_mla_metadata()
        for _ in range(2):  # two layers of the first step
            _decode(flash_mla, FIRST, meta, device)
    total = session.tally.total()
    assert (total.errors, total.warnings, total.mismatched, total.compared) == (0, 0, 0, 2), session.summary_lines()
    with pytest.raises(ShadowError) as caught, shadow("strict", stream=io.StringIO(), summary=False,
                                                      fixtures_dir=tmp_path):
        meta, _ = flash_mla.get_mla_metadata()
        _decode(flash_mla, FIRST, meta, device)
        _decode(flash_mla, LATER, meta, device)  # the bug: the first step's schedule
    message = str(caught.value)
    assert "stale schedule" in message and "cache_seqlens=[64, 65, 200, 1]" in message
    line = int(re.search(r"test_flashmla_gpu\.py:(\d+) in flash_mla_with_kvcache", message).group(1))
    assert "flash_mla.flash_mla_with_kvcache(" in Path(__file__).read_text().splitlines()[line - 1]
