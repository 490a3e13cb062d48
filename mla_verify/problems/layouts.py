"""Every conversion between the canonical problem and the layouts kernels take, in one place.

- trtllm-style arguments: query [B, q_len, H, D]; a 3-D [P, page, D] or 4-D [P, 1, page, D] cache, optionally a
  page-strided view into a larger NaN-filled pool; block tables at their native width or padded to a
  multiple of 128 / page_size (what trtllm-gen's "auto" dispatch requires).
- FlashInfer wrapper CSR metadata (qo_indptr, kv_indptr, kv_indices, kv_len_arr) with split q_nope/q_pe
  and ckv/kpe views of one pool; a ragged problem's query tokens packed by request (``qo_indptr`` from its
  q_lens) and its output rows put back in the padded canonical form (``padded_rows``).
- The paging arithmetic they all share: how many table entries a sequence uses (``page_counts``), which
  entries of a table are pages and which are padding (``used_entries``), and the CSR page lists
  (``csr_metadata``).
- vLLM's MLA cache, [num_blocks, block_size, kv_lora_rank + rope]: the canonical 3-D layout itself.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:  # problem.py uses the paging arithmetic below: at run time only it imports the other
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


def page_counts(seq_lens: torch.Tensor, page_size: int) -> torch.Tensor:
    """[B] int64: the block-table entries each sequence uses, ceil(seq_len / page_size)."""
    return (seq_lens.long() + page_size - 1) // page_size


def used_entries(seq_lens: torch.Tensor, page_size: int, width: int) -> torch.Tensor:
    """[B, width] bool: the entries of a ``width``-column block table that hold their sequence's pages (the
    others are padding, never to be followed)."""
    return torch.arange(width, device=seq_lens.device)[None, :] < page_counts(seq_lens, page_size)[:, None]


class CsrMetadata(NamedTuple):
    """The page lists of FlashInfer's wrapper, all int32."""

    qo_indptr: torch.Tensor  # [B+1]: query rows of request b are qo_indptr[b]:qo_indptr[b+1]
    kv_indptr: torch.Tensor  # [B+1]: request b's pages are kv_indices[kv_indptr[b]:kv_indptr[b+1]]
    kv_indices: torch.Tensor  # [sum of the page counts]
    kv_len_arr: torch.Tensor  # [B]: the sequence lengths themselves


def csr_metadata(seq_lens: torch.Tensor, q_len: int, page_size: int, block_table: torch.Tensor | None = None,
                 q_lens: Sequence[int] | None = None) -> CsrMetadata:
    """CSR page lists for int32 ``seq_lens`` with ``q_len`` query tokens each (or request b ``q_lens[b]``), on
    ``seq_lens``' device. The page ids are ``block_table``'s used entries; without a table they are zeros (what a
    planner's checks need)."""
    pages = page_counts(seq_lens, page_size)
    kv_indptr = torch.nn.functional.pad(torch.cumsum(pages, 0), (1, 0)).to(torch.int32)
    batch, device = seq_lens.shape[0], seq_lens.device
    if q_lens is None:
        qo_indptr = torch.arange(0, (batch + 1) * q_len, q_len, device=device, dtype=torch.int32)
    else:
        tokens = torch.tensor(q_lens, dtype=torch.int64, device=device)
        qo_indptr = torch.nn.functional.pad(torch.cumsum(tokens, 0), (1, 0)).to(torch.int32)
    if block_table is None:
        kv_indices = torch.zeros(int(kv_indptr[-1]), dtype=torch.int32, device=device)
    else:
        kv_indices = block_table[used_entries(seq_lens, page_size, block_table.shape[1])].to(torch.int32).contiguous()
    return CsrMetadata(qo_indptr, kv_indptr, kv_indices, seq_lens)


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
    q_nope: torch.Tensor  # [total_q, H, L]: B*q_len rows, or the ragged requests' tokens only, request by request
    q_pe: torch.Tensor  # [total_q, H, R]
    ckv: torch.Tensor  # [P, page, L]  view of the pool
    kpe: torch.Tensor  # [P, page, R]  view of the same pool
    pool: torch.Tensor


def wrapper_args(problem: DecodeProblem, layout: LayoutSpec) -> WrapperArgs:
    p = problem
    L = p.dims.kv_lora_rank
    view, pool = strided_pool(p.kv_cache, layout.page_stride_pad)
    csr = csr_metadata(p.seq_lens, p.q_len, p.page_size, p.block_table, p.q_lens)
    valid = p.valid_rows()
    # ragged: only each request's own tokens, packed in request order (a copy); uniform: a view
    q = p.query.reshape(p.batch * p.q_len, p.num_heads, -1) if valid is None else p.query[valid]
    return WrapperArgs(*csr, q[..., :L], q[..., L:], view[..., :L], view[..., L:], pool)


def padded_rows(packed: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Packed ragged rows [total_q, ...] back in the canonical [B, q_len, ...] (``valid`` [B, q_len]: the rows that
    are tokens); the padding rows are NaN, which the comparison never reads (were it read, it would show)."""
    if packed.shape[0] != int(valid.sum()):
        raise ValueError(f"{packed.shape[0]} rows returned for {int(valid.sum())} query tokens")
    rows = torch.full(tuple(valid.shape) + tuple(packed.shape[1:]), float("nan"), dtype=packed.dtype,
                      device=packed.device)
    rows[valid] = packed
    return rows


def csr_to_block_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """Inverse of the CSR page lists: a [B, max_pages] int32 table padded with ``fill``."""
    counts = (kv_indptr[1:] - kv_indptr[:-1]).long()
    width = int(counts.max()) if counts.numel() else 0
    table = torch.full((counts.numel(), width), fill, dtype=torch.int32, device=kv_indices.device)
    mask = torch.arange(width, device=kv_indices.device)[None, :] < counts[:, None]
    table[mask] = kv_indices
    return table

