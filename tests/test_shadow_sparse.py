"""Shadow mode compares FlashMLA's sparse calls (``indices=``) with the sparse reference: the call read back as
the problem it came from, a correct kernel quiet, each sparse mutant reported at its call site and named, and
the indices bounds-checked before the kernel runs. FlashMLA needs a GPU: ``flash_mla`` here is a module holding
the CPU stand-in with the sgl wheel's sparse calling convention (mla_verify.kernels.flashmla_cpu)."""
from __future__ import annotations

import dataclasses
import inspect
import io
import sys
import types
from pathlib import Path

import pytest
import torch

from mla_verify.core.dims import R1_SOFTMAX_SCALE
from mla_verify.kernels.flashmla_cpu import SparseStandIn
from mla_verify.kernels.mutants import SPARSE_MUTANTS, SparseFaults
from mla_verify.problems.packed import FORMATS, kernel_view
from mla_verify.problems.sparse import SparseDecodeProblem, SparseSpec, build_sparse_problem
from mla_verify.problems.sparse_reference import sparse_reference
from mla_verify.shadow import ShadowError, shadow
from mla_verify.shadow.entries import cache_format
from mla_verify.shadow.problem import live_sparse_problem

# 64 heads (FlashMLA's smallest h_q), topk 128 over 3 of 8 pages: the call's pool is larger than what it reads
BASE = SparseSpec(batch=2, num_heads=64, topk=128, page_size=64, used_pages=3, extra_pages=5, invalid=0.1,
                  softmax_scale=R1_SOFTMAX_SCALE, seed=3)
# what the wheel takes per format (V3.2 has no dynamic topk_length), with what each can add
FORMAT_SPECS = {
    "V32": dataclasses.replace(BASE, sink="mixed", scales="amax"),
    "V32_NO_ROPE": dataclasses.replace(BASE, fmt="V32_NO_ROPE", topk_lengths=(100, 0), q_len=2),
    "V4": dataclasses.replace(BASE, fmt="V4", topk_lengths=(128, 30), sink="finite", duplicates=True),
}


@pytest.fixture(autouse=True)
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def flash_mla(monkeypatch: pytest.MonkeyPatch):
    """Installs a ``flash_mla`` module whose sparse decode is the stand-in with ``faults``."""
    def install(faults: SparseFaults | None = None, name: str = "correct") -> types.ModuleType:
        stand_in = SparseStandIn(faults or SparseFaults(), name)
        module = types.ModuleType("flash_mla")
        module.flash_mla_with_kvcache = stand_in.flash_mla_with_kvcache
        module.get_mla_metadata = stand_in.get_mla_metadata
        monkeypatch.setitem(sys.modules, "flash_mla", module)
        return module
    return install


def session(mode: str = "strict"):
    return shadow(mode, stream=io.StringIO(), summary=False)


def only_site(s):
    assert len(s.tally.sites) == 1, s.tally.sites
    return next(iter(s.tally.sites.values()))


def sparse_call(module: types.ModuleType, p: SparseDecodeProblem, **kwargs):
    k_cache = kernel_view(p.packed, FORMATS[p.fmt], p.page_size)
    return module.flash_mla_with_kvcache(p.query, k_cache, None, None, 512, module.get_mla_metadata()[0],
                                         is_fp8_kvcache=True, indices=p.indices, topk_length=p.topk_length,
                                         attn_sink=p.attn_sink, kv_format=p.fmt, **kwargs)


CALL_LINE = inspect.getsourcelines(sparse_call)[1] + 2


@pytest.mark.parametrize("spec", [*FORMAT_SPECS.values(), dataclasses.replace(BASE, fmt="bf16", sink="+inf")],
                         ids=[*FORMAT_SPECS, "bf16"])
def test_a_live_call_reads_back_as_the_problem_it_came_from(spec: SparseSpec) -> None:
    p = build_sparse_problem(spec)
    cache = p.kv_cache.unsqueeze(2) if p.packed is None else kernel_view(p.packed, FORMATS[p.fmt], p.page_size)
    live = live_sparse_problem(p.query, cache, p.fmt, p.indices, p.topk_length, p.attn_sink, p.softmax_scale)
    assert live.kv_cache.shape[0] < p.kv_cache.shape[0]  # only the pages read (and the pool's last) are copied
    want, got = sparse_reference(p), sparse_reference(live)
    assert torch.equal(got.out, want.out) and torch.equal(got.lse, want.lse)  # the same values in the same order


@pytest.mark.parametrize("fmt", sorted(FORMAT_SPECS))
def test_a_correct_sparse_kernel_is_compared_and_quiet(flash_mla, fmt: str) -> None:
    module = flash_mla()
    p = build_sparse_problem(FORMAT_SPECS[fmt])
    plain = sparse_call(module, p, softmax_scale=p.softmax_scale)
    with session() as s:
        result = sparse_call(module, p, softmax_scale=p.softmax_scale)
    assert all(torch.equal(a, b) for a, b in zip(result, plain))  # the engine gets what the kernel returned
    site = only_site(s)
    assert (site.compared, site.mismatched, site.errors, site.warnings) == (1, 0, 0, 0), s.stream.getvalue()


# the whole pool is not copied (only the pages read), so reading an index as a page id reads pages the shadow does
# not hold: that mutant is reported as a mismatch, but its diagnosis needs the whole pool (tests/test_sparse_*);
# a kernel seen wrong only through NaN (empty rows) is named only where a re-run of the kernel confirms it, which a
# live call has not (judge/explains.py): as a dense call's, its diagnosis names nothing rather than guess
NAMED = sorted(set(SPARSE_MUTANTS) - {"indices_as_page_ids", "empty_row_nan", "front_block_unguarded"})


@pytest.mark.parametrize("name", sorted(SPARSE_MUTANTS))
def test_a_sparse_mutant_is_reported_at_its_call_site_and_named(flash_mla, name: str) -> None:
    m = SPARSE_MUTANTS[name]
    module = flash_mla(m.faults, name)
    p = build_sparse_problem(m.trigger)
    with pytest.raises(ShadowError) as caught, session():
        sparse_call(module, p, softmax_scale=p.softmax_scale)
    message = str(caught.value)
    headline = message.splitlines()[0]
    assert headline.startswith("mla-verify shadow: MISMATCH at ") and headline.endswith(
        f"{Path(__file__).name}:{CALL_LINE} in flash_mla_with_kvcache(indices=...)"), message
    assert "  call: sparse " in message and "reproducer not kept: a live sparse call" in message
    if name in NAMED:
        assert f"[{m.diagnosis}] (" in message, message
    else:
        assert "diagnosis: none of the known misreadings explains the output" in message, message


def test_an_unmasked_minus1_reading_an_unlisted_last_page_is_reported_and_not_misnamed(flash_mla) -> None:
    # seed 1 leaves the pool's last page unlisted (NaN): the mutant reads NaN there. The shadow copies that page
    # too, so the reference sees what the kernel read; a match through NaN alone is not named without a re-run
    m = SPARSE_MUTANTS["minus1_unmasked"]
    p = build_sparse_problem(dataclasses.replace(m.trigger, extra_pages=4, seed=1))
    assert bool(p.kv_cache[-1, -1].isnan().all())
    module = flash_mla(m.faults, m.name)
    with pytest.raises(ShadowError, match="none of the known misreadings explains the output"), session():
        sparse_call(module, p, softmax_scale=p.softmax_scale)


def test_record_mode_counts_a_sparse_mismatch_and_raises_nothing(flash_mla) -> None:
    m = SPARSE_MUTANTS["sink_in_lse"]
    module = flash_mla(m.faults, m.name)
    p = build_sparse_problem(dataclasses.replace(m.trigger, softmax_scale=R1_SOFTMAX_SCALE))
    with session("record") as s:
        sparse_call(module, p, softmax_scale=p.softmax_scale)
    site = only_site(s)
    assert (site.compared, site.mismatched, site.errors) == (1, 1, 0)
    assert "[sink_in_lse] (" in s.stream.getvalue()


def test_flashmlas_default_softmax_scale_is_an_error_on_a_v32_call(flash_mla) -> None:
    module = flash_mla()
    p = build_sparse_problem(dataclasses.replace(FORMAT_SPECS["V32"], softmax_scale=576 ** -0.5))
    with pytest.raises(ShadowError, match=r"softmax_scale: 0.0416667 = 1/sqrt\(576\), the absorbed width"), \
            session():
        sparse_call(module, p)  # no softmax_scale: FlashMLA's default, 1/sqrt(576)


@pytest.mark.parametrize("bad", ["past the pool", "-2"])
def test_an_index_outside_the_pool_stops_the_call_before_the_kernel(flash_mla, bad: str) -> None:
    """FlashMLA's SM90 sparse decode masks -1 only: one past the pool, or any other negative index, is an
    out-of-bounds read."""
    module = flash_mla()
    p = build_sparse_problem(FORMAT_SPECS["V32"])
    p.indices[1, 0, 5] = p.slots if bad == "past the pool" else -2
    with pytest.raises(ShadowError, match=r"neither -1 nor a slot of the pool .* first indices\[1, 0, 5\]") as caught, \
            session():
        sparse_call(module, p, softmax_scale=p.softmax_scale)
    assert "the kernel was not called" in str(caught.value)


def test_528_byte_rows_without_kv_format_are_not_read_and_say_why() -> None:
    fmt, why = cache_format(torch.zeros((2, 64, 1, 528), dtype=torch.uint8), None)
    assert fmt is None and "kv_format='V32_NO_ROPE'" in why
    assert cache_format(torch.zeros((2, 64, 1, 528), dtype=torch.uint8), "V32_NO_ROPE") == ("V32_NO_ROPE", "")
