"""Shadow mode's entry points on CPU: FlashInfer's real symbols wrapped wherever they are bound (their Python
layer runs; only the implementation behind the public function is a CPU PyTorch stand-in), the wrapper's plan/run
pair, FlashMLA (a stand-in module, FlashMLA needs a GPU), and the return forms every entry point is held to."""
from __future__ import annotations

import inspect
import io
import math
import sys
import types
from pathlib import Path

import engine_backend
import pytest
import torch
from test_wrapper_contract import fake_hopper  # noqa: F401 - fixture: FlashInfer's wrapper on CPU

from mla_verify.core.dims import R1_SOFTMAX_SCALE
from mla_verify.kernels.flashmla_cpu import FlashMLAStandIn, SchedMeta
from mla_verify.kernels.mutants import correct_kernel, halves_swapped, lse_natural_log
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec, trtllm_args, wrapper_args
from mla_verify.shadow import ShadowError, shadow
from mla_verify.shadow.contract import ERROR
from mla_verify.shadow.entries import FLASHINFER_SPARSE_UNREAD, result_parts
from mla_verify.shadow.wrapper import _csr_findings, joined_cache

fi_decode = pytest.importorskip("flashinfer.decode")
fi_core = pytest.importorskip("flashinfer.mla._core")
fi_mla = pytest.importorskip("flashinfer.mla")

SPEC = ProblemSpec(seq_lens=(37, 100), num_heads=4, page_size=32, softmax_scale=R1_SOFTMAX_SCALE, seed=2)
FA_WORKSPACE = 32 << 20  # FA wants ~17 MiB of split partials at the faked H200's SM count


@pytest.fixture(autouse=True)
def reproducers_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # a mismatch keeps its reproducer under ./fixtures/shadow


def session(mode: str = "strict", **kwargs):
    return shadow(mode, stream=io.StringIO(), summary=False, **kwargs)


def only_site(s):
    assert len(s.tally.sites) == 1, s.tally.sites
    return next(iter(s.tally.sites.values()))


# --- FlashInfer's functional entry point

@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch):
    """Puts a Contract-1 CPU kernel behind FlashInfer's public function (its implementation function), honouring
    return_lse_base as FlashInfer does."""
    def use(kernel) -> None:
        def impl(*, query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                 block_tables, seq_lens, max_seq_len, out, bmm1_scale, bmm2_scale, return_lse, return_lse_base,
                 **_):
            result = kernel(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                            block_tables, seq_lens, max_seq_len, out=out, bmm1_scale=bmm1_scale,
                            bmm2_scale=bmm2_scale, return_lse=return_lse)
            if return_lse and return_lse_base == "basee":
                return result[0], result[1] * math.log(2.0)
            return result
        monkeypatch.setattr(fi_core, "_mla_with_kv_cache_impl", impl)
    return use


def flashinfer_call(layout: LayoutSpec = LayoutSpec(), spec: ProblemSpec = SPEC, **kwargs):
    problem = build_problem(spec)
    a = trtllm_args(problem, layout)
    out = torch.empty(problem.out_shape, dtype=torch.bfloat16) if layout.pass_out else None
    workspace = kwargs.pop("workspace", torch.zeros(1 << 20, dtype=torch.uint8))
    result = fi_decode.trtllm_batch_decode_with_kv_cache_mla(
        a.query, a.kv_cache, workspace, 128, 512, 64, a.block_tables, a.seq_lens, a.max_seq_len, out=out,
        bmm1_scale=problem.bmm1_scale, bmm2_scale=problem.bmm2_scale, **kwargs)
    return result, out


def test_every_binding_of_flashinfers_function_is_wrapped_then_restored() -> None:
    original = fi_core.trtllm_batch_decode_with_kv_cache_mla
    homes = (fi_core, fi_decode, fi_mla, engine_backend)  # the definition, two re-exports, an engine's import
    methods = {name: fi_mla.BatchMLAPagedAttentionWrapper.__dict__[name] for name in ("plan", "run")}
    assert all(home.trtllm_batch_decode_with_kv_cache_mla is original for home in homes)
    with session():
        wrapped = fi_decode.trtllm_batch_decode_with_kv_cache_mla
        assert wrapped is not original and wrapped.__wrapped__ is original
        assert all(home.trtllm_batch_decode_with_kv_cache_mla is wrapped for home in homes)
        assert inspect.signature(wrapped) == inspect.signature(original)  # engines that introspect see the same
        assert all(fi_mla.BatchMLAPagedAttentionWrapper.__dict__[n] is not m for n, m in methods.items())
    assert all(home.trtllm_batch_decode_with_kv_cache_mla is original for home in homes)
    assert all(fi_mla.BatchMLAPagedAttentionWrapper.__dict__[n] is m for n, m in methods.items())


@pytest.mark.parametrize("layout", [LayoutSpec(), LayoutSpec(cache_dims=4, page_stride_pad=2, pass_out=False)])
def test_a_correct_implementation_passes_and_its_result_comes_back_untouched(stand_in, layout: LayoutSpec) -> None:
    stand_in(correct_kernel)
    plain, _ = flashinfer_call(layout, backend="trtllm-gen")
    with session() as s:
        result, out = flashinfer_call(layout, backend="trtllm-gen")
    assert torch.equal(result, plain)
    if out is not None:
        assert result is out  # the very object the implementation returned
    site = only_site(s)
    assert (site.compared, site.mismatched, site.errors, site.warnings) == (1, 0, 0, 0)


def test_a_faulty_implementation_is_caught_diagnosed_and_kept(stand_in, tmp_path: Path) -> None:
    stand_in(halves_swapped)
    with pytest.raises(ShadowError) as caught, session(fixtures_dir=tmp_path):
        flashinfer_call(backend="trtllm-gen")
    message = str(caught.value)
    assert "MISMATCH" in message and "[cache_rope_first]" in message
    assert f"test_shadow_entries.py:{inspect.getsourcelines(flashinfer_call)[1] + 5}" in message  # the call line
    kept = list(tmp_path.glob("shadow-*.json"))
    assert len(kept) == 1 and f"re-run: mla-verify replay {kept[0]}" in message


def test_the_lse_is_judged_in_the_base_the_call_asked_for(stand_in) -> None:
    stand_in(lse_natural_log)  # natural log where FlashInfer's base 2 is asked for
    with pytest.raises(ShadowError, match=r"LSE \(base 2\) off") as caught, session():
        flashinfer_call(LayoutSpec(return_lse=True), backend="trtllm-gen", return_lse=True, return_lse_base="base2")
    assert "[lse_natural]" in str(caught.value)
    stand_in(correct_kernel)
    with session() as s:
        flashinfer_call(LayoutSpec(return_lse=True), backend="trtllm-gen", return_lse=True, return_lse_base="basee")
    assert only_site(s).compared == 1 and only_site(s).mismatched == 0


def test_an_lse_of_unfixed_base_is_a_warning_and_not_compared(stand_in) -> None:
    stand_in(lse_natural_log)
    with session() as s:
        flashinfer_call(LayoutSpec(return_lse=True), backend="auto", return_lse=True)
    site = only_site(s)
    assert (site.warnings, site.mismatched) == (1, 0)
    assert "return_lse_base: None under backend='auto'" in s.stream.getvalue()


def flashinfer_sparse_call(past_pool: bool = False):
    """trtllm_batch_decode_with_kv_cache_mla(sparse_mla_top_k=...): the table's entries inside the pool under
    either reading (token slots or page ids), -1 elsewhere; ``past_pool``: one entry past it under both."""
    problem = build_problem(SPEC)
    a = trtllm_args(problem, LayoutSpec())
    slots = problem.num_pages * SPEC.page_size
    table = torch.where((a.block_tables >= 0) & (a.block_tables < problem.num_pages), a.block_tables, -1)
    if past_pool:
        table[1, 0] = slots
    return fi_decode.trtllm_batch_decode_with_kv_cache_mla(
        a.query, a.kv_cache, torch.zeros(1 << 20, dtype=torch.uint8), 128, 512, 64, table, a.seq_lens,
        a.max_seq_len, bmm1_scale=problem.bmm1_scale, backend="trtllm-gen", sparse_mla_top_k=table.shape[1])


def test_flashinfer_sparse_calls_are_counted_with_why_and_bounds_checked(stand_in) -> None:
    stand_in(halves_swapped)  # wrong, but which tokens a sparse entry names is not settled (shadow/entries.py)
    with session() as s:
        flashinfer_sparse_call()
    site = only_site(s)
    assert site.compared == 0 and site.errors == 0
    assert site.not_checked[FLASHINFER_SPARSE_UNREAD] == 1
    slots = build_problem(SPEC).num_pages * SPEC.page_size
    with pytest.raises(ShadowError, match=rf"block_tables: 1 entries are neither -1 nor a slot of the pool "
                       rf"\(0..{slots - 1}\), first block_tables\[1, 0\]") as caught, session():
        flashinfer_sparse_call(past_pool=True)
    assert "the kernel was not called" in str(caught.value)


def test_a_workspace_not_zeroed_before_first_use_is_a_warning_once(stand_in) -> None:
    stand_in(correct_kernel)
    dirty = torch.ones(1 << 20, dtype=torch.uint8)
    with session() as s:
        flashinfer_call(backend="trtllm-gen", workspace=dirty)
        flashinfer_call(backend="trtllm-gen", workspace=dirty)  # in use by now: whatever it holds is the kernel's
    assert only_site(s).warnings == 1 and "zero-initialised" in s.stream.getvalue()


# --- the return forms

def test_out_must_be_written_in_place_and_returned() -> None:
    out = torch.zeros(2, 3)
    assert result_parts(out, out, False) == (out, None, [])
    fresh = torch.ones(2, 3)
    found = result_parts(fresh, out, False)[2]
    assert [f.field for f in found] == ["out"] and "sees stale values" in found[0].message
    assert result_parts(out.clone(), out, False)[2] == []  # a copy of what it wrote in place is fine
    out[0, 0] = float("nan")
    assert result_parts(out.clone(), out, False)[2] == []  # NaN included
    none = result_parts(None, out, False)
    assert none[0] is out and "returned NoneType" in none[2][0].message  # the buffer is what gets judged
    assert "the result is lost" in result_parts(None, None, False)[2][0].message
    assert "LSE was requested" in result_parts(out, out, True)[2][0].message
    assert "though no LSE was requested" in result_parts((out, out), out, False)[2][0].message


def short_output_kernel(query, kv_cache, workspace_buffer, qk_nope_head_dim, kv_lora_rank, qk_rope_head_dim,
                        block_tables, seq_lens, max_seq_len, out=None, bmm1_scale=1.0, bmm2_scale=1.0,
                        return_lse=False):
    """Contract 1's signature, three output values."""
    return torch.zeros(3, dtype=torch.bfloat16)


def test_a_result_of_the_wrong_size_is_an_error_not_a_shadow_failure() -> None:
    problem = build_problem(SPEC)
    with session("record", kernels=[short_output_kernel]) as s:
        short_output_kernel(problem.query, problem.kv_cache, None, 128, 512, 64, problem.block_table,
                            problem.seq_lens, 100, bmm1_scale=problem.bmm1_scale)
    site = only_site(s)
    assert site.errors == 1 and not any("shadow failed" in reason for reason in site.not_checked)
    assert "result: not in this entry point's form" in s.stream.getvalue()


# --- the wrapper

def wrapper_inputs(spec: ProblemSpec = SPEC):
    problem = build_problem(spec)
    return problem, wrapper_args(problem, LayoutSpec())


def plan(wrapper, problem, a, sm_scale: float | None = None) -> None:
    from flashinfer.mla import MLAPlanMetadata

    wrapper.plan(metadata=MLAPlanMetadata.csr(a.qo_indptr, a.kv_indptr, a.kv_indices, a.kv_len_arr),
                 num_heads=problem.num_heads, head_dim_ckv=512, head_dim_kpe=64, page_size=problem.page_size,
                 causal=True, sm_scale=problem.bmm1_scale if sm_scale is None else sm_scale,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, query_layout="split",
                 kv_cache_layout="split", output_dtype=torch.bfloat16)


def test_a_run_whose_plan_was_not_seen_is_counted_not_judged(fake_hopper) -> None:
    problem, a = wrapper_inputs()
    wrapper = fi_mla.BatchMLAPagedAttentionWrapper(torch.zeros(FA_WORKSPACE, dtype=torch.uint8), backend="fa3")
    plan(wrapper, problem, a)
    with session() as s:
        wrapper.run(query=(a.q_nope, a.q_pe), kv_cache=(a.ckv, a.kpe))
        plan(wrapper, problem, a)
        wrapper.run(query=(a.q_nope, a.q_pe), kv_cache=(a.ckv, a.kpe))
    first, second = [t for (entry, _), t in s.tally.sites.items() if entry.endswith(".run")]  # two call sites
    assert first.not_checked["its plan() was not seen under shadow mode"] == 1 and first.compared == 0
    assert second.compared == 1 and second.mismatched == 0


def test_a_wrapper_run_is_judged_against_its_plan(fake_hopper) -> None:
    problem, a = wrapper_inputs()
    wrapper = fi_mla.BatchMLAPagedAttentionWrapper(torch.zeros(FA_WORKSPACE, dtype=torch.uint8), backend="fa2")
    with pytest.raises(ShadowError, match="1/sqrt\\(576\\)"), session():
        plan(wrapper, problem, a, sm_scale=1 / math.sqrt(576))
        wrapper.run(query=(a.q_nope, a.q_pe), kv_cache=(a.ckv, a.kpe))


def test_split_views_of_one_pool_are_rejoined_without_a_copy() -> None:
    problem, a = wrapper_inputs()
    joined = joined_cache(a.ckv, a.kpe)
    assert joined.data_ptr() == a.pool.data_ptr() and joined.shape == problem.kv_cache.shape
    separate = joined_cache(a.ckv.clone(), a.kpe.clone())
    assert separate.data_ptr() != a.pool.data_ptr()
    assert torch.equal(separate.nan_to_num(7.0), joined.nan_to_num(7.0))
    swapped = joined_cache(a.kpe, a.ckv)  # not adjacent in that order: joined by copying, widths say the rest
    assert swapped.shape[-1] == 576 and swapped.data_ptr() != a.pool.data_ptr()


def test_csr_page_lists_shorter_than_the_lengths_are_blocking() -> None:
    kv_indptr = torch.tensor([0, 1, 3], dtype=torch.int32)
    found = _csr_findings(kv_indptr, torch.tensor([40, 64], dtype=torch.int32), 32)
    assert len(found) == 1 and found[0].severity == ERROR and found[0].blocking
    assert "request 0 lists 1 pages but kv_len_arr[0] = 40 needs 2" in found[0].message
    assert _csr_findings(kv_indptr, torch.tensor([32, 64], dtype=torch.int32), 32) == []


# --- FlashMLA (its calling convention on CPU, mla_verify.kernels.flashmla_cpu: the real one needs a GPU)

@pytest.fixture
def flash_mla(monkeypatch: pytest.MonkeyPatch):
    """A ``flash_mla`` module whose ``flash_mla_with_kvcache`` is the CPU stand-in (FlashMLA's checks included)."""
    module = types.ModuleType("flash_mla")
    module.flash_mla_with_kvcache = FlashMLAStandIn().flash_mla_with_kvcache
    monkeypatch.setitem(sys.modules, "flash_mla", module)
    return module


FLASHMLA_SPEC = ProblemSpec(seq_lens=(37, 100), q_len=2, num_heads=4, page_size=64, softmax_scale=R1_SOFTMAX_SCALE,
                            seed=4)  # FlashMLA takes 64-token pages only


def flashmla_call(module, spec: ProblemSpec = FLASHMLA_SPEC, **kwargs):
    problem = build_problem(spec)
    cache = problem.kv_cache.unsqueeze(2) if kwargs.pop("order", "flashmla") == "flashmla" else \
        problem.kv_cache.unsqueeze(1)
    return module.flash_mla_with_kvcache(problem.query, cache, problem.block_table, problem.seq_lens, 512,
                                         SchedMeta(), **kwargs)


def test_flashmla_calls_are_judged_lse_included(flash_mla) -> None:
    with session() as s:
        flashmla_call(flash_mla, softmax_scale=FLASHMLA_SPEC.bmm1_scale, causal=True)
    site = only_site(s)
    assert (site.compared, site.mismatched, site.errors, site.warnings) == (1, 0, 0, 0)


def test_flashmlas_default_scale_and_cache_order_are_caught(flash_mla) -> None:
    with pytest.raises(ShadowError, match="1/sqrt\\(576\\), the absorbed width"), session():
        flashmla_call(flash_mla, causal=True)  # no softmax_scale: FlashMLA's default is 1/sqrt(576)
    with pytest.raises(ShadowError, match="Contract 1's \\[pages, 1, page, D\\] order"), session():
        flashmla_call(flash_mla, order="contract1", softmax_scale=FLASHMLA_SPEC.bmm1_scale, causal=True)


def test_flashmla_non_causal_multi_token_decode_is_a_warning(flash_mla) -> None:
    with session() as s:
        flashmla_call(flash_mla, softmax_scale=FLASHMLA_SPEC.bmm1_scale)  # causal defaults to False in FlashMLA
    site = only_site(s)
    assert site.warnings == 1 and site.not_checked["non-causal attention over several query tokens"] == 1
