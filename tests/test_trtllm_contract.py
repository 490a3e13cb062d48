"""trtllm-gen's adapter, checked on CPU: the exact arguments it hands FlashInfer, FlashInfer's own Python-side
validation run on those very arguments, and the harness catching test doubles that misread the contract.

Three levels:
1. A recorder replaces ``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla``: shapes, dtypes, strides,
   3-D vs 4-D, table width, scale values, LSE base, ``out`` identity -- against Contract 1 (docs/contracts.md).
2. The real public function runs on CPU tensors with only the device queries (SM100) and the native launcher
   faked; the fake launcher computes with the CPU peer, so FlashInfer's whole Python layer -- validation,
   normalisation, LSE base, out/LSE return -- sits between our adapter and a correct result.
3. Doubles built on the peer that take a 3-D cache where 4-D is passed (and vice versa), ignore ``out`` or
   return natural-log LSE must fail the harness; the faithful double must pass.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest
import torch

from mla_verify.backends import flashinfer_trtllm, get_backend
from mla_verify.backends.cpu_peer import CPU_PEER_ENVELOPE, cpu_peer_decode
from mla_verify.backends.trtllm_style import TrtllmStyleBackend, make_workspace
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.layouts import LayoutSpec, padded_width
from mla_verify.problems.reference import reference_decode
from mla_verify.run.harness import run_case

fi_decode = pytest.importorskip("flashinfer.decode")
fi_core = pytest.importorskip("flashinfer.mla._core")
fi_trtllm = pytest.importorskip("flashinfer.mla._batch_mla._backends.trtllm_gen_backend")

SPEC = ProblemSpec(seq_lens=(5, 70, 33), q_len=1, num_heads=16, page_size=32, extra_pages=2, table_pad=1,
                   softmax_scale=0.1352, bmm2_extra=1.25, seed=9)
LAYOUTS = [LayoutSpec(), LayoutSpec(cache_dims=4), LayoutSpec(page_stride_pad=3, table_width="pad128"),
           LayoutSpec(cache_dims=4, page_stride_pad=2, table_width="pad128", pass_out=False),
           LayoutSpec(return_lse=False)]
SPECS = [SPEC, replace(SPEC, q_len=4, page_size=64, num_heads=128),
         replace(SPEC, dtype="fp8", q_scale=0.5, k_scale=2.0, kv_lora_rank=256)]


def _ids(items: list) -> list[str]:
    return [str(i) for i in range(len(items))]


class Recorder:
    """Stands in for the FlashInfer function: records the call, honours Contract 1's return convention."""

    def __init__(self) -> None:
        self.args: tuple = ()
        self.kwargs: dict[str, Any] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.args, self.kwargs = args, kwargs
        query = args[0]
        out = kwargs["out"]
        if out is None:
            out = torch.zeros(query.shape[:-1] + (args[4],), dtype=torch.bfloat16)
        if kwargs["return_lse"]:
            return out, torch.zeros(query.shape[0] * query.shape[1], query.shape[2])
        return out


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(fi_decode, "trtllm_batch_decode_with_kv_cache_mla", rec)
    return rec


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids(LAYOUTS))
@pytest.mark.parametrize("spec", SPECS, ids=_ids(SPECS))
def test_adapter_passes_exactly_the_contract_arguments(recorder: Recorder, spec: ProblemSpec,
                                                       layout: LayoutSpec) -> None:
    backend = get_backend("trtllm-gen")
    problem = build_problem(spec)
    prepared = backend.prepare(problem, layout)
    prepared.invoke()
    d = problem.dims
    B, Q, H, P, page = spec.batch, spec.q_len, spec.num_heads, problem.num_pages, spec.page_size
    D = d.kv_lora_rank + d.qk_rope_head_dim
    assert len(recorder.args) == 9  # FlashInfer's 10th positional is sparse_mla_top_k: out must be a keyword
    query, kv, workspace, nope, rank, rope, tables, lens, max_len = recorder.args
    assert (nope, rank, rope) == (d.qk_nope_head_dim, d.kv_lora_rank, d.qk_rope_head_dim)
    assert query is problem.query and query.shape == (B, Q, H, D) and query.dtype == problem.query.dtype
    # the cache: 3-D [P, page, D] or 4-D [P, 1, page, D], a view of the pool, page-strided when asked
    assert kv.shape == ((P, page, D) if layout.cache_dims == 3 else (P, 1, page, D))
    assert kv.dtype == problem.kv_cache.dtype and kv.data_ptr() == prepared.inputs["kv_pool"].data_ptr()
    assert kv.stride(0) == (page + layout.page_stride_pad) * D and kv.stride(-1) == 1
    assert torch.equal(kv.reshape(P, page, D).float().nan_to_num(7.0), problem.kv_cache.float().nan_to_num(7.0))
    # the table: int32, native width or padded to a multiple of 128 / page
    native_width = problem.block_table.shape[1]
    width = native_width if layout.table_width == "native" else padded_width(native_width, page)
    assert tables.dtype == torch.int32 and tables.shape == (B, width) and tables.is_contiguous()
    assert torch.equal(tables[:, :native_width], problem.block_table)
    assert lens is problem.seq_lens and lens.dtype == torch.int32 and max_len == max(spec.seq_lens)
    assert workspace is backend.workspace(problem.device) and not bool(workspace.any())
    assert workspace.numel() * workspace.element_size() == make_workspace(problem.device).numel()
    # keywords: nothing more, nothing less
    kw = recorder.kwargs
    assert set(kw) == {"out", "bmm1_scale", "bmm2_scale", "return_lse", "backend", "return_lse_base"}
    assert kw["backend"] == "trtllm-gen" and kw["return_lse_base"] == "base2" and kw["return_lse"] == layout.return_lse
    # passed through unchanged (how the scales compose is pinned in test_dims)
    assert kw["bmm1_scale"] == problem.bmm1_scale and kw["bmm2_scale"] == problem.bmm2_scale
    if layout.pass_out:
        assert kw["out"] is prepared.out and kw["out"].shape == (B, Q, H, d.kv_lora_rank)
        assert kw["out"].dtype == torch.bfloat16  # bf16 also for fp8 inputs
    else:
        assert kw["out"] is None and prepared.out is None


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids(LAYOUTS))
@pytest.mark.parametrize("spec", SPECS, ids=_ids(SPECS))
def test_flashinfer_python_validation_accepts_the_recorded_arguments(recorder: Recorder, spec: ProblemSpec,
                                                                     layout: LayoutSpec) -> None:
    from flashinfer.mla._batch_mla._backends.trtllm_gen_backend import (
        _prepare_trtllm_gen_mla_output,
        _trtllm_gen_mla_incompatibility_reason,
    )
    from flashinfer.mla._core import _check_mla_functional_shape, _prepare_mla_uniform_lse

    prepared = get_backend("trtllm-gen").prepare(build_problem(spec), layout)
    prepared.invoke()
    query, kv, _, _, rank, rope, tables, _, _ = recorder.args
    kw = recorder.kwargs
    # explicit backend="trtllm-gen": any table width; "auto"/"cute-dsl" also need 128 / page alignment
    kv4 = _check_mla_functional_shape(query, kv, rank, rope, 0, tables, kv.size(-2), True,
                                      require_aligned_block_table=False)
    assert kv4.shape[1] == 1 and kv4.data_ptr() == kv.data_ptr()
    if layout.table_width == "pad128":
        _check_mla_functional_shape(query, kv, rank, rope, 0, tables, kv.size(-2), True,
                                    require_aligned_block_table=True)
    assert _trtllm_gen_mla_incompatibility_reason(query.size(-2), kv.size(-2), lse_requested=kw["return_lse"]) is None
    if kw["out"] is not None:
        assert _prepare_trtllm_gen_mla_output(kw["out"], query.shape[:-1] + (rank,), query.device) is kw["out"]
    flat_lse, _ = _prepare_mla_uniform_lse(query, None)
    assert flat_lse.shape == (spec.batch * spec.q_len, spec.num_heads)


def test_flashinfer_validation_is_live() -> None:
    """The helpers above do reject what they should -- so their accepting our arguments means something."""
    from flashinfer.mla._batch_mla._backends.trtllm_gen_backend import (
        _prepare_trtllm_gen_mla_output,
        _trtllm_gen_mla_incompatibility_reason,
    )
    from flashinfer.mla._core import _check_mla_functional_shape

    q, kv = torch.zeros(2, 1, 16, 576), torch.zeros(4, 32, 576)
    with pytest.raises(ValueError, match="block_num"):
        _check_mla_functional_shape(q, kv, 512, 64, 0, torch.zeros(2, 3, dtype=torch.int32), 32, True)
    with pytest.raises(ValueError, match="head dim"):
        _check_mla_functional_shape(q[..., :512], kv, 512, 64, 0, torch.zeros(2, 4, dtype=torch.int32), 32, True)
    with pytest.raises(ValueError, match="shape of out"):
        _prepare_trtllm_gen_mla_output(torch.zeros(2, 16, 512, dtype=torch.bfloat16), (2, 1, 16, 512), q.device)
    assert "block_size" in _trtllm_gen_mla_incompatibility_reason(16, 16)
    assert "num_heads_q" in _trtllm_gen_mla_incompatibility_reason(96, 64)


@pytest.mark.parametrize("page", [1, 16, 32, 64, 128])
def test_envelope_heads_and_pages_equal_flashinfers_rule(page: int) -> None:
    from flashinfer.mla._batch_mla._backends.trtllm_gen_backend import _trtllm_gen_mla_incompatibility_reason

    env = get_backend("trtllm-gen").envelope
    for heads in range(1, 129):
        ours = env.allows_heads(heads) and page in env.page_sizes
        assert ours == (_trtllm_gen_mla_incompatibility_reason(heads, page) is None), (heads, page)


# --- level 2: the real public function on CPU, device queries faked as SM100, native launcher faked -----------

class FakeLauncher:
    """trtllm-gen's native ``trtllm_paged_attention_decode``, computed by the CPU peer from what it receives."""

    def __init__(self) -> None:
        self.args: tuple = ()

    def trtllm_paged_attention_decode(self, *a: Any) -> None:
        self.args = a
        out, query, kv, tables, lens, max_q_len, max_seq_len, bmm1, bmm2 = (a[0], a[2], a[3], a[7], a[8], a[9],
                                                                             a[10], a[11], a[12])
        assert a[3] is a[4]  # K and V are the same latent cache
        lse, lse_scale = a[28], a[29]
        B = lens.shape[0]
        result = cpu_peer_decode(query.view(B, max_q_len, query.shape[1], query.shape[2]), kv, None, 0,
                                 out.shape[-1], query.shape[-1] - out.shape[-1], tables, lens, max_seq_len,
                                 out=out.view(B, max_q_len, out.shape[-2], out.shape[-1]), bmm1_scale=bmm1,
                                 bmm2_scale=bmm2, return_lse=lse is not None)
        if lse is not None:
            lse.copy_(result[1] * lse_scale)  # the launcher scales base-2 LSE: 1.0, or ln 2 for base e


@pytest.fixture
def fake_sm100(monkeypatch: pytest.MonkeyPatch) -> FakeLauncher:
    launcher = FakeLauncher()
    monkeypatch.setattr(fi_core, "get_compute_capability", lambda device: (10, 0))
    monkeypatch.setattr(fi_core, "get_device_sm_count", lambda device: 148)
    monkeypatch.setattr(fi_core, "device_support_pdl", lambda device: False)
    monkeypatch.setattr(fi_trtllm, "get_trtllm_gen_fmha_module", lambda: launcher)
    import flashinfer.jit.cubin_loader as loader

    def no_download(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("nothing may be downloaded")
    monkeypatch.setattr(loader, "download_file", no_download)
    return launcher


@pytest.mark.parametrize("layout", LAYOUTS, ids=_ids(LAYOUTS))
@pytest.mark.parametrize("spec", SPECS, ids=_ids(SPECS))
def test_through_flashinfers_python_layer_the_answer_is_right(fake_sm100: FakeLauncher, spec: ProblemSpec,
                                                              layout: LayoutSpec) -> None:
    problem = build_problem(spec)
    prepared = get_backend("trtllm-gen").prepare(problem, layout)
    raw = prepared.invoke()
    out, lse = prepared.to_canonical(raw)
    native = fake_sm100.args
    if layout.pass_out:
        assert out is prepared.out and native[0] is prepared.out  # in place, returned by identity
    assert native[3].data_ptr() == prepared.inputs["kv_pool"].data_ptr()  # no copy of the cache
    assert native[3].dim() == 4 and native[2].data_ptr() == problem.query.data_ptr()
    assert native[11] == problem.bmm1_scale and native[29] == 1.0  # scale passed through; base 2
    ref = reference_decode(problem)
    # tolerance: the peer's bf16 output rounding (2^-8 relative) plus fp32 accumulation (see test_cpu_peer.py)
    err = (out.double() - ref.out).abs()
    assert bool((err <= 2.0 ** -8 * ref.out.abs() + 1e-4 * float(ref.out.abs().max())).all())
    if layout.return_lse:
        assert float((lse.double() - ref.lse_base2).abs().max()) < 1e-4  # fp32 LSE, base 2 as declared
    else:
        assert lse is None


def test_flashinfer_rejects_a_flat_out_buffer_through_the_same_path(fake_sm100: FakeLauncher) -> None:
    """The faked path still validates: the [B*q_len, H, L] out a wrapper user might pass is refused."""
    problem = build_problem(SPEC)
    backend = get_backend("trtllm-gen")
    prepared = backend.prepare(problem, LayoutSpec())
    flat = prepared.out.view(-1, SPEC.num_heads, problem.dims.kv_lora_rank)
    with pytest.raises(ValueError, match="shape of out"):
        fi_decode.trtllm_batch_decode_with_kv_cache_mla(
            problem.query, problem.kv_cache, backend.workspace(problem.device), 128, 512, 64,
            problem.block_table, problem.seq_lens, 70, out=flat, backend="trtllm-gen")


# --- level 3: test doubles that misread the contract are caught by the harness -----------------------------------

def _faithful(*args: Any, **kwargs: Any) -> Any:
    return cpu_peer_decode(*args, **kwargs)


def _takes_3d(query, kv_cache, *args, **kwargs):
    """Believes the cache is [P, page, D]: a 4-D [P, 1, page, D] cache becomes pages of one token."""
    return cpu_peer_decode(query, kv_cache.reshape(-1, kv_cache.shape[1], kv_cache.shape[-1]), *args, **kwargs)


def _takes_4d(query, kv_cache, *args, **kwargs):
    """Believes the cache is [P, 1, page, D] and unpacks it so."""
    pages, _, page, width = kv_cache.shape
    return cpu_peer_decode(query, kv_cache.reshape(pages, page, width), *args, **kwargs)


def _ignores_out(*args, out=None, **kwargs):
    return cpu_peer_decode(*args, out=None, **kwargs)


def _natural_log_lse(*args, **kwargs):
    result = cpu_peer_decode(*args, **kwargs)
    return (result[0], result[1] * math.log(2.0)) if kwargs.get("return_lse") else result


def _double(fn) -> TrtllmStyleBackend:
    return TrtllmStyleBackend(fn.__name__, fn, CPU_PEER_ENVELOPE)


SMALL = replace(SPEC, seq_lens=(5, 40), num_heads=4, q_len=2)


@pytest.mark.parametrize("cache_dims", [3, 4])
def test_the_faithful_double_passes_both_cache_ranks(cache_dims: int) -> None:
    result = run_case(_double(_faithful), SMALL, LayoutSpec(cache_dims=cache_dims), "cpu")
    assert result.verdict == "pass", result.failures


@pytest.mark.parametrize("fn,cache_dims,pad_fill,complaint", [
    (_takes_3d, 4, "zero", "max |out - ref|"),  # one-token pages: it attends to the wrong tokens
    (_takes_3d, 4, "oob", "kernel raised IndexError"),  # ... and walks off the table into padding ids
    (_takes_4d, 3, "oob", "kernel raised ValueError"),  # cannot even unpack a 3-D cache
    (_ignores_out, 3, "oob", "left that buffer unwritten"),
])
def test_a_double_that_misreads_the_contract_fails(fn, cache_dims: int, pad_fill: str, complaint: str) -> None:
    spec = replace(SMALL, pad_fill=pad_fill)
    result = run_case(_double(fn), spec, LayoutSpec(cache_dims=cache_dims), "cpu", diagnose=False)
    assert result.verdict == "fail"
    assert any(complaint in f for f in result.failures), result.failures


def test_the_3d_and_4d_doubles_pass_on_their_own_rank() -> None:
    """So the failures above are the rank mismatch, not doubles broken in general."""
    assert run_case(_double(_takes_3d), SMALL, LayoutSpec(cache_dims=3), "cpu").verdict == "pass"
    assert run_case(_double(_takes_4d), SMALL, LayoutSpec(cache_dims=4), "cpu").verdict == "pass"


def test_a_natural_log_lse_is_caught() -> None:
    result = run_case(_double(_natural_log_lse), SMALL, LayoutSpec(), "cpu", diagnose=False)
    assert result.verdict == "fail" and any("LSE (base 2) off" in f for f in result.failures), result.failures


# --- architecture before anything else --------------------------------------------------------------------------

@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch):
    """Pretend a CUDA device of a given capability exists; FlashInfer must not even be consulted."""
    def install(capability: tuple[int, int], name: str) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    return install


def test_on_sm90_trtllm_gen_says_it_needs_sm100_before_touching_flashinfer(fake_gpu, monkeypatch) -> None:
    fake_gpu((9, 0), "NVIDIA H200")

    def untouchable(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("FlashInfer was consulted before the architecture check")
    monkeypatch.setattr(flashinfer_trtllm, "flashinfer_unavailable", untouchable)
    monkeypatch.setattr(fi_decode, "trtllm_batch_decode_with_kv_cache_mla", untouchable)
    result = run_case(get_backend("trtllm-gen"), SPEC, LayoutSpec(), "cuda")
    assert result.verdict == "skip"
    assert result.reason == "trtllm-gen: needs SM100/SM103/SM107; this GPU (NVIDIA H200) is SM90"
    for name, wanted in (("cute-dsl", "SM100"), ("xqa", "SM120")):
        reason = get_backend(name).why_not(SPEC, LayoutSpec(table_width="pad128"), torch.device("cuda"))
        assert wanted in reason and "SM90" in reason


def test_on_sm100_the_architecture_passes_and_the_envelope_decides(fake_gpu) -> None:
    fake_gpu((10, 0), "NVIDIA B200")
    backend = get_backend("trtllm-gen")
    cuda = torch.device("cuda")
    assert backend.why_not(SPEC, LayoutSpec(), cuda) is None
    assert "96 heads" in backend.why_not(replace(SPEC, num_heads=96), LayoutSpec(), cuda)
    assert "page size 16" in backend.why_not(replace(SPEC, page_size=16), LayoutSpec(), cuda)
    assert "block-table width 'native'" in get_backend("cute-dsl").why_not(SPEC, LayoutSpec(), cuda)
    assert "SM120" in get_backend("xqa").why_not(SPEC, LayoutSpec(), cuda)


def test_on_cpu_every_flashinfer_backend_is_skipped_with_its_reason() -> None:
    for name in ("trtllm-gen", "cute-dsl", "xqa"):
        result = run_case(get_backend(name), SPEC, LayoutSpec(), "cpu")
        assert (result.verdict, result.reason) == ("skip", f"{name}: runs on cuda devices, not cpu")
