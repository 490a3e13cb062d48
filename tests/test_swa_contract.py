"""The flashinfer-swa adapter on CPU: FlashInfer 0.7.4's real ``batch_decode_with_kv_cache_mla_swa`` -- its
``_validate``, output allocation and tactic choice -- runs on the exact arguments the backend builds, with only
the CUDA facts faked (``is_cuda`` while ``_validate`` runs, the SM90 device probe) and the JIT-built module
replaced by a CPU computation of what the native kernel receives (SDPA with the window as an explicit band,
tests/oracles.py). So the harness judges the whole adapter -- layout, scale, window, bmm2 bridge, ``out`` -- and
the envelope is checked against FlashInfer's own shape rule.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any
from unittest import mock

import pytest
import torch
from oracles import sdpa_decode

from mla_verify.backends import flashinfer_swa, get_backend
from mla_verify.backends.flashinfer_swa import SWA_ENVELOPE, SWA_WINDOW, FlashInferSwaBackend
from mla_verify.core.dims import MLADims
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec, padded_width
from mla_verify.problems.problem import DecodeProblem
from mla_verify.run.harness import run_case

fi_mla = pytest.importorskip("flashinfer.mla")
swa = pytest.importorskip("flashinfer.mla._swa")


class FakeSwaModule:
    """The JIT-built SM90 module: ``run`` records its arguments and computes what they ask for, with the window
    it is given plus ``window_shift`` (0: faithful) and ``scale_factor`` times the scale (1: faithful)."""

    def __init__(self, window_shift: int | None = 0, scale_factor: float = 1.0) -> None:
        self.args: tuple = ()
        self.window_shift = window_shift
        self.scale_factor = scale_factor

    def run(self, *a: Any) -> None:
        self.args = a
        query, kv_cache, _workspace, block_tables, seq_lens, out, sm_scale, window_left, _tactic = a
        window = None if self.window_shift is None else window_left + self.window_shift
        dims = MLADims(out.shape[-1], query.shape[-1] - out.shape[-1], num_heads=query.shape[2])
        problem = DecodeProblem(query, kv_cache, block_tables, seq_lens, dims, sm_scale * self.scale_factor,
                                window_left=window)
        out.copy_(sdpa_decode(problem).to(out.dtype))


def _install(monkeypatch: pytest.MonkeyPatch, module: FakeSwaModule) -> FakeSwaModule:
    real_validate = swa._validate

    def validate_as_on_cuda(*args: Any) -> None:  # every other check of FlashInfer's stays as it is
        with mock.patch.object(torch.Tensor, "is_cuda", property(lambda t: True)):
            real_validate(*args)
    monkeypatch.setattr(swa, "_validate", validate_as_on_cuda)
    monkeypatch.setattr(swa, "_device_supported", lambda device: True)
    monkeypatch.setattr(swa, "_get_module", lambda: module)
    return module


@pytest.fixture
def fake_sm90(monkeypatch: pytest.MonkeyPatch) -> FakeSwaModule:
    return _install(monkeypatch, FakeSwaModule())


class OnCpu(FlashInferSwaBackend):
    """The same backend allowed onto the CPU: only the device check is lifted, FlashInfer's checks stay."""

    def unavailable_reason(self, device: torch.device) -> str | None:
        return None


CPU = torch.device("cpu")
# 600 tokens: the 512-token window cuts it; 37 and 64: shorter than the window, at a page edge
SPEC = ProblemSpec(seq_lens=(600, 37), q_len=4, num_heads=64, page_size=64, kv_lora_rank=1024,
                   qk_rope_head_dim=64, softmax_scale=0.1352, bmm2_extra=1.5, extra_pages=2, table_pad=1,
                   window_left=SWA_WINDOW, seed=3)
CASES = [
    (SPEC, LayoutSpec(return_lse=False), "pages"),
    (replace(SPEC, seq_lens=(700,), q_len=1, pad_fill="garbage"), LayoutSpec(table_width="pad128",
                                                                             pass_out=False, return_lse=False),
     "table"),
    (replace(SPEC, seq_lens=(513, 514, 64, 1), q_len=1, bmm2_extra=1.0, seed=5), LayoutSpec(return_lse=False),
     "batch"),
]


@pytest.mark.parametrize("spec,layout,transform", CASES, ids=[str(i) for i in range(len(CASES))])
def test_the_harness_passes_swa_through_flashinfers_function(fake_sm90: FakeSwaModule, spec: ProblemSpec,
                                                             layout: LayoutSpec, transform: str) -> None:
    assert OnCpu().why_not(spec, layout, CPU) is None
    result = run_case(OnCpu(), spec, layout, "cpu", transform=transform)
    assert result.verdict == "pass", result.failures


@pytest.mark.parametrize("layout", [LayoutSpec(return_lse=False),
                                    LayoutSpec(table_width="pad128", pass_out=False, return_lse=False)])
def test_the_native_kernel_receives_our_buffers_and_scale(fake_sm90: FakeSwaModule, layout: LayoutSpec) -> None:
    problem = build_problem(SPEC)
    prepared = OnCpu().prepare(problem, layout)
    raw = prepared.invoke()
    query, kv, workspace, tables, lens, out, sm_scale, window, _ = fake_sm90.args
    assert query is problem.query and kv is problem.kv_cache  # no copies: the pool itself is the cache
    assert kv.shape == (problem.num_pages, 64, 1088) and kv.is_contiguous()
    native = problem.block_table.shape[1]
    assert tables.dtype == torch.int32 and torch.equal(tables[:, :native], problem.block_table)
    assert tables.shape[1] == (padded_width(native, 64) if layout.table_width == "pad128" else native)
    assert lens is problem.seq_lens
    assert workspace.dtype == torch.uint8 and workspace.numel() == fi_mla.get_mla_swa_workspace_size_bytes(2, 4, 64)
    assert sm_scale == problem.bmm1_scale and window == SWA_WINDOW
    assert raw is out and (out is prepared.out if layout.pass_out else prepared.out is None)
    # no output scale in the kernel: bmm2 reaches the harness, which applies it in float64
    assert prepared.output_scale == problem.bmm2_scale != 1.0
    judged = prepared.judged(raw)[0]
    assert judged.dtype == torch.float64 and torch.equal(judged, raw.double() * problem.bmm2_scale)


def _call(**changes: Any) -> torch.Tensor:
    """FlashInfer's function on a valid call for SPEC, with some arguments changed."""
    p = build_problem(SPEC)
    args = dict(query=p.query, kv_cache=p.kv_cache,
                workspace_buffer=torch.empty(fi_mla.get_mla_swa_workspace_size_bytes(2, 4, 64), dtype=torch.uint8),
                block_tables=p.block_table, seq_lens=p.seq_lens, window_left=SWA_WINDOW, sm_scale=0.1)
    args.update(changes)
    return fi_mla.batch_decode_with_kv_cache_mla_swa(**args)


def test_flashinfers_validation_is_live(fake_sm90: FakeSwaModule) -> None:
    """It runs, and it refuses what the envelope leaves out -- so its accepting our arguments means something."""
    assert _call().shape == (2, 4, 64, 1024)
    p = build_problem(SPEC)
    strided = torch.cat([p.kv_cache, p.kv_cache[:, :2]], dim=1)[:, :64]  # a page-strided view
    refusals = {
        "window_left=512": dict(window_left=256),
        "positive finite sm_scale": dict(sm_scale=-0.1),
        "contiguous [num_pages, 64, 1088]": dict(kv_cache=strided),
        "BF16": dict(kv_cache=p.kv_cache.to(torch.float8_e4m3fn)),
        "[B, q_len_per_req, 64, 1088]": dict(query=p.query[:, :, :32]),
        "out must be contiguous": dict(out=torch.empty(2, 4, 64, 1024, dtype=torch.bfloat16)[:, :, :, :512]),
    }
    for words, change in refusals.items():
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            _call(**change)


@pytest.mark.parametrize("heads", [32, 64, 128])
def test_envelope_batches_q_lens_and_heads_equal_flashinfers_rule(heads: int) -> None:
    env = SWA_ENVELOPE
    for batch in range(1, 21):
        for q_len in range(1, 9):
            spec = replace(SPEC, seq_lens=(600,) * batch, q_len=q_len, num_heads=heads)
            try:
                fi_mla.get_mla_swa_workspace_size_bytes(batch, q_len, heads)
                theirs = True
            except ValueError:
                theirs = False
            assert (env.why_not(spec, LayoutSpec(return_lse=False)) is None) == theirs, (batch, q_len, heads)


def test_the_envelope_refuses_what_validate_refuses() -> None:
    layout = LayoutSpec(return_lse=False)
    assert SWA_ENVELOPE.why_not(SPEC, layout) is None
    for change, words in ((dict(window_left=None), "window_left None"), (dict(window_left=256), "window_left 256"),
                          (dict(page_size=32), "page size 32"), (dict(kv_lora_rank=512), "dims (512, 64)"),
                          (dict(dtype="fp8"), "dtype fp8")):
        assert words in SWA_ENVELOPE.why_not(replace(SPEC, **change), layout)
    assert "a page-strided cache" in SWA_ENVELOPE.why_not(SPEC, LayoutSpec(page_stride_pad=1, return_lse=False))
    assert "returning LSE" in SWA_ENVELOPE.why_not(SPEC, LayoutSpec())
    assert "4-D cache" in SWA_ENVELOPE.why_not(SPEC, LayoutSpec(cache_dims=4, return_lse=False))


def test_a_negative_scale_is_refused_before_any_call() -> None:
    reason = OnCpu().why_not(replace(SPEC, softmax_scale=-0.1), LayoutSpec(return_lse=False), CPU)
    assert reason.startswith("FlashInfer's MLA+SWA refuses it: sm_scale must be positive")


@pytest.mark.parametrize("module,complaint", [
    (FakeSwaModule(window_shift=None), "max |out - ref|"),  # no window at all: full causal attention
    (FakeSwaModule(window_shift=-1), "max |out - ref|"),  # one token short of FlashInfer's 513
    (FakeSwaModule(window_shift=1), "max |out - ref|"),  # one token too many
    (FakeSwaModule(scale_factor=0.5), "max |out - ref|"),
], ids=["no-window", "window-511", "window-513", "half-scale"])
def test_a_kernel_with_the_wrong_window_or_scale_fails(monkeypatch: pytest.MonkeyPatch, module: FakeSwaModule,
                                                       complaint: str) -> None:
    _install(monkeypatch, module)
    spec = replace(SPEC, seq_lens=(600,), q_len=1)
    result = run_case(OnCpu(), spec, LayoutSpec(return_lse=False), "cpu", diagnose=False)
    assert result.verdict == "fail" and any(complaint in f for f in result.failures), result.failures


# --- why it cannot run, before anything is touched -------------------------------------------------------------

def test_on_cpu_it_says_cuda() -> None:
    result = run_case(get_backend("flashinfer-swa"), SPEC, LayoutSpec(return_lse=False), "cpu")
    assert (result.verdict, result.reason) == ("skip", "flashinfer-swa: runs on cuda devices, not cpu")


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], name: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


def test_off_sm90_it_says_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, (10, 0), "NVIDIA B200")
    reason = get_backend("flashinfer-swa").unavailable_reason(torch.device("cuda"))
    assert reason == "needs SM90; this GPU (NVIDIA B200) is SM100"


def test_a_flashinfer_without_the_function_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_gpu(monkeypatch, (9, 0), "NVIDIA H200")
    monkeypatch.delattr(fi_mla, flashinfer_swa.SWA_FUNCTION, raising=False)

    def missing(name: str) -> Any:
        raise AttributeError(name)
    monkeypatch.setattr(fi_mla, "__getattr__", missing)
    reason = get_backend("flashinfer-swa").unavailable_reason(torch.device("cuda"))
    assert reason.startswith("flashinfer ") and reason.endswith(
        " has no flashinfer.mla.batch_decode_with_kv_cache_mla_swa (0.7.4 has it)")
