"""Sparse decode on CPU with FlashMLA's sparse calling convention, correct or with one sparse bug class.

``SparseStandIn`` takes what the sgl-flash-mla wheel's ``flash_mla_with_kvcache(..., indices=...)`` takes --
the packed pool as ``[pages, page, 1, bytes]``, ``indices``, ``topk_length``, ``attn_sink``, ``kv_format`` --
refuses what its sparse path refuses (h_q 64/128, topk a multiple of 64, no dynamic topk_length for V3.2, 528
bytes without ``kv_format``), and computes in fp32 with the SM90 dequant (problems/packed.py) -- unless one field
of ``SparseFaults`` says otherwise. ``SPARSE_MUTANTS`` are those faults, each with a small trigger problem and the
diagnosis (judge/sparse_catalog.py) expected to name it; ``stand_in_backend`` puts one behind the
``flashmla-sparse`` backend's own layout code.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from ..backends.flashmla_api import FlashMLAApi
from ..backends.flashmla_sparse import (
    FLASHMLA_HEADS,
    FLASHMLA_SPARSE_ENVELOPE,
    WHEEL_FORMAT_BY_BYTES,
    FlashMLASparseBackend,
)
from ..problems.envelope import SparseEnvelope
from ..problems.packed import FORMATS, FP8, dequantize, next_tile, truncated_to_pow2
from ..problems.sparse import SparseSpec

CPU_SPARSE_ENVELOPE = replace(FLASHMLA_SPARSE_ENVELOPE, devices=("cpu",), archs=None)


def _stored(scales: torch.Tensor) -> torch.Tensor:
    return scales


@dataclass(frozen=True)
class SparseFaults:
    """One field per place a sparse kernel goes wrong; every default is the correct behaviour."""

    indices_as_pages: bool = False  # an index taken for a page id: slot = index * page_size
    mask_minus1: bool = True  # -1 entries masked (else read as slot -1: the pool's last row)
    use_topk_length: bool = True  # entries at or past topk_length masked
    sink_in_lse: bool = False  # the sink added into the returned LSE
    scales: Any = _stored  # stored scales -> the scales used
    rope_fp8: bool = False  # the bf16 rope dims rounded to fp8 as if quantized
    v_offset: int = 0  # V read from dims [v_offset, v_offset + 512) (64: the rope dims included)
    empty_rows_zero: bool = True  # a row with no valid entry gives 0 and +inf (else 0/0: NaN)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


class SparseStandIn:
    """``get_mla_metadata`` and the sparse ``flash_mla_with_kvcache`` of the wheel, computed on CPU."""

    def __init__(self, faults: SparseFaults = SparseFaults(), name: str = "correct_sparse_kernel"):
        self.faults, self.__name__ = faults, name

    def get_mla_metadata(self, *args: Any, **kwargs: Any) -> tuple[object, None]:
        return object(), None

    def flash_mla_with_kvcache(self, q: torch.Tensor, k_cache: torch.Tensor, block_table: Any, cache_seqlens: Any,
                               head_dim_v: int, tile_scheduler_metadata: Any, num_splits: None = None,
                               softmax_scale: float | None = None, causal: bool = False,
                               is_fp8_kvcache: bool | None = None, indices: torch.Tensor | None = None,
                               attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                               kv_format: str | None = None, use_legacy: bool = False,
                               **unused: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert indices is not None and not causal and is_fp8_kvcache is not False, "the stand-in is sparse only"
        assert not any(v is not None for v in unused.values()), f"not taken by the stand-in: {sorted(unused)}"
        _check(q.dtype == torch.bfloat16 and q.dim() == 4 and q.shape[2] in FLASHMLA_HEADS,
               "q must be bf16 [b, s_q, h_q, d] with h_q 64 or 128")
        _check(k_cache.dim() == 4 and k_cache.shape[2] == 1 and k_cache.element_size() == 1, "k_cache: h_k must be 1")
        _check(indices.dtype == torch.int32 and indices.shape[-1] % 64 == 0, "topk must be a multiple of 64")
        _check(head_dim_v == 512, "head_dim_v must be 512")
        width = k_cache.shape[-1]
        fmt_name = kv_format or WHEEL_FORMAT_BY_BYTES.get(width, "V41")
        _check(fmt_name in FORMATS and FORMATS[fmt_name].bytes_per_token == width,
               f"{width}-byte rows as {fmt_name}: not a format SM90 runs")
        _check(topk_length is None or fmt_name != "V32", "V3.2 does not support dynamic topk length")
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        return self._compute(q, k_cache, FORMATS[fmt_name], indices, topk_length, attn_sink, scale)

    def _compute(self, q: torch.Tensor, k_cache: torch.Tensor, fmt: Any, indices: torch.Tensor,
                 topk_length: torch.Tensor | None, sink: torch.Tensor | None,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.faults
        P, page = k_cache.shape[:2]
        pool = k_cache.view(torch.uint8).as_strided((P, k_cache.stride(0)), (k_cache.stride(0), 1))
        rows = dequantize(pool, fmt, page, "sm90", f.scales)
        if f.rope_fp8:
            rows[..., fmt.nope:] = rows[..., fmt.nope:].to(FP8).to(torch.bfloat16)
        # past its pool a kernel reads memory it was not given: here NaN, the suite's poison for what a kernel must
        # not read (a GPU kernel reads garbage there, or faults)
        flat = torch.cat([rows.reshape(P * page, -1).float(), torch.full_like(rows[0, :1].float(), float("nan"))])
        idx = indices.long()
        slots = (idx * page).clamp(max=P * page) if f.indices_as_pages else idx % (P * page)  # -1: the last row
        masked = idx == -1 if f.mask_minus1 else torch.zeros_like(idx, dtype=torch.bool)
        if topk_length is not None and f.use_topk_length:
            masked |= torch.arange(idx.shape[-1]) >= topk_length.long()[:, None, None]
        kv = flat[slots].masked_fill(masked[..., None], 0.0)  # [B, Q, K, D]; masked rows zeroed, as SM90 does
        scores = torch.einsum("bqhd,bqkd->bqhk", q.float(), kv) * scale
        scores = scores.masked_fill(masked[:, :, None, :], float("-inf"))
        top = scores.amax(-1, keepdim=True)
        e = torch.exp(scores - torch.where(top == float("-inf"), 0.0, top))
        total = e.sum(-1)
        out = torch.einsum("bqhk,bqkd->bqhd", e, kv[..., f.v_offset:f.v_offset + 512]) / total[..., None]
        lse = top[..., 0] + torch.log(total)
        if sink is not None:
            out = out * torch.sigmoid(lse - sink)[..., None]
            if f.sink_in_lse:
                lse = torch.logaddexp(lse, sink)
        if f.empty_rows_zero:  # after the sink: an empty row's -inf lse against a -inf sink would give NaN
            out = out.masked_fill((total == 0)[..., None], 0.0)
            lse = lse.masked_fill(total == 0, float("inf"))
        return out.to(torch.bfloat16), lse.transpose(1, 2)


def stand_in_backend(faults: SparseFaults = SparseFaults(), name: str = "correct_sparse_kernel",
                     envelope: SparseEnvelope = CPU_SPARSE_ENVELOPE) -> FlashMLASparseBackend:
    stand_in = SparseStandIn(faults, name)
    return FlashMLASparseBackend(f"flashmla-sparse-cpu[{name}]",
                                 FlashMLAApi(stand_in.get_mla_metadata, stand_in.flash_mla_with_kvcache), envelope,
                                 f"FlashMLA's sparse calling convention on CPU, computed by {name}")


@dataclass(frozen=True)
class SparseMutant:
    name: str
    description: str
    faults: SparseFaults
    diagnosis: str  # the judge/sparse_catalog.py misreading expected to name it
    trigger: SparseSpec  # a small problem that shows the fault


# Triggers: 64 heads (no padding to hide behind), topk 64 over 4 pages of 64; variations add what a fault needs.
_BASE = SparseSpec(batch=2, num_heads=64, topk=64, page_size=64, used_pages=4, invalid=0.2)

_ALL = [
    # 2 used pages of 2 slots among 64: seed 10 (found by search) puts both in the pool's first half, so
    # index * 2 stays inside the pool (on NaN slots); duplicates and no -1 keep minus1_read from fitting too
    SparseMutant("indices_as_page_ids", "takes each index for a page id (slot = index * page_size)",
                 SparseFaults(indices_as_pages=True), "indices_as_page_ids",
                 replace(_BASE, page_size=2, used_pages=2, extra_pages=62, invalid=0.0, duplicates=True, seed=10)),
    SparseMutant("minus1_unmasked", "reads -1 entries as slot -1 (the pool's last row) instead of masking them",
                 SparseFaults(mask_minus1=False), "minus1_read", _BASE),
    SparseMutant("topk_length_ignored", "attends to every entry, past topk_length too",
                 SparseFaults(use_topk_length=False), "topk_length_ignored",
                 replace(_BASE, fmt="V4", invalid=0.0, topk=128, topk_lengths=(40, 100))),
    SparseMutant("sink_in_lse", "adds the attention sink into the returned LSE",
                 SparseFaults(sink_in_lse=True), "sink_in_lse", replace(_BASE, sink="finite")),
    SparseMutant("scales_pow2", "cuts fp32 scales to powers of two (an e8m0 cast)",
                 SparseFaults(scales=truncated_to_pow2), "scales_pow2", replace(_BASE, scales="amax")),
    SparseMutant("tile_scale_shifted", "reads each 128-value tile with the next tile's scale",
                 SparseFaults(scales=next_tile), "tile_scale_shifted", replace(_BASE, values="extreme")),
    # a larger softmax scale: the rope part's fp8 rounding then moves the softmax well past bf16's noise
    SparseMutant("rope_quantized", "rounds the bf16 rope dims to fp8 as if they were quantized",
                 SparseFaults(rope_fp8=True), "rope_quantized", replace(_BASE, softmax_scale=0.5)),
    SparseMutant("v_rope_dims", "takes V from dims 64..575 (the rope dims included) instead of 0..511",
                 SparseFaults(v_offset=64), "v_rope_dims", _BASE),
    SparseMutant("empty_row_nan", "divides 0 by 0 for a row with no valid entry (NaN, not 0)",
                 SparseFaults(empty_rows_zero=False), "empty_row_nan",
                 replace(_BASE, fmt="V4", topk_lengths=(0, 64))),
]
SPARSE_MUTANTS: dict[str, SparseMutant] = {m.name: m for m in _ALL}
correct_sparse_kernel = stand_in_backend()


def __getattr__(name: str) -> FlashMLASparseBackend:
    """``mla_verify.kernels.sparse_mutants:<mutant name>`` is that mutant behind the flashmla-sparse backend."""
    if name in SPARSE_MUTANTS:
        return stand_in_backend(SPARSE_MUTANTS[name].faults, name)
    raise AttributeError(f"module 'mla_verify.kernels.sparse_mutants' has no attribute {name!r}")
