"""Three faulty Contract-1 kernels that no catalogued misreading explains, for the localization tests (each
one bug a real kernel has had the shape of). Importable as ``faulty_kernels:<name>`` with tests/ on
PYTHONPATH. Each declares a small CPU envelope, so the engine's premerge run on it stays quick.

- ``upper_heads_rescaled``: the CPU peer, except that the second tile of 64 heads scales its scores by 1.5.
- ``splits_capped``: the CPU peer with a split table sized for 4 splits of 64 tokens: positions >= 256 are
  never visited.
- ``empty_split_nan``: flash-decoding over fixed splits of ``max_seq_len``, every sequence through every
  split; a split past a short sequence's end has all its keys masked, its maximum is -inf, and
  exp(-inf - -inf) is NaN. It never reads a cache slot outside a sequence.

And ``last_split_nan`` and ``odd_split_nan``, kernels that declare where they are fragile (``split_sizes``,
draw/edges.py).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mla_verify.backends.cpu_peer import cpu_peer_decode
from mla_verify.problems.layouts import canonical_cache

HEAD_TILE = 64
TILE_SCALE = 1.5
SPLIT = 64
MAX_SPLITS = 4
_SMALL = {"devices": ["cpu"], "dims": [[256, 64]], "page_sizes": [16, 32], "q_len": [1, 2], "max_batch": 4}


def upper_heads_rescaled(query: torch.Tensor, kv_cache: torch.Tensor, workspace: Any, nope: int, rank: int,
                         rope: int, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                         out: torch.Tensor | None = None, bmm1_scale: float = 1.0, bmm2_scale: float = 1.0,
                         return_lse: bool = False, **kwargs: Any) -> Any:
    """Heads from 64 on are computed with bmm1_scale x 1.5."""
    common = (kv_cache, workspace, nope, rank, rope, block_tables, seq_lens, max_seq_len)
    low = cpu_peer_decode(query[:, :, :HEAD_TILE], *common, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale,
                          return_lse=True)
    high = cpu_peer_decode(query[:, :, HEAD_TILE:], *common, bmm1_scale=bmm1_scale * TILE_SCALE,
                           bmm2_scale=bmm2_scale, return_lse=True)
    result = torch.cat([low[0], high[0]], dim=2)
    if out is not None:
        out.copy_(result)
        result = out
    return (result, torch.cat([low[1], high[1]], dim=1)) if return_lse else result


def splits_capped(*args: Any, **kwargs: Any) -> Any:
    """Visits at most 4 splits of 64 tokens."""
    args = list(args)
    args[8] = min(args[8], MAX_SPLITS * SPLIT)  # max_seq_len: what the split loop runs to
    return cpu_peer_decode(*args, tokens_per_split=SPLIT, **kwargs)


def empty_split_nan(query: torch.Tensor, kv_cache: torch.Tensor, workspace: Any, nope: int, rank: int, rope: int,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                    out: torch.Tensor | None = None, bmm1_scale: float = 1.0, bmm2_scale: float = 1.0,
                    return_lse: bool = False, **kwargs: Any) -> Any:
    """Splits of 64 positions up to max_seq_len for every sequence, merged without guarding empty ones."""
    cache = canonical_cache(kv_cache)
    B, Q, H, D = query.shape
    page = cache.shape[1]
    pos = torch.arange(max_seq_len, device=query.device)
    lens = seq_lens.long()
    valid = pos[None, :] < lens[:, None]  # [B, T]
    pages = torch.where(valid, block_tables[:, pos // page], 0).long()
    rows = cache[pages, pos % page].float().masked_fill(~valid[..., None], 0.0)  # nothing outside is used
    scores = torch.einsum("bqhd,btd->bqht", query.float(), rows) * bmm1_scale
    limit = lens[:, None] - Q + torch.arange(Q, device=query.device)  # [B, Q]: the last visible position
    scores = scores.masked_fill((pos[None, None, :] > limit[..., None])[:, :, None, :], float("-inf"))
    maxima = [s.amax(-1, keepdim=True) for s in scores.split(SPLIT, -1)]  # -inf for a split with no key
    top = torch.stack(maxima).amax(0)
    num = torch.zeros((B, Q, H, rank), device=query.device)
    den = torch.zeros((B, Q, H, 1), device=query.device)
    for s, m, v in zip(scores.split(SPLIT, -1), maxima, rows[..., :rank].split(SPLIT, 1)):
        e = torch.exp(s - m) * torch.exp(m - top)  # the bug: exp(-inf - -inf) = NaN for an empty split
        num += torch.einsum("bqht,btl->bqhl", e, v)
        den += e.sum(-1, keepdim=True)
    result = (num / den * bmm2_scale).to(torch.bfloat16)
    if out is not None:
        out.copy_(result)
        result = out
    lse = ((top + den.log()) / torch.log(torch.tensor(2.0))).reshape(B * Q, H)
    return (result, lse) if return_lse else result


upper_heads_rescaled.mla_verify_envelope = {**_SMALL, "heads": [72, 128], "max_seq_len": 96}
splits_capped.mla_verify_envelope = {**_SMALL, "heads": [1, 2], "max_seq_len": 400}
empty_split_nan.mla_verify_envelope = {**_SMALL, "heads": [1, 2], "max_seq_len": 200}


# Kernels whose minimal output can be all NaN, or whose wrong rows are other rows' answers: the diagnosis must
# name no misreading it cannot confirm (test_diagnose_nan.py).
def next_page_read(*args: Any, **kwargs: Any) -> Any:
    """Skips a real page: reads the physical page after the one the block table names (wrapping)."""
    args = list(args)
    args[6] = (args[6] + 1) % canonical_cache(args[1]).shape[0]
    return cpu_peer_decode(*args, **kwargs)


def page_stride_ignored(query: torch.Tensor, kv_cache: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Ignores the page stride of a strided pool: addresses page p at p * page_size rows, as if contiguous."""
    packed = torch.empty(kv_cache.shape, device="meta").stride()
    return cpu_peer_decode(query, kv_cache.as_strided(kv_cache.shape, packed, kv_cache.storage_offset()), *args,
                           **kwargs)


def aligned_last_page_dropped(*args: Any, **kwargs: Any) -> Any:
    """Counts the last page's tokens as seq_len % page_size, so a page-aligned sequence drops its last page."""
    args = list(args)
    page, lens = canonical_cache(args[1]).shape[1], args[7]
    args[7] = torch.where(lens % page == 0, lens - page, lens)
    return cpu_peer_decode(*args, **kwargs)


def batch_entries_swapped(*args: Any, out: torch.Tensor | None = None, return_lse: bool = False,
                          **kwargs: Any) -> Any:
    """Writes batch entry 0's result to entry 1 and entry 1's to entry 0."""
    result, lse = cpu_peer_decode(*args, return_lse=True, **kwargs)
    order = torch.arange(result.shape[0])
    order[:2] = order[:2].flip(0)
    result, lse = result[order], lse.view(result.shape[0], -1)[order].view(lse.shape)
    if out is not None:
        out.copy_(result)
        result = out
    return (result, lse) if return_lse else result


next_page_read.mla_verify_envelope = {**_SMALL, "heads": [1, 2], "max_seq_len": 96}
page_stride_ignored.mla_verify_envelope = {**_SMALL, "heads": [1, 2], "max_seq_len": 96, "page_strided": True}
aligned_last_page_dropped.mla_verify_envelope = {**_SMALL, "heads": [1, 2], "max_seq_len": 96}
batch_entries_swapped.mla_verify_envelope = {**_SMALL, "heads": [1, 2], "max_seq_len": 96}


# Kernels that say where they are fragile: S-token splits, and an unguarded empty split. The CPU peer, except
# that a query token that sees nothing of its sequence's last split (seq_len = k*S + j with j < the token's
# index + 1) gets that split's exp(-inf - -inf) = NaN. last_split_nan: S = 256; within its envelope (q_len 1-2,
# sequences up to 300) that is seq_len 257 with q_len 2, and nothing else. odd_split_nan: S = 384, a size no
# premerge corner case assumes (envelope.py's common split sizes are powers of two): seq_len 385 or 769 with
# q_len 2, which premerge holds only because the kernel declares the size.
FRAGILE_SPLIT = 256
ODD_SPLIT = 384


def _nan_past_the_last_split(split: int) -> Callable[..., Any]:
    def last_split_nan(query: torch.Tensor, kv_cache: torch.Tensor, workspace: Any, nope: int, rank: int,
                       rope: int, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                       out: torch.Tensor | None = None, bmm1_scale: float = 1.0, bmm2_scale: float = 1.0,
                       return_lse: bool = False, **kwargs: Any) -> Any:
        """``split``-token splits; a query token with nothing to see in the last split gets NaN."""
        result, lse = cpu_peer_decode(query, kv_cache, workspace, nope, rank, rope, block_tables, seq_lens,
                                      max_seq_len, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale, return_lse=True,
                                      tokens_per_split=split)
        B, Q = query.shape[:2]
        lens = seq_lens.long()
        last_visible = lens[:, None] - Q + torch.arange(Q, device=query.device)  # [B, Q]
        empty = last_visible < ((lens - 1) // split * split)[:, None]
        result = result.masked_fill(empty[:, :, None, None], float("nan"))
        lse = lse.view(B, Q, -1).masked_fill(empty[:, :, None], float("nan")).view(B * Q, -1)
        if out is not None:
            out.copy_(result)
            result = out
        return (result, lse) if return_lse else result

    return last_split_nan


last_split_nan = _nan_past_the_last_split(FRAGILE_SPLIT)
last_split_nan.mla_verify_envelope = {**_SMALL, "heads": [1, 2], "max_seq_len": 300, "split_sizes": [FRAGILE_SPLIT]}
odd_split_nan = _nan_past_the_last_split(ODD_SPLIT)
odd_split_nan.mla_verify_envelope = {**_SMALL, "heads": [1, 2], "max_seq_len": 800, "split_sizes": [ODD_SPLIT]}
odd_split_undeclared = _nan_past_the_last_split(ODD_SPLIT)  # the same kernel, saying nothing of its splits
odd_split_undeclared.mla_verify_envelope = {**_SMALL, "heads": [1, 2], "max_seq_len": 800}
