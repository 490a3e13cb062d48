"""The fa2/fa3 wrapper adapter on CPU: FlashInfer's real BatchMLAPagedAttentionWrapper plans and runs our
arguments with only the device queries (an SM90 GPU) and the JIT-built FA module faked. The fake module
computes with the CPU peer from exactly what the native kernel would receive, so the harness judges the whole
adapter -- CSR metadata, split views, fp8 cache with a bf16 query, bmm2 applied after the kernel, base-2 LSE,
``out`` in place -- and FlashInfer's own planner checks (used by ``why_not``) run for real.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch

from mla_verify.backends import get_backend
from mla_verify.backends.cpu_peer import cpu_peer_decode
from mla_verify.backends.flashinfer_wrapper import FlashInferWrapperBackend
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec, csr_to_block_table
from mla_verify.problems.problem import FP8
from mla_verify.records.fixtures import DEFAULT_MAX_REPRODUCER_MIB, load_fixture, write_reproducer
from mla_verify.run.harness import run_case

fa_common = pytest.importorskip("flashinfer.mla._batch_mla._backends._fa_common")
fa2_module = pytest.importorskip("flashinfer.mla._batch_mla._backends.fa2_backend")
fa3_module = pytest.importorskip("flashinfer.mla._batch_mla._backends.fa3_backend")
wrapper_module = pytest.importorskip("flashinfer.mla._batch_mla._wrapper")

H200_SMEM = (233472, 232448)  # shared memory per SM / per block (opt-in) of an H100/H200


class FakeFaModule:
    """The generated FA MLA module: plan() records the host metadata, run() computes with the CPU peer."""

    def __init__(self) -> None:
        self.plan_args: tuple = ()
        self.run_args: tuple = ()

    def plan_with_staged_workspace_bytes(self, *args: Any) -> tuple[list[int], int]:
        self.plan_args = args
        return [0], 0

    def run(self, *a: Any) -> None:
        """Request by request (qo_indptr may be ragged): its own rows as a one-request CPU-peer call."""
        self.run_args = a
        q_nope, q_pe, ckv, kpe, kv_indices, out, lse = a[3], a[4], a[5], a[6], a[7], a[8], a[9]
        mask_mode, heads, page, sm_scale, base_e, ckv_scale, kpe_scale = a[10:17]
        qo_indptr, kv_indptr, kv_len = self.plan_args[3], self.plan_args[4], self.plan_args[5]
        query = torch.cat([q_nope, q_pe], dim=-1)
        cache = torch.cat([ckv.float() * ckv_scale, kpe.float() * kpe_scale], dim=-1)
        table = csr_to_block_table(kv_indptr, kv_indices)
        for b in range(kv_len.numel()):
            rows = slice(int(qo_indptr[b]), int(qo_indptr[b + 1]))
            o, s = cpu_peer_decode(self.request_query(query[rows], heads), cache, None, 0, ckv.shape[-1],
                                   kpe.shape[-1], table[b:b + 1], kv_len[b:b + 1], int(kv_len[b]),
                                   bmm1_scale=sm_scale, return_lse=True)
            q = rows.stop - rows.start
            out[rows] = o.view(-1, heads, out.shape[-1])[:q]
            if lse is not None:
                lse[rows] = (s * (math.log(2.0) if base_e else 1.0))[:q]

    def request_query(self, rows: torch.Tensor, heads: int) -> torch.Tensor:
        """One request's query rows [q, H, D] as a [1, q, H, D] query."""
        return rows.reshape(1, rows.shape[0], heads, -1)


class IgnoresQLens(FakeFaModule):
    """A mutant: every request's tokens get the causal offset of the batch's longest query (its rows padded at
    the end to that length), as a kernel that read one q_len for the whole batch would."""

    def plan_with_staged_workspace_bytes(self, *args: Any) -> tuple[list[int], int]:
        self.max_q = int((args[3][1:] - args[3][:-1]).max())
        return super().plan_with_staged_workspace_bytes(*args)

    def request_query(self, rows: torch.Tensor, heads: int) -> torch.Tensor:
        padded = torch.nn.functional.pad(rows, (0, 0, 0, 0, 0, self.max_q - rows.shape[0]))
        return super().request_query(padded, heads)


@pytest.fixture
def fake_hopper(monkeypatch: pytest.MonkeyPatch) -> FakeFaModule:
    return _install(monkeypatch, FakeFaModule())


def _install(monkeypatch: pytest.MonkeyPatch, module: FakeFaModule) -> FakeFaModule:
    """``module`` as the FA module of a faked H200."""
    for target in (fa_common, wrapper_module):
        monkeypatch.setattr(target, "get_compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(fa_common, "get_device_sm_count", lambda device: 132)
    monkeypatch.setattr(fa_common, "_get_fa_shared_memory_limits", lambda device: H200_SMEM)
    monkeypatch.setattr(fa_common, "is_sm90a_supported", lambda device: True)
    for target in (fa2_module, fa3_module):
        monkeypatch.setattr(target, "get_batch_mla_module", lambda *args: module)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))  # no pinned memory here
    return module


class OnCpu(FlashInferWrapperBackend):
    """The same backend, allowed onto the CPU: only the device-type check is lifted, FlashInfer's checks stay."""

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None


def _on_cpu(name: str) -> OnCpu:
    """The real backend's path on CPU, with its drawn envelope."""
    real = get_backend(name)
    return OnCpu(real.name, real.path)


SPEC = ProblemSpec(seq_lens=(3, 70, 129), q_len=3, num_heads=16, page_size=16, extra_pages=2, table_pad=2,
                   softmax_scale=0.1352, bmm2_extra=1.5, seed=4)
CASES = [
    (SPEC, LayoutSpec()),
    (replace(SPEC, page_size=1, q_len=1, num_heads=128), LayoutSpec(page_stride_pad=3, pass_out=False)),
    (replace(SPEC, dtype="fp8", q_scale=0.5, k_scale=2.0, page_size=64), LayoutSpec(return_lse=False)),
    (replace(SPEC, kv_lora_rank=256, bmm2_extra=1.0, q_len=1), LayoutSpec(page_stride_pad=1)),
    (replace(SPEC, qk_rope_head_dim=0), LayoutSpec(page_stride_pad=2)),  # no rope: q_pe and kpe of width 0
    (replace(SPEC, qk_rope_head_dim=0, dtype="fp8", q_scale=0.5, k_scale=2.0), LayoutSpec(pass_out=False)),
]


@pytest.mark.parametrize("name", ["fa2", "fa3"])
@pytest.mark.parametrize("spec,layout", CASES, ids=[str(i) for i in range(len(CASES))])
def test_the_harness_passes_fa_through_flashinfers_wrapper(fake_hopper: FakeFaModule, name: str,
                                                           spec: ProblemSpec, layout: LayoutSpec) -> None:
    result = run_case(_on_cpu(name), spec, layout, "cpu", transform="pages")
    assert result.verdict == "pass", result.failures


@pytest.mark.parametrize("spec,layout", CASES, ids=[str(i) for i in range(len(CASES))])
def test_the_native_kernel_receives_our_buffers_and_scales(fake_hopper: FakeFaModule, spec: ProblemSpec,
                                                           layout: LayoutSpec) -> None:
    problem = build_problem(spec)
    prepared = _on_cpu("fa3").prepare(problem, layout)
    prepared.invoke()
    a = fake_hopper.run_args
    q_nope, q_pe, ckv, kpe, out, lse = a[3], a[4], a[5], a[6], a[8], a[9]
    mask_mode, heads, page, sm_scale, base_e, ckv_scale, kpe_scale = a[10:17]
    assert (mask_mode, heads, page) == (1, spec.num_heads, spec.page_size)  # 1: causal (bottom-right)
    assert sm_scale == spec.bmm1_scale and base_e is False  # bmm1 passed through unchanged
    assert q_nope.dtype == q_pe.dtype == torch.bfloat16 and ckv.dtype == problem.kv_cache.dtype
    pool = prepared.inputs["kv_pool"]
    assert ckv.data_ptr() == pool.data_ptr()
    if spec.qk_rope_head_dim:
        assert kpe.data_ptr() == pool.data_ptr() + spec.kv_lora_rank * pool.element_size()
    else:  # no rope: an empty kpe (and q_pe) of width 0
        assert kpe.numel() == 0 and kpe.shape[-1] == 0 and q_pe.shape[-1] == 0
    if spec.dtype == "fp8":
        assert ckv.dtype == FP8 and (ckv_scale, kpe_scale) == (1.0, 1.0)  # dequant is folded into bmm1/bmm2
        assert torch.equal(q_nope.to(FP8).to(torch.bfloat16), q_nope)  # the bf16 query is exactly the fp8 one
    else:
        assert q_nope.data_ptr() == problem.query.data_ptr()  # split views, no copy
    if layout.pass_out:
        assert out is prepared.out and out.dtype == torch.bfloat16
    assert (lse is not None) == layout.return_lse


def test_bmm2_is_applied_to_the_judged_output_not_the_kernels(fake_hopper: FakeFaModule) -> None:
    problem = build_problem(replace(SPEC, bmm2_extra=3.0))
    prepared = _on_cpu("fa2").prepare(problem, LayoutSpec())
    raw = prepared.invoke()
    kernel_out = fake_hopper.run_args[8]
    assert raw[0] is prepared.out is kernel_out
    unscaled = cpu_peer_decode(problem.query, problem.kv_cache, None, 0, 512, 64, problem.block_table,
                               problem.seq_lens, 129, bmm1_scale=problem.bmm1_scale)
    assert torch.equal(prepared.out.view_as(unscaled), unscaled)  # the kernel's own bf16 output, untouched
    judged = prepared.judged(raw)[0]
    assert judged.dtype == torch.float64 and torch.equal(judged, unscaled.double() * 3.0)  # no second rounding


def test_flashinfers_planner_refusals_become_why_not_reasons(fake_hopper: FakeFaModule) -> None:
    cpu = torch.device("cpu")
    # FlashInfer refuses causal tiles where its kernel would drop a visible key: 48 heads, 4 tokens, key 64
    tile = replace(SPEC, seq_lens=(66,), q_len=4, num_heads=48)
    reason = _on_cpu("fa3").why_not(tile, LayoutSpec(), cpu)
    assert reason.startswith("FlashInfer's fa3 planner refuses it:") and "causal tile boundary" in reason
    assert _on_cpu("fa3").why_not(replace(tile, seq_lens=(67,)), LayoutSpec(), cpu) is None
    assert _on_cpu("fa2").why_not(SPEC, LayoutSpec(), cpu) is None


def test_fp8_cache_is_refused_off_hopper(fake_hopper: FakeFaModule, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fa_common, "get_compute_capability", lambda device: (10, 0))
    reason = _on_cpu("fa2").why_not(replace(SPEC, dtype="fp8"), LayoutSpec(), torch.device("cpu"))
    assert "SM90" in reason and "FP8" in reason


def test_cutlass_refuses_any_softmax_scale_but_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    cutlass_module = pytest.importorskip("flashinfer.mla._batch_mla._backends.cutlass_backend")
    monkeypatch.setattr(cutlass_module, "get_compute_capability", lambda device: (10, 0))
    backend, cpu = _on_cpu("cutlass"), torch.device("cpu")
    plain = replace(SPEC, num_heads=128, q_len=1, softmax_scale=None, bmm2_extra=1.0)
    layout = LayoutSpec(return_lse=False)  # cutlass returns no LSE
    assert backend.why_not(plain, layout, cpu) is None
    assert "fixed MLA softmax scale" in backend.why_not(replace(plain, softmax_scale=0.1352), layout, cpu)


auto_policy = pytest.importorskip("flashinfer.mla._batch_mla._auto_policy")
# FlashInfer's fa3 planner takes head_dim_ckv 128/256/512 only, its fa2 planner any multiple of 128: rank 384
# is a shape auto must hand to fa2 (not drawn, as fa2 alone would run it: here only to see the fallback)
FA2_ONLY_RANK = 384


@pytest.fixture
def auto_on_hopper(fake_hopper: FakeFaModule, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The fake SM90 of ``fake_hopper`` seen by FlashInfer's auto policy too; returns the FA modules built, by
    name, in order: the kernel FlashInfer actually ran, told apart from what the adapter reports."""
    built: list[str] = []
    monkeypatch.setattr(auto_policy, "_get_compute_capability", lambda device: (9, 0))
    monkeypatch.setattr(auto_policy, "is_sm90a_supported", lambda device: True)
    for name, target in (("fa2", fa2_module), ("fa3", fa3_module)):
        monkeypatch.setattr(target, "get_batch_mla_module", lambda *a, name=name: built.append(name) or fake_hopper)
    return built


AUTO_CASES = [*CASES, (replace(SPEC, kv_lora_rank=FA2_ONLY_RANK), LayoutSpec())]


def test_auto_reports_the_kernel_flashinfer_planned_and_passes(auto_on_hopper: list[str]) -> None:
    real = get_backend("fa-auto")
    backend = OnCpu(real.name, replace(real.path, envelope=real.envelope.narrowed(
        dims=(*real.envelope.dims, (FA2_ONLY_RANK, 64)))))
    resolved = []
    for spec, layout in AUTO_CASES:
        auto_on_hopper.clear()
        result = run_case(backend, spec, layout, "cpu", transform="pages")
        assert result.verdict == "pass", result.failures
        assert set(auto_on_hopper) == {result.resolved_backend}  # every plan of the case ran what it reports
        assert result.to_json()["resolved_backend"] == result.resolved_backend
        resolved.append(result.resolved_backend)
    assert set(resolved) == {"fa3", "fa2"}  # both of auto's SM90 choices were reported, each as itself


def test_auto_refuses_where_both_fa_planners_refuse(auto_on_hopper: list[str]) -> None:
    cpu = torch.device("cpu")
    tile = replace(SPEC, seq_lens=(66,), q_len=4, num_heads=48)  # a causal tile edge for fa3 and fa2 alike
    reason = _on_cpu("fa-auto").why_not(tile, LayoutSpec(), cpu)
    assert reason.startswith("FlashInfer's auto planner refuses it: fa3: ") and "; fa2: " in reason
    assert _on_cpu("fa-auto").why_not(replace(tile, seq_lens=(67,)), LayoutSpec(), cpu) is None


def test_other_backends_report_no_resolution(fake_hopper: FakeFaModule) -> None:
    assert run_case(_on_cpu("fa3"), SPEC, LayoutSpec(), "cpu").resolved_backend is None


# ragged q_len: per-request query lengths, a 1 and the maximum among them
RAGGED = [
    (replace(SPEC, q_lens=(1, 3, 2)), LayoutSpec()),
    (replace(SPEC, seq_lens=(5, 64, 17, 129), q_len=5, q_lens=(5, 1, 4, 2), page_size=1, num_heads=8),
     LayoutSpec(page_stride_pad=3, pass_out=False)),
    (replace(SPEC, q_lens=(3, 1, 1), dtype="fp8", q_scale=0.5, k_scale=2.0, page_size=64),
     LayoutSpec(return_lse=False)),
    (replace(SPEC, q_lens=(2, 3, 1), qk_rope_head_dim=0), LayoutSpec(page_stride_pad=2)),
]


@pytest.mark.parametrize("name", ["fa2", "fa3"])
@pytest.mark.parametrize("transform", ["none", "batch"])
@pytest.mark.parametrize("spec,layout", RAGGED, ids=[str(i) for i in range(len(RAGGED))])
def test_ragged_requests_pass_through_flashinfers_wrapper(fake_hopper: FakeFaModule, name: str, transform: str,
                                                          spec: ProblemSpec, layout: LayoutSpec) -> None:
    result = run_case(_on_cpu(name), spec, layout, "cpu", transform=transform)
    assert result.verdict == "pass", result.failures


def test_a_ragged_problem_is_planned_by_request_and_its_padding_rows_left_nan(fake_hopper: FakeFaModule) -> None:
    spec, layout = RAGGED[0]
    problem = build_problem(spec)
    prepared = _on_cpu("fa3").prepare(problem, layout)
    raw = prepared.invoke()
    qo_indptr, q_nope, out = fake_hopper.plan_args[3], fake_hopper.run_args[3], fake_hopper.run_args[8]
    assert qo_indptr.tolist() == [0, 1, 4, 6]  # request b's rows: its own q_lens[b] tokens, packed
    assert torch.equal(q_nope, torch.cat([problem.query[b, :n, :, :512] for b, n in enumerate(spec.q_lens)]))
    assert out is prepared.out and out.shape == (6, spec.num_heads, 512) and raw[0] is out
    canonical, lse = prepared.to_canonical(raw)
    assert canonical.shape == problem.out_shape and lse.shape == problem.out_shape[:3]
    padding = ~problem.valid_rows()
    assert bool(canonical[padding].isnan().all()) and bool(lse[padding].isnan().all())
    assert not bool(canonical[~padding].isnan().any())


@pytest.mark.parametrize("name", ["fa2", "fa3"])
def test_a_kernel_that_gives_every_request_the_longest_query_is_caught(monkeypatch: pytest.MonkeyPatch,
                                                                       name: str) -> None:
    _install(monkeypatch, IgnoresQLens())
    spec, layout = RAGGED[0]
    assert run_case(_on_cpu(name), replace(spec, q_lens=None), layout, "cpu").verdict == "pass"  # same when uniform
    result = run_case(_on_cpu(name), spec, layout, "cpu")
    assert result.verdict == "fail" and "relative L2 error" in " ".join(result.failures), result.failures
    assert not any(line.startswith("diagnosis failed") for line in result.diagnosis), result.diagnosis
    assert not any("NaN" in line for line in result.diagnosis), result.diagnosis  # padding rows are not judged


def test_a_ragged_reproducer_replays_to_the_same_verdict(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    _install(monkeypatch, IgnoresQLens())
    spec, layout = RAGGED[0]
    failed = run_case(_on_cpu("fa2"), spec, layout, "cpu")
    for store in (False, True):  # spec-only (rebuilt from the spec) and with the problem's tensors
        written = write_reproducer(tmp_path / str(store), failed.id, failed.problem, None if store else spec,
                                   {"spec": spec.to_json(), "layout": layout.to_json()}, failed.out, failed.lse,
                                   DEFAULT_MAX_REPRODUCER_MIB << 20)
        fx = load_fixture(written.path)
        assert fx.spec == spec and (fx.problem is not None) == store
        problem, exact = fx.problem_on("cpu")
        assert exact and problem.q_lens == spec.q_lens
        again = run_case(_on_cpu("fa2"), fx.spec, fx.layout, "cpu", problem=problem)
        assert again.verdict == "fail" and again.failures == failed.failures



def test_premerge_catches_that_kernel_and_keeps_the_failure_ragged(monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_verify.run.engine import verify

    _install(monkeypatch, IgnoresQLens())
    failure = verify(_on_cpu("fa3"), "cpu", profile="premerge", max_examples=40).failure
    assert failure is not None and failure.spec.q_lens is not None and min(failure.spec.q_lens) < failure.spec.q_len
    assert any("query token 0" in line for line in failure.diagnosis), failure.diagnosis
