"""Every conversion between the canonical problem and the layouts kernels take, in one place.

- trtllm-style arguments: query [B, q_len, H, D]; a 3-D [P, page, D] or 4-D [P, 1, page, D] cache, optionally a
  page-strided view into a larger NaN-filled pool; block tables at their native width or padded to a
  multiple of 128 / page_size (what trtllm-gen's "auto" dispatch requires).
- FlashInfer wrapper CSR metadata (qo_indptr, kv_indptr, kv_indices, kv_len_arr) with split q_nope/q_pe
  and ckv/kpe views of one pool.
- vLLM's MLA cache, [num_blocks, block_size, kv_lora_rank + rope]: the canonical 3-D layout itself.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .problem import DecodeProblem

CACHE_DIMS = (3, 4)
TABLE_WIDTHS = ("native", "pad128")


@dataclass(frozen=True)
class LayoutSpec:
    """How the canonical problem is laid out for one kernel call."""

    cache_dims: int = 3  # 3: [P, page, D]; 4: [P, 1, page, D]
    page_stride_pad: int = 0  # token rows of NaN between pages in the backing pool (0: contiguous)
    table_width: str = "native"  # or "pad128": columns padded to a multiple of 128 / page_size
    pass_out: bool = True  # hand the kernel an `out` buffer to write in place
    return_lse: bool = True

    def describe(self) -> str:
        stride = f" page-strided(+{self.page_stride_pad})" if self.page_stride_pad else ""
        return (f"{self.cache_dims}D cache{stride}, table {self.table_width}, "
                f"out={'passed' if self.pass_out else 'returned'}, lse={'yes' if self.return_lse else 'no'}")

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class TrtllmArgs:
    query: torch.Tensor  # [B, q_len, H, D]
    kv_cache: torch.Tensor  # [P, page, D] or [P, 1, page, D], possibly a strided view of `pool`
    block_tables: torch.Tensor  # [B, W'] int32
    seq_lens: torch.Tensor  # [B] int32
    max_seq_len: int
    pool: torch.Tensor  # the storage behind kv_cache (all of it must stay unchanged)


def padded_width(width: int, page_size: int) -> int:
    """The smallest multiple of 128 / page_size (at least 1) that is >= width."""
    step = max(1, 128 // page_size)
    return -(-width // step) * step


def strided_pool(cache: torch.Tensor, pad_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(view, backing): ``cache`` copied into a pool with ``pad_rows`` NaN token rows after each page."""
    if pad_rows == 0:
        return cache, cache
    P, page, D = cache.shape
    backing = torch.full((P, page + pad_rows, D), float("nan"), dtype=torch.float32, device=cache.device)
    backing = backing.to(cache.dtype)
    backing[:, :page] = cache
    return backing[:, :page], backing


def trtllm_args(problem: DecodeProblem, layout: LayoutSpec) -> TrtllmArgs:
    """Arguments for a trtllm_batch_decode_with_kv_cache_mla-style call."""
    view, pool = strided_pool(problem.kv_cache, layout.page_stride_pad)
    if layout.cache_dims == 4:
        view = view.unsqueeze(1)
    table = problem.block_table
    if layout.table_width == "pad128":
        width = padded_width(table.shape[1], problem.page_size)
        table = torch.nn.functional.pad(table, (0, width - table.shape[1]), value=0)
    return TrtllmArgs(problem.query, view, table.contiguous(), problem.seq_lens,
                      problem.effective_max_seq_len, pool)


def canonical_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """[P, page, D] view of a 3-D or 4-D ([P, 1, page, D]) trtllm-style cache."""
    if kv_cache.dim() == 4:
        if kv_cache.shape[1] != 1:
            raise ValueError(f"4-D kv_cache must be [P, 1, page, D], got {tuple(kv_cache.shape)}")
        return kv_cache.squeeze(1)
    return kv_cache


@dataclass
class WrapperArgs:
    """FlashInfer BatchMLAPagedAttentionWrapper inputs: CSR page lists and split views of one pool."""

    qo_indptr: torch.Tensor  # [B+1] int32: query rows of request b are qo_indptr[b]:qo_indptr[b+1]
    kv_indptr: torch.Tensor  # [B+1] int32: request b's pages are kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices: torch.Tensor  # [sum pages] int32
    kv_len_arr: torch.Tensor  # [B] int32
    q_nope: torch.Tensor  # [B*q_len, H, L]
    q_pe: torch.Tensor  # [B*q_len, H, R]
    ckv: torch.Tensor  # [P, page, L]  view of the pool
    kpe: torch.Tensor  # [P, page, R]  view of the same pool
    pool: torch.Tensor


def wrapper_args(problem: DecodeProblem, layout: LayoutSpec) -> WrapperArgs:
    p = problem
    L = p.dims.kv_lora_rank
    view, pool = strided_pool(p.kv_cache, layout.page_stride_pad)
    used = p.pages_used()
    mask = torch.arange(p.block_table.shape[1], device=p.device)[None, :] < used[:, None]
    kv_indices = p.block_table[mask].to(torch.int32).contiguous()
    kv_indptr = torch.nn.functional.pad(torch.cumsum(used, 0), (1, 0)).to(torch.int32)
    qo_indptr = torch.arange(0, (p.batch + 1) * p.q_len, p.q_len, device=p.device, dtype=torch.int32)
    q = p.query.reshape(p.batch * p.q_len, p.num_heads, -1)
    return WrapperArgs(qo_indptr, kv_indptr, kv_indices, p.seq_lens, q[..., :L], q[..., L:],
                       view[..., :L], view[..., L:], pool)


def csr_to_block_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """Inverse of the CSR page lists: a [B, max_pages] int32 table padded with ``fill``."""
    counts = (kv_indptr[1:] - kv_indptr[:-1]).long()
    width = int(counts.max()) if counts.numel() else 0
    table = torch.full((counts.numel(), width), fill, dtype=torch.int32, device=kv_indices.device)
    mask = torch.arange(width, device=kv_indices.device)[None, :] < counts[:, None]
    table[mask] = kv_indices
    return table

