"""FlashMLA's calling convention on CPU: ``get_mla_metadata`` and ``flash_mla_with_kvcache`` in PyTorch.

A test double for the ``flashmla`` backend. It takes exactly what FlashMLA (9241ae3) takes, refuses what
FlashMLA's Python layer and its dense-decode entry (``csrc/api/dense_decode.h``, and the SM90 kernel's head-dim
assert) refuse, and computes with a ``mutants.FaultyKernel`` -- the correct one, or any mutant -- so the mutants'
kill matrix runs through the backend's own layout code on a CPU.

How FlashMLA's convention meets the faulty kernel's (Contract 1's):
- the cache ``[blocks, page, 1, D]`` is handed over as its view ``[blocks, 1, page, D]``, Contract 1's 4-D form,
  so a kernel that reads the page size from the wrong axis is wrong here too;
- FlashMLA allocates ``out`` and returns it: a kernel that writes elsewhere leaves that buffer unwritten;
- ``causal=False`` is FlashMLA's non-causal attention: the kernel's causal mask is switched off;
- the LSE goes from base 2 ``[B*q_len, H]`` to FlashMLA's natural log ``[B, H, q_len]``;
- this convention has no output scale, so an output-scale fault (``Faults.bmm2_power``, the scale applied 0 or 2
  times) becomes the kernel applying the one scale it is given, ``softmax_scale``, to its output that many
  times less one: the same bug class -- an output scaled when it must not be;
- FlashMLA takes 64-token pages only; ``page_sizes`` can widen that, so that a kernel assuming 64-token pages
  can be told from a correct one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..backends.base import Envelope
from ..backends.flashmla import FLASHMLA_ENVELOPE, FlashMLAApi, FlashMLABackend
from .mutants import FaultyKernel, correct_kernel

HEAD_DIM_K = 576  # csrc/sm90/decode/dense/config.h, asserted by run_flash_splitkv_mla_kernel
HEAD_DIM_V = 512
CPU_ENVELOPE = FLASHMLA_ENVELOPE.narrowed(devices=("cpu",), archs=None)


@dataclass
class SchedMeta:
    """What FlashMLA's ``FlashMLASchedMeta`` holds for its Python layer: the shapes of its first call."""

    config: tuple | None = None


def _check(ok: bool, message: str) -> None:
    """TORCH_CHECK: a RuntimeError."""
    if not ok:
        raise RuntimeError(message)


class FlashMLAStandIn:
    """``get_mla_metadata`` and ``flash_mla_with_kvcache`` computed by ``kernel``."""

    def __init__(self, kernel: FaultyKernel = correct_kernel, page_sizes: tuple[int, ...] = (64,)):
        self.kernel = kernel
        self.page_sizes = page_sizes

    def get_mla_metadata(self, *args: Any, **kwargs: Any) -> tuple[SchedMeta, None]:
        return SchedMeta(), None

    def flash_mla_with_kvcache(self, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor | None,
                               cache_seqlens: torch.Tensor | None, head_dim_v: int,
                               tile_scheduler_metadata: SchedMeta, num_splits: None = None,
                               softmax_scale: float | None = None, causal: bool = False,
                               is_fp8_kvcache: bool = False, indices: torch.Tensor | None = None,
                               **sparse_only: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert isinstance(tile_scheduler_metadata, SchedMeta), \
            "tile_scheduler_metadata must be of type FlashMLASchedMeta"
        assert num_splits is None, "num_splits must be None"
        assert indices is None and not any(v is not None for v in sparse_only.values()), \
            "the stand-in is FlashMLA's dense decode only"
        assert block_table is not None and cache_seqlens is not None, \
            "block_table and cache_seqlens must be provided when dense attention is used."
        config = (*q.shape[:3], k_cache.shape[1], k_cache.shape[2], causal, is_fp8_kvcache)
        if tile_scheduler_metadata.config is None:
            tile_scheduler_metadata.config = config
        assert tile_scheduler_metadata.config == config, "Your input arguments are inconsistent with sched_meta."
        _check_dense_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, self.page_sizes)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        return self._compute(q, k_cache, block_table, cache_seqlens, head_dim_v, scale, causal and q.shape[1] > 1)

    def _compute(self, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                 cache_seqlens: torch.Tensor, head_dim_v: int, scale: float,
                 causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.kernel.faults
        kernel = FaultyKernel(replace(f, bmm2_power=1, causal=f.causal and causal), self.kernel.__name__)
        B, Q, H, D = q.shape
        out = torch.empty((B, Q, H, head_dim_v), dtype=q.dtype, device=q.device)
        _, lse = kernel(q, k_cache.transpose(1, 2), None, 0, head_dim_v, D - head_dim_v, block_table,
                        cache_seqlens, int(cache_seqlens.max()), out=out, bmm1_scale=scale,
                        bmm2_scale=scale ** (f.bmm2_power - 1), return_lse=True)
        return out, (lse * math.log(2.0)).view(B, Q, H).transpose(1, 2).contiguous()


def _check_dense_decode(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                        cache_seqlens: torch.Tensor, head_dim_v: int, page_sizes: tuple[int, ...]) -> None:
    """dense_attn_decode_interface's checks, in its order and words."""
    _check(q.dtype in (torch.bfloat16, torch.float16), f"q dtype {q.dtype}: bf16 or fp16 only")
    _check(k_cache.dtype == q.dtype, "query and key must have the same dtype")
    _check(cache_seqlens.dtype == torch.int32, "seqlens_k must have dtype int32")
    _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
    _check(q.stride(-1) == 1, "q must have contiguous last dimension")
    _check(k_cache.stride(-1) == 1, "kcache must have contiguous last dimension")
    _check(cache_seqlens.is_contiguous(), "seqlens_k must be contiguous")
    _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
    _check(q.dim() == 4 and k_cache.dim() == 4, "q and kcache must be 4-D")
    B, Q, H, D = q.shape
    _check(D in (576, 512), "Only head_size_k == 576 or 512 is supported")
    _check(head_dim_v == HEAD_DIM_V, "Only head_size_v == 576 is supported")  # sic, FlashMLA's message
    _check(k_cache.shape[1] in page_sizes, "Currently page_block_size must be 64")
    _check(B > 0, "batch size must be positive")
    heads_k = k_cache.shape[2]
    _check(H % heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    _check(heads_k == 1, "the stand-in computes MLA's single latent KV head")
    q.view(B, Q, heads_k, H // heads_k, D)  # FlashMLA's own regrouping of the heads: a view, or an error
    _check(k_cache.shape[3] == D, "kcache head size must equal q's")
    _check(tuple(cache_seqlens.shape) == (B,) and block_table.dim() == 2 and block_table.shape[0] == B,
           "seqlens_k must be [batch_size] and block_table [batch_size, max_num_blocks_per_seq]")
    _check(D == HEAD_DIM_K, "params.d == Config::HEAD_DIM_K (the SM90 dense kernel is built for 576)")


def stand_in_backend(kernel: FaultyKernel = correct_kernel,
                     envelope: Envelope = CPU_ENVELOPE) -> FlashMLABackend:
    """The ``flashmla`` backend on CPU, calling the stand-in computed by ``kernel``, which takes the page sizes
    of ``envelope``."""
    stand_in = FlashMLAStandIn(kernel, envelope.page_sizes or ())
    return FlashMLABackend(f"flashmla-cpu[{kernel.__name__}]",
                           FlashMLAApi(stand_in.get_mla_metadata, stand_in.flash_mla_with_kvcache), envelope,
                           f"FlashMLA's calling convention on CPU, computed by {kernel.__name__}")
