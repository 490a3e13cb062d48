"""FlashInfer's sparse MLA backends, checked on CPU against FlashInfer 0.7.4's own Python layer:
``trtllm-gen-sparse`` (``sparse_mla_top_k`` on trtllm-gen, SM100/103/107) and ``flashinfer-sparse-sm120``
(the packed SM120/121 path, ``backend="sparse"``).

1. A recorder in place of ``trtllm_batch_decode_with_kv_cache_mla``: the arguments bind to the installed
   function's signature, and each one is what the convention asks (docs/backends.md).
2. The real public function on CPU, the device faked (SM100 or SM120) and only the native launch replaced by a
   CPU computation of the sparse definition from the arguments that reach it: FlashInfer's validation and
   normalisation run on our arguments, and the answer judged against the sparse reference passes.
3. On a GPU of another architecture (the H200 here, faked) each backend skips with its reason.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import pytest
import torch
from test_trtllm_contract import FakeLauncher, fake_sm100  # noqa: F401 - fixture: trtllm-gen faked on CPU

from mla_verify.backends import get_backend
from mla_verify.kinds.sparse import SPARSE_KIND
from mla_verify.problems.packed import FORMATS, dequantize
from mla_verify.problems.sparse import SPARSE_LAYOUT, SparseDecodeProblem, SparseSpec, build_sparse_problem
from mla_verify.problems.sparse_reference import sparse_reference

fi_decode = pytest.importorskip("flashinfer.decode")
fi_core = pytest.importorskip("flashinfer.mla._core")
fi_sm120 = pytest.importorskip("flashinfer.mla._sparse_mla_sm120._prepared")

TRTLLM = SparseSpec(batch=2, q_len=2, num_heads=80, topk=128, page_size=32, used_pages=3, extra_pages=2,
                    invalid=0.2, topk_lengths=(100, 0), fmt="V32", scales="amax", seed=5)
TRTLLM_SPECS = [TRTLLM, dataclasses.replace(TRTLLM, fmt="bf16", num_heads=16, page_size=64, q_len=1,
                                            topk_lengths=None)]
SM120 = SparseSpec(batch=2, q_len=2, num_heads=32, topk=64, page_size=64, used_pages=2, extra_pages=1,
                   topk_lengths=(40, 64), seed=6)
SM120_SPECS = [SM120, dataclasses.replace(SM120, scales="amax", topk_lengths=None),
               dataclasses.replace(SM120, fmt="V32_NO_ROPE", q_len=1)]
LN2 = math.log(2.0)


class Recorder:
    """Stands in for the public function: keeps the call, returns out and a base-2 LSE of the right shapes."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.args, self.kwargs = args, kwargs
        B, Q, H = args[0].shape[:3]
        return torch.zeros((B, Q, H, 512), dtype=torch.bfloat16), torch.zeros((B * Q, H))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    rec = Recorder()
    monkeypatch.setattr(fi_decode, "trtllm_batch_decode_with_kv_cache_mla", rec)
    return rec


def bound(rec: Recorder) -> dict[str, Any]:
    """The recorded call bound to the installed function's signature (a TypeError if it does not bind)."""
    call = inspect.signature(fi_core.trtllm_batch_decode_with_kv_cache_mla).bind(*rec.args, **rec.kwargs)
    return dict(call.arguments)


@pytest.mark.parametrize("spec", TRTLLM_SPECS, ids=["V32-80heads", "bf16"])
def test_trtllm_gen_sparse_passes_the_conventions_arguments(recorder: Recorder, spec: SparseSpec) -> None:
    p = build_sparse_problem(spec)
    prepared = get_backend("trtllm-gen-sparse").prepare(p)
    prepared.invoke()
    a = bound(recorder)
    B, Q, H, D = p.query.shape
    heads = 128 if 64 < H < 128 else H  # trtllm-gen refuses 64 < h_q < 128: padded with zero queries
    assert a["query"].shape == (B, Q, heads, D) and torch.equal(a["query"][:, :, :H], p.query)
    assert not a["query"][:, :, H:].any()
    assert a["kv_cache"].shape == (p.kv_cache.shape[0], 1, p.page_size, D) and a["kv_cache"].dtype == torch.bfloat16
    assert torch.equal(a["kv_cache"][:, 0].nan_to_num(7.0), p.kv_cache.nan_to_num(7.0))  # dense values, no copy
    table = a["block_tables"]  # token slots, -1 where masked (topk_length included)
    assert table.dtype == torch.int32 and table.shape == (B, Q, spec.topk) and table.is_contiguous()
    assert torch.equal(table, torch.where(p.masked(), -1, p.indices))
    assert a["sparse_mla_top_k"] == spec.topk and a["kv_lora_rank"] == 512 and a["qk_rope_head_dim"] == D - 512
    assert torch.equal(a["seq_lens"], torch.full((B,), p.slots, dtype=torch.int32)) and a["max_seq_len"] == p.slots
    assert a["bmm1_scale"] == p.softmax_scale and a["bmm2_scale"] == 1.0
    assert (a["backend"], a["return_lse"], a["return_lse_base"]) == ("trtllm-gen", True, "base2")
    assert not a["workspace_buffer"].any()


@pytest.mark.parametrize("spec", SM120_SPECS, ids=["V32-pow2", "V32-amax", "V32_NO_ROPE"])
def test_sm120_sparse_passes_the_conventions_arguments(recorder: Recorder, spec: SparseSpec) -> None:
    p = build_sparse_problem(spec)
    get_backend("flashinfer-sparse-sm120").prepare(p).invoke()
    a = bound(recorder)
    fmt = FORMATS[spec.fmt]
    assert a["query"] is p.query and a["block_tables"] is p.indices and a["backend"] == "sparse"
    kv = a["kv_cache"]  # the packed pool itself, [P, 1, page, bytes]
    assert kv.dtype == torch.uint8 and kv.shape == (p.kv_cache.shape[0], 1, spec.page_size, fmt.bytes_per_token)
    assert kv.data_ptr() == p.packed.data_ptr()
    if spec.topk_lengths is None:
        assert a["seq_lens"] is None  # every column active
    else:  # the per-token active top-k: a request's topk_length for each of its query tokens
        assert a["seq_lens"].shape == (spec.batch, spec.q_len)
        assert a["seq_lens"].tolist() == [[n] * spec.q_len for n in spec.topk_lengths]
    # the writer's convention: pow2 scales may take the fast pow2 read, the no-RoPE layout only arbitrary
    want = "pow2_fp32" if spec.scales == "pow2" and spec.fmt == "V32" else "arbitrary_fp32"
    assert a["kv_scale_format"] == want
    assert a["bmm1_scale"] == p.softmax_scale and a["bmm2_scale"] == 1.0 and a["return_lse_base"] == "base2"


def _judge(p: SparseDecodeProblem, out: torch.Tensor, lse_base2: torch.Tensor) -> list[str]:
    return SPARSE_KIND.judge_output(p, out, lse_base2, 2.0)[1]


def _computed(query: torch.Tensor, pool: torch.Tensor, indices: torch.Tensor, scale: float,
              lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse definition over ``pool`` [P, page, D] as the launch receives it: (out, base-2 lse)."""
    problem = SparseDecodeProblem(query, pool, indices, scale, lengths)
    ref = sparse_reference(problem, precision=torch.float32)
    return ref.out.to(torch.bfloat16), ref.lse / LN2


@pytest.mark.parametrize("spec", TRTLLM_SPECS, ids=["V32-80heads", "bf16"])
def test_trtllm_gen_sparse_through_flashinfers_python_layer(fake_sm100: FakeLauncher, spec: SparseSpec) -> None:
    def launch(*a: Any) -> None:  # trtllm-gen's native decode, reading block_tables as token slots
        fake_sm100.args = a
        out, query, kv, tables, lens, bmm1, top_k, lse, lse_scale = (a[0], a[2], a[3], a[7], a[8], a[11], a[18],
                                                                     a[28], a[29])
        B, Q, H, D = tables.shape[0], tables.shape[1], query.shape[-2], query.shape[-1]
        assert a[3] is a[4] and kv.dim() == 4 and top_k == tables.shape[-1] and lens.shape == (B,)
        o, l2 = _computed(query.view(B, Q, H, D), kv[:, 0], tables, bmm1)
        out.view(B, Q, H, -1).copy_(o)
        lse.copy_(l2.reshape(B * Q, H) * lse_scale)

    fake_sm100.trtllm_paged_attention_decode = launch
    p = build_sparse_problem(spec)
    prepared = get_backend("trtllm-gen-sparse").prepare(p)
    out, lse = prepared.to_canonical(prepared.invoke())
    assert fake_sm100.args[29] == 1.0  # base 2 asked for: the launcher leaves it
    assert _judge(p, out, lse) == []


@pytest.mark.parametrize("spec", SM120_SPECS, ids=["V32-pow2", "V32-amax", "V32_NO_ROPE"])
def test_sm120_sparse_through_flashinfers_python_layer(monkeypatch: pytest.MonkeyPatch, spec: SparseSpec) -> None:
    seen: dict[str, Any] = {}

    def functional_run(query, kv_cache, indices, out, workspace, sm_scale, *, lengths=None, lse=None,
                       kv_scale_format="auto", lse_scale=1.0, **rest):  # the packed SM120 kernel, on CPU
        seen.update(kv_scale_format=kv_scale_format, rest=rest)
        fmt = FORMATS[spec.fmt]
        page = kv_cache.shape[-2]
        pool = dequantize(kv_cache.reshape(kv_cache.shape[0], -1), fmt, page, "exact")
        B, Q = spec.batch, spec.q_len  # FlashInfer hands it [B * q_len, ...] rows
        per_request = None if lengths is None else lengths.view(B, Q)[:, 0].contiguous()
        assert lengths is None or bool((lengths.view(B, Q) == per_request[:, None]).all())
        o, l2 = _computed(query.view(B, Q, *query.shape[1:]), pool, indices.view(B, Q, -1), sm_scale, per_request)
        out.copy_(o.view(out.shape))
        lse.copy_(l2.reshape(lse.shape) * lse_scale)
        return lse

    monkeypatch.setattr(fi_core, "is_sm12x_supported", lambda device: True)
    monkeypatch.setattr(fi_sm120, "functional_run", functional_run)
    p = build_sparse_problem(spec)
    prepared = get_backend("flashinfer-sparse-sm120").prepare(p)
    out, lse = prepared.to_canonical(prepared.invoke())
    assert seen["rest"]["sink"] is None and not seen["rest"]["is_dsv4_nvfp4"]
    assert _judge(p, out, lse) == []


@pytest.mark.parametrize(("name", "reason"), [
    ("trtllm-gen-sparse", "needs SM100/SM103/SM107; this GPU (NVIDIA H200) is SM90"),
    ("flashinfer-sparse-sm120", "needs SM120/SM121; this GPU (NVIDIA H200) is SM90"),
])
def test_on_an_h200_each_skips_with_its_reason(monkeypatch: pytest.MonkeyPatch, name: str, reason: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    backend = get_backend(name)
    assert backend.unavailable_reason(torch.device("cuda")) == reason
    assert backend.why_not(SM120, SPARSE_LAYOUT, torch.device("cuda")) == reason
