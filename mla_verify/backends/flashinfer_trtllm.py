"""FlashInfer's trtllm-gen, cute-dsl and xqa MLA decode kernels, through
``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla(..., backend=...)``.

All three take Contract 1's arguments, so they are ``TrtllmStyleBackend``s: the very adapter user kernels get.
The same function's sparse paths (``sparse_mla_top_k``: trtllm-gen, and the packed SM120 one) are the sparse
backends ``trtllm-gen-sparse`` and ``flashinfer-sparse-sm120`` at the end.
Envelopes are read from the FlashInfer 0.7.4 source (see docs/backends.md for the line references). The
architecture is checked before FlashInfer is imported or called: on SM90 an explicit ``backend="trtllm-gen"``
call has no Python-side architecture check and would go fetch cubins from the network first.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..core.platform import flashinfer_unavailable
from ..problems.envelope import SparseEnvelope
from ..problems.layouts import LayoutSpec
from ..problems.packed import FORMATS, unpack
from ..problems.sparse import SPARSE_LAYOUT, UNPACKED, SparseDecodeProblem
from .base import Backend, PreparedCall
from .trtllm_style import TRTLLM_ENVELOPE, TrtllmStyleBackend, make_workspace, split_lse

BLACKWELL_DC = ((10, 0), (10, 3), (10, 7))  # SM100 / SM103 / SM107: the archs trtllm-gen's FmhaRunner accepts
SM12X = ((12, 0), (12, 1))

TRTLLM_GEN_ENVELOPE = TRTLLM_ENVELOPE.narrowed(
    devices=("cuda",), archs=BLACKWELL_DC,
    notes="fmhaRunner.cuh: SM100/103/107 only; _trtllm_gen_mla_incompatibility_reason: page 32/64, "
          "not 64 < heads < 128; explicit backend='trtllm-gen' accepts a native-width block table.",
)
CUTE_DSL_ENVELOPE = TRTLLM_ENVELOPE.narrowed(
    devices=("cuda",), archs=BLACKWELL_DC,
    page_sizes=(2, 4, 8, 16, 32, 64, 128),  # can_implement: 128 % page == 0 and page != 1 (TMA alignment)
    dims=((512, 64),), heads=None, max_heads=128,  # can_implement: L 512, R 64, 1 <= heads <= 128
    table_widths=("pad128",),  # the functional API requires alignment unless backend == "trtllm-gen"
    notes="cute_dsl monolithic mla_decode can_implement; LSE requested in base 2 explicitly "
          "(its historical default is natural log).",
)
XQA_ENVELOPE = TRTLLM_ENVELOPE.narrowed(
    devices=("cuda",), archs=SM12X,
    page_sizes=(16, 32, 64, 128), dims=((512, 64),), heads=(128,), q_len=(1, 1),
    table_widths=("pad128",), lse=False,
    notes="gen_xqa_module_mla: 128 heads, head dim 576, page 16/32/64/128; q_len 1; no LSE output; "
          "SM120a needs CUDA >= 12.8, SM121a CUDA >= 12.9.",
)


def flashinfer_mla_decode(*args: Any, **kwargs: Any) -> Any:
    """``flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla``, imported on first call (the import is slow)."""
    import flashinfer.decode

    return flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla(*args, **kwargs)


def xqa_mla_decode(query: torch.Tensor, kv_cache: torch.Tensor, *args: Any, out: torch.Tensor | None = None,
                   **kwargs: Any) -> Any:
    """XQA's ``out`` is ``[B, H, L]`` (its q_len is 1), not trtllm-gen's ``[B, 1, H, L]``: hand it a view of the
    Contract-1 buffer and give back the result in Contract-1 shape."""
    flat = None if out is None else out.view(out.shape[0], out.shape[2], out.shape[3])
    result = flashinfer_mla_decode(query, kv_cache, *args, out=flat, **kwargs)
    return result.view(query.shape[0], 1, query.shape[2], -1)


class FlashInferTrtllmBackend(TrtllmStyleBackend):
    """A FlashInfer kernel behind ``trtllm_batch_decode_with_kv_cache_mla``: device and architecture first,
    then whether FlashInfer imports at all."""

    def unavailable_reason(self, device: torch.device) -> str | None:
        return super().unavailable_reason(device) or flashinfer_unavailable()


def trtllm_backends() -> list[FlashInferTrtllmBackend]:
    lse_base2 = {"return_lse_base": "base2"}
    return [
        FlashInferTrtllmBackend("trtllm-gen", flashinfer_mla_decode, TRTLLM_GEN_ENVELOPE,
                                "FlashInfer trtllm-gen MLA decode (TensorRT-LLM cubins)",
                                {"backend": "trtllm-gen", **lse_base2}),
        FlashInferTrtllmBackend("cute-dsl", flashinfer_mla_decode, CUTE_DSL_ENVELOPE,
                                "FlashInfer CuTe-DSL MLA decode (monolithic)",
                                {"backend": "cute-dsl", **lse_base2}),
        FlashInferTrtllmBackend("xqa", xqa_mla_decode, XQA_ENVELOPE,
                                "FlashInfer XQA MLA decode (SM120/121)", {"backend": "xqa"}),
    ]



# --- sparse (top-k) decode through the same function, ``sparse_mla_top_k=topk`` (FlashInfer 0.7.4, mla/_core.py)

TRTLLM_GEN_SPARSE_ENVELOPE = SparseEnvelope(
    devices=("cuda",), archs=BLACKWELL_DC, formats=("bf16", "V32"), topk_multiple=64, max_topk=2048,
    max_heads=128, q_len=(1, 2), page_sizes=(32, 64), topk_length_formats=("bf16", "V32"), sinks=False,
    lse_base=2.0,
    notes="trtllm-gen sparse MLA: a dense bf16 cache [P, 1, page, 576]; page 32/64 "
          "(_trtllm_gen_mla_incompatibility_reason); block_tables [B, q_len, topk] token slots with -1, as "
          "FlashInfer's sparse-MLA benchmark writes them (its trace reference reads page ids: unverified until "
          "an SM100 run); topk_length sent as -1 entries; sinks left out (their units are not documented)",
)
SM120_SPARSE_ENVELOPE = SparseEnvelope(
    devices=("cuda",), archs=SM12X, formats=("V32", "V32_NO_ROPE"), topk_multiple=64, max_topk=2048,
    max_heads=128, q_len=(1, 2), topk_length_formats=("V32", "V32_NO_ROPE"), sinks=False, lse_base=2.0,
    notes="_trtllm_batch_decode_sparse_mla_v32_sm120: the packed uint8 cache (656-byte V3.2 rows, or 528-byte "
          "no-RoPE rows with arbitrary_fp32 scales), block_tables [B, q_len, topk] token slots, seq_lens the "
          "per-token active topk; bmm2_scale 1; heads <= 128; sinks left out (their units are not documented)",
)
SPARSE_NOPE = 128  # qk_nope_head_dim passed along (DeepSeek V3.2's); FlashInfer's sparse paths do not use it


def scale_format(problem: SparseDecodeProblem) -> str:
    """FlashInfer's ``kv_scale_format`` for a packed cache: ``pow2_fp32`` when every stored scale is a power of
    two (DeepSeek's writer), else ``arbitrary_fp32``; the no-RoPE layout takes ``arbitrary_fp32`` only."""
    assert problem.packed is not None
    fmt = FORMATS[problem.fmt]
    scales = unpack(problem.packed, fmt, problem.page_size)[1]
    scales = scales[scales.isfinite()]  # a slot no index lists holds NaN
    pow2 = bool((torch.log2(scales) == torch.log2(scales).round()).all())
    return "pow2_fp32" if pow2 and fmt.rope else "arbitrary_fp32"


class FlashInferSparseBackend(Backend):
    """The sparse calling convention of ``trtllm_batch_decode_with_kv_cache_mla(..., sparse_mla_top_k=topk)``:
    FlashInfer's (``fi_backend``: ``"trtllm-gen"`` over a dense bf16 cache, or ``"sparse"`` (SM120/121) over the
    packed one), or a user kernel's (``fn``, ``fi_backend`` None: the packed cache when the problem's format is
    packed -- its envelope names the formats it reads -- else the dense bf16 one). Query, cache, block tables
    ``[B, q_len, topk]`` of token slots with -1, seq_lens, ``bmm1_scale`` the softmax scale; ``out`` passed as
    the layout says; the LSE asked for in base 2, ``[B * q_len, H]`` as Contract 1 returns it."""

    def __init__(self, name: str, envelope: SparseEnvelope, fi_backend: str | None, description: str,
                 fn: Callable[..., Any] = flashinfer_mla_decode):
        self.name, self.envelope, self.fi_backend, self.description = name, envelope, fi_backend, description
        self.fn = fn
        if fi_backend == "trtllm-gen":  # a dense bf16 cache whatever the problem's format
            self.widened_formats = tuple(f for f in envelope.formats if f != UNPACKED)
        self._workspaces: dict[torch.device, torch.Tensor] = {}

    def unavailable_reason(self, device: torch.device) -> str | None:
        return super().unavailable_reason(device) or (flashinfer_unavailable() if self.fi_backend else None)

    def prepare(self, problem: SparseDecodeProblem, layout: LayoutSpec = SPARSE_LAYOUT) -> PreparedCall:
        p = problem.validate()
        B, Q, H, D = p.query.shape
        device = p.query.device
        if device not in self._workspaces:
            self._workspaces[device] = make_workspace(device)
        topk = p.indices.shape[-1]
        extra: dict[str, Any] = {}
        if self.fi_backend == "trtllm-gen" or (self.fi_backend is None and p.packed is None):
            heads = 128 if 64 < H < 128 and self.fi_backend else H  # trtllm-gen: no 64 < h_q < 128, padded
            q = torch.zeros((B, Q, heads, D), dtype=torch.bfloat16, device=device)
            q[:, :, :H] = p.query
            kv = p.kv_cache.to(torch.bfloat16).unsqueeze(1)  # [P, 1, page, D]
            table = torch.where(p.masked(), -1, p.indices).to(torch.int32).contiguous()
            lens: torch.Tensor | None = torch.full((B,), p.slots, dtype=torch.int32, device=device)
        else:
            if p.packed is None:
                raise ValueError("FlashInfer's SM120 sparse decode reads a packed cache; this problem has none")
            fmt = FORMATS[p.fmt]
            q, table = p.query, p.indices
            kv = p.packed.view(p.kv_cache.shape[0], 1, p.page_size, fmt.bytes_per_token)
            lens = None if p.topk_length is None else p.topk_length[:, None].expand(B, Q).contiguous()
            if self.fi_backend:
                extra["kv_scale_format"] = scale_format(p)
        if self.fi_backend:
            extra.update(return_lse_base="base2", backend=self.fi_backend)
        out = torch.empty((B, Q, q.shape[2], p.d_v), dtype=torch.bfloat16, device=device) if layout.pass_out \
            else None
        if out is not None:
            extra["out"] = out

        def invoke() -> Any:
            return self.fn(q, kv, self._workspaces[device], SPARSE_NOPE, p.d_v, D - p.d_v, table, lens, p.slots,
                           sparse_mla_top_k=topk, bmm1_scale=float(p.softmax_scale), bmm2_scale=1.0,
                           return_lse=layout.return_lse, **extra)

        def to_canonical(result: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            if not layout.return_lse:
                return result[:, :, :H], None
            o, lse = result  # out [B, q_len, h_q, 512]; lse [B * q_len, h_q]
            return o[:, :, :H], split_lse(lse, B, Q)[:, :, :H]

        return PreparedCall(invoke, {"query": q, "kv_cache": kv, "block_tables": table}, out, to_canonical)


def flashinfer_sparse_backends() -> list[FlashInferSparseBackend]:
    return [
        FlashInferSparseBackend("trtllm-gen-sparse", TRTLLM_GEN_SPARSE_ENVELOPE, "trtllm-gen",
                                "FlashInfer trtllm-gen sparse (top-k) MLA decode over a dense bf16 cache"),
        FlashInferSparseBackend("flashinfer-sparse-sm120", SM120_SPARSE_ENVELOPE, "sparse",
                                "FlashInfer's SM120/121 sparse (top-k) MLA decode over the packed FP8 cache"),
    ]
