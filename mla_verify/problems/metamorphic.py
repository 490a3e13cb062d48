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

from .problem import DecodeProblem

Unmap = Callable[[torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor | None]"]
TRANSFORMS = ("none", "pages", "pool", "table", "batch", "max_seq_len")
RELATIONS = TRANSFORMS[1:]  # the transforms that are relations (not the plain repeat)
BATCH_ORDER = "batch"  # the one transform a kernel's schedule may see
DESCRIPTIONS = {
    "pages": "physical pages permuted (block table remapped)",
    "pool": "extra unused NaN pages placed before the pool",
    "table": "block table widened with extra padding columns",
    "batch": "batch order reversed",
    "max_seq_len": "a larger (still valid) max_seq_len",
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
    if name == "none":
        return p, _identity
    raise ValueError(f"unknown metamorphic transform {name!r}; known: {TRANSFORMS}")
