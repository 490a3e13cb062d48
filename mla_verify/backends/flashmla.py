"""DeepSeek's FlashMLA dense paged decode: ``flash_mla.get_mla_metadata`` + ``flash_mla.flash_mla_with_kvcache``.

Read from FlashMLA's public source at commit 9241ae3 (2026-04-29): ``flash_mla/flash_mla_interface.py``,
``csrc/api/dense_decode.h`` and ``csrc/sm90/decode/dense/splitkv_mla.cuh`` (docs/backends.md has the lines).

- Layout: query ``[B, q_len, H, 576]``; cache ``[num_blocks, 64, num_heads_k = 1, 576]`` -- our 3-D pool with a
  unit head axis after the page axis, a view (page-strided pools too: the row and block strides go to the
  kernel's TMA descriptor); ``block_table [B, W]`` int32 (any width); ``cache_seqlens [B]`` int32, the KV length
  including the q_len new tokens; ``head_dim_v`` = kv_lora_rank = 512.
- ``softmax_scale = bmm1_scale``, always passed: FlashMLA's default is 1/sqrt(576). There is no output scale,
  so ``bmm2_scale`` is the harness's ``output_scale``, applied in float64 when judging.
- ``causal=True``: bottom-right, as ours (FlashMLA's reference masks with ``tril(diagonal=s_k - s_q)``).
- Returns ``(out [B, q_len, H, 512], lse [B, H, q_len])``; out is allocated by FlashMLA (no ``out=``), LSE is
  fp32 in natural log.
- The metadata call: at 9241ae3 ``get_mla_metadata(*args)`` ignores its arguments and the schedule is made on
  the first kernel call; FlashMLA of 2025 (c28eca9) computed it from ``(cache_seqlens, q_len * H // h_k,
  h_k)``. The backend passes those arguments, so both interfaces get what they expect.

The two callables are injected (``FlashMLAApi``): the real ``flash_mla`` functions by default, or a stand-in
with FlashMLA's calling convention (``mla_verify.kernels.flashmla_cpu``), which is how the layout code above is
proven on CPU.
"""
from __future__ import annotations

import importlib
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..core.platform import import_error
from ..problems.layouts import LayoutSpec, trtllm_args
from ..problems.problem import DecodeProblem
from .base import Backend, Envelope, PreparedCall, SparseEnvelope, device_reason

FLASHMLA_SOURCE = "https://github.com/deepseek-ai/FlashMLA"

FLASHMLA_ENVELOPE = Envelope(
    devices=("cuda",), archs=((9, 0),), page_sizes=(64,), dims=((512, 64),), heads=None, max_heads=128,
    dtypes=("bf16",), q_len=(1, 16), cache_dims=(3,), page_strided=True, table_widths=("native", "pad128"),
    pass_out=(False,), lse=True, lse_base=math.e,
    notes="dense_decode.h: SM90a, bf16/fp16 (fp16 out is not Contract 1's bf16), page 64, head_dim_v 512; "
          "splitkv_mla.cuh asserts head dim 576; one layout [blocks, 64, 1, 576] whatever cache_dims says; "
          "FlashMLA allocates out; natural-log LSE [B, H, q_len]",
)


@dataclass(frozen=True)
class FlashMLAApi:
    """The two functions the backend calls, with ``flash_mla``'s signatures."""

    get_mla_metadata: Callable[..., Any]
    flash_mla_with_kvcache: Callable[..., Any]


@dataclass
class FlashMLAArgs:
    q: torch.Tensor  # [B, q_len, H, D]
    k_cache: torch.Tensor  # [num_blocks, page, 1, D], a view of `pool`
    block_table: torch.Tensor  # [B, W] int32
    cache_seqlens: torch.Tensor  # [B] int32
    pool: torch.Tensor


def flashmla_args(problem: DecodeProblem, layout: LayoutSpec) -> FlashMLAArgs:
    """FlashMLA's inputs: the trtllm-style 3-D cache (strided or not) with a unit KV-head axis added."""
    a = trtllm_args(problem, replace(layout, cache_dims=3))
    return FlashMLAArgs(a.query, a.kv_cache.unsqueeze(2), a.block_tables, a.seq_lens, a.pool)


def install_hint() -> str | None:
    """None when the ``flash_mla`` package is installed; otherwise the one line saying how to get it."""
    if importlib.util.find_spec("flash_mla") is None:
        return ("install FlashMLA: no flash_mla package here "
                f"(not on the package index: build it from {FLASHMLA_SOURCE})")
    return None


def flash_mla_import_error() -> str | None:
    """None when ``import flash_mla`` works; else one line saying why (an extension built for another torch...)."""
    return import_error("flash_mla")


def flashmla_unavailable(api: FlashMLAApi | None, envelope: Envelope | SparseEnvelope,
                         device: torch.device) -> str | None:
    """Why a FlashMLA backend calling ``api`` (the installed ``flash_mla`` when None) cannot run on ``device``."""
    if api is not None:
        return device_reason(envelope, device)
    reason = install_hint() or device_reason(envelope, device)
    if reason is None and (error := flash_mla_import_error()):
        reason = f"FlashMLA is installed but cannot be imported ({error})"
    return reason


def installed_api() -> FlashMLAApi:
    import flash_mla

    return FlashMLAApi(flash_mla.get_mla_metadata, flash_mla.flash_mla_with_kvcache)


class FlashMLABackend(Backend):
    """FlashMLA's dense decode through ``api`` (the installed ``flash_mla`` when None)."""

    def __init__(self, name: str = "flashmla", api: FlashMLAApi | None = None,
                 envelope: Envelope = FLASHMLA_ENVELOPE,
                 description: str = "DeepSeek FlashMLA dense paged MLA decode (SM90)"):
        self.name = name
        self.api = api
        self.envelope = envelope
        self.description = description

    def unavailable_reason(self, device: torch.device) -> str | None:
        return flashmla_unavailable(self.api, self.envelope, device)

    def prepare(self, problem: DecodeProblem, layout: LayoutSpec) -> PreparedCall:
        p = problem
        api = self.api or installed_api()
        a = flashmla_args(p, layout)
        heads_k = a.k_cache.shape[2]
        metadata, num_splits = api.get_mla_metadata(a.cache_seqlens, p.q_len * p.num_heads // heads_k, heads_k)

        def invoke() -> Any:
            return api.flash_mla_with_kvcache(a.q, a.k_cache, a.block_table, a.cache_seqlens, p.dims.kv_lora_rank,
                                              metadata, num_splits, softmax_scale=float(p.bmm1_scale), causal=True)

        def to_canonical(result: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
            out, lse = result  # lse [B, H, q_len] -> [B, q_len, H]
            return out, lse.transpose(1, 2) if layout.return_lse else None

        inputs = {"q": a.q, "kv_pool": a.pool, "block_table": a.block_table, "cache_seqlens": a.cache_seqlens}
        # no output scale in FlashMLA: bmm2 is applied to its output when it is judged
        return PreparedCall(invoke, inputs, None, to_canonical, output_scale=float(p.bmm2_scale))


def flashmla_backend() -> FlashMLABackend:
    return FlashMLABackend()
