"""FlashMLA's calling conventions on CPU, both of them: upstream's and the sgl-flash-mla wheel's, in PyTorch; and
the wheel's sparse one (``SparseStandIn``, computed by ``mutants.FaultySparseKernel``).

A test double for the ``flashmla`` backends. ``FlashMLAStandIn`` takes exactly what upstream FlashMLA (9241ae3)
takes; ``WheelStandIn`` what sgl-flash-mla 1.0.0 takes (``use_legacy``, ``descale_q``/``descale_k``,
``get_mla_decoding_metadata``), and each refuses what that interface's Python layer and its dense-decode entry
(``csrc/api/dense_decode.h``; the wheel's dense fp8 ``fwd_kvcache_mla_fp8``) refuse. Both compute with a
``mutants.FaultyKernel`` -- the correct one, or any mutant -- so the mutants' kill matrix runs through the
backend's own layout code on a CPU, through either interface.

How FlashMLA's convention meets the faulty kernel's (Contract 1's):
- the cache ``[blocks, page, 1, D]`` is handed over as its view ``[blocks, 1, page, D]``, Contract 1's 4-D form,
  so a kernel that reads the page size from the wrong axis is wrong here too;
- FlashMLA allocates ``out`` and returns it: a kernel that writes elsewhere leaves that buffer unwritten;
- ``causal=False`` is FlashMLA's non-causal attention: the kernel's causal mask is switched off;
- the LSE goes from base 2 ``[B*q_len, H]`` to FlashMLA's natural log ``[B, H, q_len]``, +inf for a row with
  no key (a request of ``cache_seqlens`` 0), as FlashMLA gives it;
- bf16 has no output scale, so an output-scale fault (``Faults.bmm2_power``, the scale applied 0 or 2 times)
  becomes the kernel applying the one scale it is given, ``softmax_scale``, to its output that many times less
  one: the same bug class -- an output scaled when it must not be; fp8's output scale is ``descale_k``;
- FlashMLA takes 64-token pages only; ``page_sizes`` can widen that, so that a kernel assuming 64-token pages
  can be told from a correct one.
The wheel's schedule is a stand-in too: the ``cache_seqlens`` it was made for, kept in the sched meta as the
wheel keeps its tile scheduler metadata (filled by the first dense call, reused unchecked afterwards). Reused
stale, it behaves as the wheel did on the H200 (docs/backends.md): for another batch size it raises "num_splits
must have shape (batch_size+1)"; for other lengths it is silently wrong -- the stand-in covers each sequence only
up to the length it was scheduled for. (A stale head count, also silently wrong on the GPU, is not modelled.)
The LSE comes back as the wheel's does: ``[B, H, q_len]``, a non-contiguous view.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..backends.base import Envelope
from ..backends.flashmla import FLASHMLA_ENVELOPE, FLASHMLA_FP8_ENVELOPE, FlashMLABackend
from ..backends.flashmla_api import FlashMLAApi
from ..backends.flashmla_sparse import FLASHMLA_SPARSE_ENVELOPE, FlashMLASparseBackend
from ..problems.envelope import SparseEnvelope
from ..problems.problem import FP8
from .mutants import FaultyKernel, FaultySparseKernel, SparseFaults, correct_kernel

HEAD_DIM_V = 512
CPU_ENVELOPE = FLASHMLA_ENVELOPE.narrowed(devices=("cpu",), archs=None)
CPU_FP8_ENVELOPE = FLASHMLA_FP8_ENVELOPE.narrowed(devices=("cpu",), archs=None)
CPU_SPARSE_ENVELOPE = replace(FLASHMLA_SPARSE_ENVELOPE, devices=("cpu",), archs=None)


@dataclass
class SchedMeta:
    """``FlashMLASchedMeta``'s fields: the config of its first call (upstream's check) and the schedule (the
    wheel's dense paths: filled by the first call, or assigned from ``get_mla_decoding_metadata``)."""

    have_initialized: bool = False
    config: tuple | None = None
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None


def _check(ok: bool, message: str) -> None:
    """TORCH_CHECK: a RuntimeError."""
    if not ok:
        raise RuntimeError(message)


def _schedule(cache_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stand-in schedule: the lengths it was made for, and FlashMLA's ``num_splits`` shape ``[B + 1]``."""
    return cache_seqlens.clone().view(1, -1), torch.arange(cache_seqlens.numel() + 1, dtype=torch.int32)


class FlashMLAStandIn:
    """Upstream's ``get_mla_metadata`` and ``flash_mla_with_kvcache`` (dense), computed by ``kernel``."""

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
                               attn_sink: torch.Tensor | None = None, extra_k_cache: torch.Tensor | None = None,
                               extra_indices_in_kvcache: torch.Tensor | None = None,
                               topk_length: torch.Tensor | None = None,
                               extra_topk_length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        _check_python_layer(tile_scheduler_metadata, num_splits)
        assert indices is None, "the stand-in is FlashMLA's dense decode only"
        # upstream asserts what the dense path cannot take (9241ae3 flash_mla_interface.py:163-164)
        assert block_table is not None and cache_seqlens is not None, \
            "block_table and cache_seqlens must be provided when dense attention is used."
        assert all(x is None for x in (attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length,
                                       extra_topk_length)), "attn_sink, extra_k_cache and topk_length are sparse only"
        config = (*q.shape[:3], k_cache.shape[1], k_cache.shape[2], causal, is_fp8_kvcache)
        if tile_scheduler_metadata.config is None:
            tile_scheduler_metadata.config = config
        assert tile_scheduler_metadata.config == config, "Your input arguments are inconsistent with sched_meta."
        _check(q.shape[-1] != 512, "params.d == Config::HEAD_DIM_K (9241ae3's SM90 kernel is built for 576 only)")
        return self._dense(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)

    def _dense(self, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor, cache_seqlens: torch.Tensor,
               head_dim_v: int, softmax_scale: float | None, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        _check_dense_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, self.page_sizes)
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        return self._compute(q, k_cache, block_table, cache_seqlens, head_dim_v, scale, 1.0, causal and q.shape[1] > 1)

    def _compute(self, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                 cache_seqlens: torch.Tensor, head_dim_v: int, scale: float, out_scale: float,
                 causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``kernel`` with bmm1 ``scale`` over ``cache_seqlens`` keys; the output scaled by ``out_scale`` (1 for
        bf16, descale_k for fp8)."""
        f = self.kernel.faults
        kernel = FaultyKernel(replace(f, bmm2_power=1, causal=f.causal and causal), self.kernel.__name__)
        B, Q, H, D = q.shape
        out = torch.empty((B, Q, H, head_dim_v), dtype=torch.bfloat16, device=q.device)
        wrong = scale if out_scale == 1.0 else out_scale  # the scale an output-scale fault misapplies
        _, lse = kernel(q, k_cache.transpose(1, 2), None, 0, head_dim_v, D - head_dim_v, block_table,
                        cache_seqlens, int(cache_seqlens.max()), out=out, bmm1_scale=scale,
                        bmm2_scale=out_scale * wrong ** (f.bmm2_power - 1), return_lse=True)
        lse = (lse * math.log(2.0)).masked_fill(lse == float("-inf"), float("inf"))  # FlashMLA: +inf for no key
        return out, lse.view(B, Q, H).transpose(1, 2)


class WheelStandIn(FlashMLAStandIn):
    """sgl-flash-mla 1.0.0's interface: dense bf16 and fp8 decode need ``use_legacy=True``; the dense branch
    keeps no config, checks no reuse and ignores the sparse-only arguments (wheel ``flash_mla_interface.py``
    :161-204)."""

    def get_mla_decoding_metadata(self, seqlens_k: torch.Tensor, num_q_tokens_per_head_k: int, h_k: int,
                                  h_q: int | None = None, is_fp8_kvcache: bool = False, topk: int | None = None,
                                  use_legacy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        if is_fp8_kvcache and topk is None:
            assert use_legacy, "dense fp8 decoding exists only on the legacy side"
        return _schedule(seqlens_k)

    def flash_mla_with_kvcache(self, q: torch.Tensor, k_cache: torch.Tensor,
                               block_table: torch.Tensor | None, cache_seqlens: torch.Tensor | None,
                               head_dim_v: int, tile_scheduler_metadata: SchedMeta, num_splits: None = None,
                               softmax_scale: float | None = None, causal: bool = False,
                               is_fp8_kvcache: bool | None = None, indices: torch.Tensor | None = None,
                               attn_sink: torch.Tensor | None = None, extra_k_cache: torch.Tensor | None = None,
                               extra_indices_in_kvcache: torch.Tensor | None = None,
                               topk_length: torch.Tensor | None = None,
                               extra_topk_length: torch.Tensor | None = None, enable_batch_invariant: bool = False,
                               use_legacy: bool = False, kv_format: str | None = None,
                               descale_q: torch.Tensor | None = None,
                               descale_k: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        meta = tile_scheduler_metadata
        _check_python_layer(meta, num_splits)
        assert indices is None, "the stand-in is FlashMLA's dense decode only"
        assert use_legacy, "Sparse attention is required: `indices` must be provided. Dense MLA decoding was " \
                           "removed from the current kernels; pass use_legacy=True to reach the legacy one"
        assert kv_format is None, "kv_format does not apply to dense decoding"
        assert block_table is not None and cache_seqlens is not None  # the C++ entry dereferences both
        if is_fp8_kvcache:
            assert meta.tile_scheduler_metadata is not None, (
                "dense fp8 decoding needs metadata from get_mla_decoding_metadata(..., is_fp8_kvcache=True, "
                "use_legacy=True) before the first call")
            return self._dense_fp8(q, k_cache, block_table, _scheduled(meta, cache_seqlens), head_dim_v,
                                   softmax_scale, causal, descale_q, descale_k)
        assert descale_q is None and descale_k is None, "descale_q/descale_k apply to the dense fp8 path only"
        if meta.tile_scheduler_metadata is None:  # the first call makes the schedule; later ones reuse it
            meta.tile_scheduler_metadata, meta.num_splits = _schedule(cache_seqlens)
        return self._dense(q, k_cache, block_table, _scheduled(meta, cache_seqlens), head_dim_v, softmax_scale,
                           causal)

    def _dense_fp8(self, q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                   cache_seqlens: torch.Tensor, head_dim_v: int, softmax_scale: float | None, causal: bool,
                   descale_q: torch.Tensor | None, descale_k: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """fwd_kvcache_mla_fp8's checks, then scores scaled by softmax_scale * descale_q * descale_k and the
        output by descale_k."""
        _check(q.dtype == FP8, "q must be float8_e4m3fn")
        _check(k_cache.dtype == q.dtype, "query and key must have the same dtype")
        _check(q.shape[-1] == 576, "Only head_size_k == 576 is supported")
        _check(descale_q is not None and descale_k is not None, "descale is required when input dtype is fp8")
        assert descale_q is not None and descale_k is not None
        for name, t in (("descale_q_", descale_q), ("descale_k_", descale_k)):
            _check(t.dtype == torch.float32, f"{name}.dtype() == torch::kFloat")
            _check(tuple(t.shape) == (1,), f"{name} must have shape (1)")
        _check_dense_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, self.page_sizes, dtypes=(FP8,))
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        dq, dk = float(descale_q), float(descale_k)
        return self._compute(q, k_cache, block_table, cache_seqlens, head_dim_v, scale * dq * dk, dk,
                             causal and q.shape[1] > 1)


def _scheduled(meta: SchedMeta, cache_seqlens: torch.Tensor) -> torch.Tensor:
    """The lengths the wheel's kernel covers under ``meta``'s schedule: ``cache_seqlens`` when the schedule was
    made for them, each capped at its scheduled length when it is stale; another batch size is refused."""
    assert meta.tile_scheduler_metadata is not None and meta.num_splits is not None
    _check(tuple(meta.num_splits.shape) == (cache_seqlens.numel() + 1,), "num_splits must have shape (batch_size+1)")
    return torch.minimum(cache_seqlens, meta.tile_scheduler_metadata.view(-1).to(cache_seqlens.device))


def _check_python_layer(meta: Any, num_splits: Any) -> None:
    assert isinstance(meta, SchedMeta), "tile_scheduler_metadata must be of type FlashMLASchedMeta"
    assert num_splits is None, "num_splits must be None"


def _check_dense_decode(q: torch.Tensor, k_cache: torch.Tensor, block_table: torch.Tensor,
                        cache_seqlens: torch.Tensor, head_dim_v: int, page_sizes: tuple[int, ...],
                        dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16)) -> None:
    """dense_attn_decode_interface's checks, in its order and words."""
    _check(q.dtype in dtypes, f"q dtype {q.dtype}: {dtypes} only")
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
    _check(head_dim_v == HEAD_DIM_V, "Only head_size_v == 512 is supported")
    _check(k_cache.shape[1] in page_sizes, "Currently page_block_size must be 64")
    _check(B > 0, "batch size must be positive")
    heads_k = k_cache.shape[2]
    _check(H % heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    _check(heads_k == 1, "the stand-in computes MLA's single latent KV head")
    q.view(B, Q, heads_k, H // heads_k, D)  # FlashMLA's own regrouping of the heads: a view, or an error
    _check(k_cache.shape[3] == D, "kcache must have shape (num_blocks, page_block_size, num_heads_k, head_size_k)")
    _check(tuple(cache_seqlens.shape) == (B,) and block_table.dim() == 2 and block_table.shape[0] == B,
           "seqlens_k must be [batch_size] and block_table [batch_size, max_num_blocks_per_seq]")


def stand_in_api(stand_in: FlashMLAStandIn) -> FlashMLAApi:
    """The stand-in's functions as a ``FlashMLAApi`` (the wheel's has ``get_mla_decoding_metadata``)."""
    return FlashMLAApi(stand_in.get_mla_metadata, stand_in.flash_mla_with_kvcache,
                       getattr(stand_in, "get_mla_decoding_metadata", None))


def stand_in_backend(kernel: FaultyKernel = correct_kernel, envelope: Envelope = CPU_ENVELOPE,
                     interface: str = "upstream") -> FlashMLABackend:
    """The ``flashmla`` backend on CPU (``flashmla-fp8`` with an fp8 envelope), calling the stand-in of
    ``interface`` ("upstream" or "wheel") computed by ``kernel``, which takes the page sizes of ``envelope``."""
    fp8 = envelope.dtypes == ("fp8",)
    interface = "wheel" if fp8 else interface  # dense fp8 is the wheel's alone
    stand_in = (WheelStandIn if interface == "wheel" else FlashMLAStandIn)(kernel, envelope.page_sizes or ())
    name = f"flashmla{'-fp8' * fp8}-cpu[{interface}:{kernel.__name__}]"
    return FlashMLABackend(name, stand_in_api(stand_in), envelope,
                           f"FlashMLA's {interface} calling convention on CPU, computed by {kernel.__name__}", fp8)


class SparseStandIn:
    """The wheel's sparse entry points, ``get_mla_metadata`` and ``flash_mla_with_kvcache(..., indices=...)``,
    computed on CPU by a ``mutants.FaultySparseKernel`` with ``faults`` (the correct one by default): a stand-in
    for the ``flash_mla`` module (shadow mode's tests) or behind the ``flashmla-sparse`` backend's own code."""

    def __init__(self, faults: SparseFaults = SparseFaults(), name: str = "correct_sparse_kernel"):
        self.flash_mla_with_kvcache = FaultySparseKernel(faults, name)
        self.__name__ = name

    def get_mla_metadata(self, *args: Any, **kwargs: Any) -> tuple[object, None]:
        return object(), None


def sparse_stand_in_backend(faults: SparseFaults = SparseFaults(), name: str = "correct_sparse_kernel",
                            envelope: SparseEnvelope = CPU_SPARSE_ENVELOPE) -> FlashMLASparseBackend:
    """The ``flashmla-sparse`` backend on CPU, calling the wheel's sparse interface as ``SparseStandIn`` has it."""
    stand_in = SparseStandIn(faults, name)
    return FlashMLASparseBackend(f"flashmla-sparse-cpu[{name}]",
                                 FlashMLAApi(stand_in.get_mla_metadata, stand_in.flash_mla_with_kvcache), envelope,
                                 f"FlashMLA's sparse calling convention on CPU, computed by {name}")
