"""Shadow mode on FlashMLA's dense calls, through the sgl-flash-mla wheel's interface on CPU (WheelStandIn).

- A ``FlashMLASchedMeta`` reused for a batch of other lengths or shapes is a stale schedule: reported at the call,
  naming the call site; reused within one step (every layer, same lengths), or made fresh, it is not.
- Sparse-only arguments handed to the dense path, which the wheel ignores without a word, are warned about and
  the call is still judged.
- The wheel's dense fp8 call is read with its descales and judged.
The GPU side (what the real wheel does with a stale schedule): tests/gpu/test_flashmla_gpu.py.
"""
from __future__ import annotations

import inspect
import io
import sys
import types
from dataclasses import replace

import pytest
import torch

from mla_verify.core.dims import R1_SOFTMAX_SCALE
from mla_verify.kernels.flashmla_cpu import WheelStandIn
from mla_verify.kernels.mutants import MUTANTS
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.shadow import ShadowError, shadow

SPEC = ProblemSpec(seq_lens=(37, 100), q_len=1, num_heads=4, page_size=64, softmax_scale=R1_SOFTMAX_SCALE, seed=4)
NEXT_STEP = replace(SPEC, seq_lens=(38, 101))  # one decode step later: every sequence a token longer
FP8_SPEC = replace(SPEC, dtype="fp8", q_scale=2.0, k_scale=0.5)


@pytest.fixture
def flash_mla(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A ``flash_mla`` module with the wheel's interface, computed on CPU."""
    module = types.ModuleType("flash_mla")
    stand_in = WheelStandIn()
    module.flash_mla_with_kvcache = stand_in.flash_mla_with_kvcache
    module.get_mla_metadata = stand_in.get_mla_metadata
    module.get_mla_decoding_metadata = stand_in.get_mla_decoding_metadata
    monkeypatch.setitem(sys.modules, "flash_mla", module)
    return module


@pytest.fixture(autouse=True)
def _reproducers_in(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a mismatch keeps its reproducer under fixtures/shadow of the working directory


def session(mode: str = "strict"):
    return shadow(mode, stream=io.StringIO(), summary=False)


def only_site(s):
    assert len(s.tally.sites) == 1, s.tally.sites
    return next(iter(s.tally.sites.values()))


SITE_LINE = 0


def decode(module: types.ModuleType, meta, spec: ProblemSpec = SPEC, **kwargs):
    """One dense bf16 decode call, as an engine's attention layer makes it."""
    global SITE_LINE
    p = build_problem(spec)
    SITE_LINE = inspect.currentframe().f_lineno + 1
    return module.flash_mla_with_kvcache(p.query, p.kv_cache.unsqueeze(2), p.block_table, p.seq_lens, 512, meta,
                                         softmax_scale=spec.bmm1_scale, causal=True, use_legacy=True, **kwargs)


def test_a_schedule_reused_for_the_next_step_is_reported_at_its_call_site(flash_mla) -> None:
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(ShadowError) as raised, session():
        decode(flash_mla, meta)  # the first call fills the schedule for lengths (37, 100)
        decode(flash_mla, meta, NEXT_STEP)  # the planted bug: the same sched meta one step later
    report = str(raised.value)
    assert f"test_shadow_flashmla.py:{SITE_LINE} in flash_mla_with_kvcache" in report
    assert "tile_scheduler_metadata" in report and "stale schedule" in report
    assert "filled for B=2 q_len=1 H=4 cache_seqlens=[37, 100]" in report
    assert "reused for B=2 q_len=1 H=4 cache_seqlens=[38, 101]" in report


def test_without_the_report_a_stale_schedule_is_silently_wrong(flash_mla) -> None:
    """What the report saves an engine from: the stale call raises nothing, and its output is off (as the wheel's
    was on the H200, docs/backends.md). Record mode lets it run, so the reference shows it."""
    meta, _ = flash_mla.get_mla_metadata()
    with session("record") as s:
        decode(flash_mla, meta)
        decode(flash_mla, meta, NEXT_STEP)
    site = only_site(s)
    assert (site.compared, site.errors, site.mismatched) == (2, 1, 1)


def test_a_schedule_reused_for_another_head_count_is_reported(flash_mla) -> None:
    """Silently wrong on the H200 (docs/backends.md); the stand-in does not model that, the report does not need to."""
    meta, _ = flash_mla.get_mla_metadata()
    with session("record") as s:
        decode(flash_mla, meta)
        decode(flash_mla, meta, replace(SPEC, num_heads=8))
    assert only_site(s).errors == 1
    assert "reused for B=2 q_len=1 H=8" in s.tally.reports[0]


def test_a_schedule_reused_for_another_batch_size_is_reported_before_the_wheel_raises(flash_mla) -> None:
    meta, _ = flash_mla.get_mla_metadata()
    with pytest.raises(RuntimeError, match=r"num_splits must have shape \(batch_size\+1\)") as raised, \
            session("record") as s:
        decode(flash_mla, meta)
        decode(flash_mla, meta, replace(SPEC, seq_lens=(37, 100, 5)))
    assert only_site(s).errors == 1
    assert f"test_shadow_flashmla.py:{SITE_LINE} in flash_mla_with_kvcache" in "\n".join(raised.value.__notes__)


def test_reuse_within_a_step_and_fresh_schedules_are_not_reported(flash_mla) -> None:
    with session() as s:
        meta, _ = flash_mla.get_mla_metadata()
        for _ in range(3):  # every layer of one step: the same lengths, the same schedule
            decode(flash_mla, meta)
        decode(flash_mla, flash_mla.get_mla_metadata()[0], NEXT_STEP)  # the next step, a fresh one
        meta.tile_scheduler_metadata = None  # or the old one emptied: the wheel makes it anew
        decode(flash_mla, meta, NEXT_STEP)
    site = only_site(s)
    assert (site.compared, site.errors, site.warnings, site.mismatched) == (5, 0, 0, 0)


@pytest.mark.parametrize("argument,value", [
    ("attn_sink", torch.zeros(4)),
    ("topk_length", torch.tensor([10, 10], dtype=torch.int32)),
    ("extra_k_cache", torch.zeros(1, 64, 1, 576, dtype=torch.bfloat16)),
    ("enable_batch_invariant", True),
])
def test_arguments_the_dense_path_ignores_are_warned_about(flash_mla, argument: str, value) -> None:
    with session() as s:  # a warning: strict mode does not raise, and the call is still judged
        decode(flash_mla, flash_mla.get_mla_metadata()[0], **{argument: value})
    site = only_site(s)
    assert (site.warnings, site.errors, site.compared) == (1, 0, 1)
    assert f"{argument}" in s.tally.reports[0] and "does not read it" in s.tally.reports[0]


def _decode_fp8(module: types.ModuleType, spec: ProblemSpec = FP8_SPEC):
    p = build_problem(spec)
    meta, _ = module.get_mla_metadata()
    meta.tile_scheduler_metadata, meta.num_splits = module.get_mla_decoding_metadata(
        p.seq_lens, spec.q_len * spec.num_heads, 1, is_fp8_kvcache=True, use_legacy=True)
    softmax = spec.softmax_scale
    return module.flash_mla_with_kvcache(
        p.query, p.kv_cache.unsqueeze(2), p.block_table, p.seq_lens, 512, meta, softmax_scale=softmax, causal=True,
        is_fp8_kvcache=True, use_legacy=True, descale_q=torch.tensor([spec.q_scale]),
        descale_k=torch.tensor([spec.k_scale]))


def test_the_wheels_dense_fp8_call_is_judged(flash_mla) -> None:
    with session() as s:
        _decode_fp8(flash_mla)
    site = only_site(s)
    assert (site.compared, site.mismatched, site.errors) == (1, 0, 0)


def test_a_dense_fp8_kernel_that_drops_descale_k_is_caught(flash_mla) -> None:
    flash_mla.flash_mla_with_kvcache = WheelStandIn(MUTANTS["bmm2_ignored"].fn).flash_mla_with_kvcache
    with pytest.raises(ShadowError, match="MISMATCH"), session():
        _decode_fp8(flash_mla)


def test_schedules_that_died_are_forgotten() -> None:
    """An engine takes a new schedule every step: what shadow mode remembers of them must not grow with it."""
    import gc

    from mla_verify.shadow.entries import FlashMLASchedules

    class Meta:  # a FlashMLASchedMeta: an object the first call fills
        tile_scheduler_metadata = None

    schedules = FlashMLASchedules()
    kept = [Meta() for _ in range(3)]
    for step in range(200):
        meta = kept[step % 3] if step < 3 else Meta()
        assert schedules.check(meta, (step,), f"step {step}") == []
    del meta
    gc.collect()
    assert len(schedules._seen) == 3  # the three still alive
