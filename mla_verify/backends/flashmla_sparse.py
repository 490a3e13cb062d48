"""DeepSeek FlashMLA's sparse (top-k) decode over packed FP8 caches, as the sgl-flash-mla wheel runs it on SM90.

Read from the wheel's ``flash_mla/flash_mla_interface.py`` (sgl-flash-mla 1.0.0) and upstream FlashMLA
(9241ae3, ``csrc/api/sparse_decode.h``); ../docs/backends.md has the details.

- Call: ``flash_mla_with_kvcache(q, k_cache, None, None, 512, sched_meta, softmax_scale=..., is_fp8_kvcache=True,
  indices=..., attn_sink=..., topk_length=..., kv_format=<fmt>)`` plus ``use_legacy=True`` where the function
  takes it (the wheel: its SM90 kernels are the legacy ones; ``flashmla_api`` tells the interfaces apart).
  ``block_table`` and ``cache_seqlens`` are ignored by sparse decode; ``sched_meta`` is a fresh
  ``get_mla_metadata()[0]`` per prepared call (it bakes in the shapes and topk_length, which one prepared
  call never changes).
- ``q [B, q_len, h_q, 576|512]`` bf16 with h_q 64 or 128: a problem's heads are padded with zero queries up to
  the next of them (as vLLM and SGLang do) and the padding is cut from the result.
- ``k_cache [pages, page, 1, bytes_per_token]`` uint8, the packed pool (problems/packed.py) with its page stride.
- ``kv_format`` is always passed: 528-byte rows are V4.1 to the wheel unless told ``"V32_NO_ROPE"``.
- Returns ``out [B, q_len, h_q, 512]`` bf16 and ``lse [B, h_q, q_len]`` fp32 in natural log (+inf for a row
  with no valid entry).
- The kernel bounds-checks nothing but -1: ``prepare`` refuses a problem with any other index outside the pool
  (the problem's own validation), so no call here can read out of bounds.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..problems.envelope import SparseEnvelope
from ..problems.layouts import LayoutSpec
from ..problems.packed import FORMATS, kernel_view
from ..problems.sparse import SPARSE_LAYOUT, SparseDecodeProblem
from .base import Backend, PreparedCall
from .flashmla_api import FlashMLAApi, flashmla_unavailable, installed_api, needs_wheel

FLASHMLA_HEADS = (64, 128)  # the SM90 sparse kernel is instantiated for these h_q only
# the format the wheel reads rows of this width as when kv_format is None; 528 is V4.1 unless told V32_NO_ROPE
WHEEL_FORMAT_BY_BYTES = {656: "V32", 584: "V4"}
FLASHMLA_SPARSE_ENVELOPE = SparseEnvelope(
    devices=("cuda",), archs=((9, 0),), formats=("V32", "V32_NO_ROPE", "V4"), topk_multiple=64, max_topk=2048,
    max_heads=128, q_len=(1, 2), page_sizes=(64, 2, 61, 69), topk_length_formats=("V4",), lse_base=math.e,
    notes="SM90 instantiates run_flash_splitkv_mla_fp8_sparse_kernel for V32, V4 and V32_NO_ROPE with h_q 64/128; "
          "TOPK_BLOCK_SIZE 64; 'V3.2 does not support dynamic topk length' (topk_length with V32_NO_ROPE "
          "unverified: left out of topk_length_formats); "
          "the page sizes FlashMLA's own sparse tests use",
)


def padded_heads(h: int) -> int:
    """The h_q FlashMLA's sparse kernel runs a problem of ``h`` heads with."""
    if h > FLASHMLA_HEADS[-1]:
        raise ValueError(f"FlashMLA's sparse decode runs at most {FLASHMLA_HEADS[-1]} heads, not {h}")
    return next(n for n in FLASHMLA_HEADS if n >= h)


class FlashMLASparseBackend(Backend):
    """FlashMLA's sparse decode through ``api`` (the installed ``flash_mla`` when None); ``own_kernel``: ``api``
    is a kernel of one's own with FlashMLA's sparse convention, which needs no FlashMLA interface of its own."""

    def __init__(self, name: str = "flashmla-sparse", api: FlashMLAApi | None = None,
                 envelope: SparseEnvelope = FLASHMLA_SPARSE_ENVELOPE,
                 description: str = "DeepSeek FlashMLA sparse top-k MLA decode over packed FP8 caches (SM90)",
                 own_kernel: bool = False):
        self.name, self.api, self.envelope, self.description = name, api, envelope, description
        self.own_kernel = own_kernel

    def unavailable_reason(self, device: torch.device) -> str | None:
        return flashmla_unavailable(self.api, self.envelope, device) or \
            (None if self.own_kernel else needs_wheel(self.api, "sparse decode on SM90"))

    def prepare(self, problem: SparseDecodeProblem, layout: LayoutSpec = SPARSE_LAYOUT) -> PreparedCall:
        p = problem.validate()
        if p.packed is None:
            raise ValueError("FlashMLA's sparse decode reads a packed FP8 cache; this problem has none")
        api = self.api or installed_api()
        fmt = FORMATS[p.fmt]
        B, Q, H, D = p.query.shape
        heads = padded_heads(H)
        q = torch.zeros((B, Q, heads, D), dtype=torch.bfloat16, device=p.query.device)
        q[:, :, :H] = p.query
        sink = None
        if p.attn_sink is not None:
            sink = torch.zeros((heads,), dtype=torch.float32, device=p.query.device)
            sink[:H] = p.attn_sink
        k_cache = kernel_view(p.packed, fmt, p.page_size)
        # one schedule per prepared call, as dense flashmla: it depends on the shapes and topk_length, which a
        # prepared call never changes, and a timed call (bench) must not time the scheduler
        meta, splits = api.get_mla_metadata()

        def invoke() -> Any:
            return api.flash_mla_with_kvcache(q, k_cache, None, None, p.d_v, meta, splits,
                                              softmax_scale=float(p.softmax_scale), is_fp8_kvcache=True,
                                              indices=p.indices, attn_sink=sink, topk_length=p.topk_length,
                                              kv_format=p.fmt, **api.call_kwargs())

        def to_canonical(result: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            out, lse = result  # out [B, Q, h_q, 512]; lse [B, h_q, Q]
            return out[:, :, :H], lse.transpose(1, 2)[:, :, :H]

        inputs = {"q": q, "packed": p.packed, "indices": p.indices,
                  **({} if sink is None else {"attn_sink": sink}),
                  **({} if p.topk_length is None else {"topk_length": p.topk_length})}
        return PreparedCall(invoke, inputs, None, to_canonical)


def flashmla_sparse_backend() -> FlashMLASparseBackend:
    return FlashMLASparseBackend()
