"""Transformations of a problem that must not change a correct kernel's output -- compared bit for bit where the
backend claims that (``Envelope.bit_invariant``), else by the tolerance model (run/harness.py).

Each returns the transformed problem and a function mapping the kernel's canonical (out, lse) back to the
original order. A deterministic kernel gives the very same bits: none of these changes the arithmetic a
request needs, only where its pages live, how wide its table is, its slot in the batch, or a bound.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ..core.bits import SAME_WIDTH_INTS
from .problem import DecodeProblem

Unmap = Callable[[torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor | None]"]
TRANSFORMS = ("none", "pages", "pool", "table", "batch", "max_seq_len")
BATCH_ORDER = "batch"  # the one transform a kernel's schedule may see
# pages moved past 2^31 and 2^32 elements of a pool of 4-8 GiB: drawn, and judged, only where the device has the
# memory for it (``large_pool_reason``), so it is not among TRANSFORMS
LARGE_POOL = "high_pages"
WRAPS = (2**31, 2**32)  # element offsets at which a signed and an unsigned 32-bit offset wrap
# the transforms that are relations (not the plain repeat), the large pool's included: it moves data, not
# arithmetic, so a backend that claims every relation bit for bit claims it too (Envelope.bit_invariant)
RELATIONS = (*TRANSFORMS[1:], LARGE_POOL)
DESCRIPTIONS = {
    "pages": "physical pages permuted (block table remapped)",
    "pool": "extra unused NaN pages placed before the pool",
    "table": "block table widened with extra padding columns",
    "batch": "batch order reversed",
    "max_seq_len": "a larger (still valid) max_seq_len",
    LARGE_POOL: "the pages moved past 2^31 and 2^32 elements of a NaN-filled pool",
}


def _identity(out: torch.Tensor, lse: torch.Tensor | None):
    return out, lse


def transform(p: DecodeProblem, name: str, seed: int = 0) -> tuple[DecodeProblem, Unmap]:
    """Apply the named transformation (see TRANSFORMS)."""
    used = p.used_entries()
    if name == "pages":
        gen = torch.Generator(device=p.device)
        gen.manual_seed(seed)
        perm = torch.randperm(p.num_pages, generator=gen, device=p.device)
        pool = torch.empty_like(p.kv_cache)
        pool[perm] = p.kv_cache  # page i moves to slot perm[i]
        table = torch.where(used, perm[p.block_table.long().clamp(0, p.num_pages - 1)].to(torch.int32), p.block_table)
        return replace(p, kv_cache=pool, block_table=table), _identity
    if name == "pool":
        extra = 3
        nan = torch.full((extra,) + tuple(p.kv_cache.shape[1:]), float("nan"), device=p.device).to(p.kv_cache.dtype)
        table = torch.where(used, p.block_table + extra, p.block_table)
        return replace(p, kv_cache=torch.cat([nan, p.kv_cache]), block_table=table), _identity
    if name == "table":
        return replace(p, block_table=torch.nn.functional.pad(p.block_table, (0, 5), value=0)), _identity
    if name == "batch":
        order = torch.arange(p.batch - 1, -1, -1, device=p.device)
        moved = replace(p, query=p.query[order], block_table=p.block_table[order], seq_lens=p.seq_lens[order],
                        q_lens=None if p.q_lens is None else p.q_lens[::-1])

        def unmap(out: torch.Tensor, lse: torch.Tensor | None):
            return out[order], (None if lse is None else lse[order])
        return moved, unmap
    if name == "max_seq_len":
        return replace(p, max_seq_len=p.block_table.shape[1] * p.page_size), _identity
    if name == LARGE_POOL:
        ids = torch.tensor(high_page_ids(p.num_pages, p.page_size * p.kv_cache.shape[-1]), device=p.device)
        pool = nan_pool((int(ids.max()) + 1,) + tuple(p.kv_cache.shape[1:]), p.kv_cache)
        ints = SAME_WIDTH_INTS[pool.element_size()]  # copied as integers: index_put takes every width
        pool.view(ints)[ids] = p.kv_cache.view(ints)
        table = torch.where(used, ids[p.block_table.long().clamp(0, p.num_pages - 1)].to(torch.int32), p.block_table)
        return replace(p, kv_cache=pool, block_table=table), _identity
    if name == "none":
        return p, _identity
    raise ValueError(f"unknown metamorphic transform {name!r}; known: {TRANSFORMS}")


def high_page_ids(pages: int, stride: int) -> list[int]:
    """Where ``LARGE_POOL`` puts a pool's ``pages`` pages of ``stride`` elements each (page i goes to the i-th):
    the first page past 2^32 elements, the first past 2^31, the pages that cross 2^32 and 2^31, then on past 2^32
    -- so one page is enough for an unsigned 32-bit offset to wrap, two for a signed one."""
    past31, past32 = (-(-wrap // stride) for wrap in WRAPS)
    ids = [past32, past31, past32 - 1, past31 - 1][:pages]
    return ids + list(range(past32 + 1, past32 + 1 + pages - len(ids)))


def large_pool_elements(pages: int, stride: int) -> int:
    """The elements of the pool ``LARGE_POOL`` makes of ``pages`` pages of ``stride`` elements."""
    return (max(high_page_ids(pages, stride)) + 1) * stride


def nan_pool(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` (``like``'s dtype and device) filled with NaN through an integer view:
    no float32 copy of it is ever made (a pool of 2^32 bf16 values is 8 GiB)."""
    pool = torch.empty(shape, dtype=like.dtype, device=like.device)
    ints = SAME_WIDTH_INTS[pool.element_size()]
    nan = torch.full((1,), float("nan"), device=like.device).to(like.dtype).view(ints)
    return pool.view(ints).fill_(int(nan.item())).view(like.dtype)
