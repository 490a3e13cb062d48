"""Test-only forms of MLA decode that share no code with the reference: the definitions, written out slowly.

- ``naive_decode``: float64, one (sequence, query token, head, KV position) at a time, following the block
  table token by token (from the first position of a sliding window, if the problem has one).
- ``sdpa_decode``: torch's scaled_dot_product_attention per sequence with an explicit bottom-right causal mask
  (banded by the sliding window, if any).
Tiny problems only (a few heads, a few hundred tokens). ``naive_errors`` measures a ReferenceResult against
``naive_decode``; ``F64_TOL`` bounds a float64 result against a float64 form.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mla_verify.problems.problem import DecodeProblem
from mla_verify.problems.reference import ReferenceResult

F64 = torch.float64
# Both sides are float64 and differ only in summation order: agreement is ~1e-15. Any real mistake (scale,
# mask, page, length) moves results by >1e-3, so 1e-10 keeps five orders of magnitude on both sides.
F64_TOL = 1e-10


def row_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """The worst relative L2 error over output rows (one row per batch, query token and head)."""
    got, want = got.double(), want.double()
    return float(((got - want).norm(dim=-1) / want.norm(dim=-1)).max())


def naive_decode(p: DecodeProblem) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out [B, q_len, H, L], lse base e [B, q_len, H], lse base 2 [B, q_len, H]) in float64."""
    L = p.dims.kv_lora_rank
    q, cache = p.query.to(F64), p.kv_cache.to(F64)
    table, lens = p.block_table.tolist(), p.seq_lens.tolist()
    out = torch.empty(p.batch, p.q_len, p.num_heads, L, dtype=F64)
    lse_e = torch.empty(p.batch, p.q_len, p.num_heads, dtype=F64)
    lse_2 = torch.empty_like(lse_e)
    for b in range(p.batch):
        for i in range(p.q_len):
            position = lens[b] - p.q_len + i  # this query token's own KV position; it sees 0..position,
            first = 0 if p.window_left is None else max(0, position - p.window_left)  # or its window of it
            rows = [cache[table[b][t // p.page_size], t % p.page_size] for t in range(first, position + 1)]
            for h in range(p.num_heads):
                scores = [p.bmm1_scale * float(torch.dot(q[b, i, h], row)) for row in rows]
                top = max(scores)
                weights = [math.exp(s - top) for s in scores]
                total = math.fsum(weights)
                acc = torch.zeros(L, dtype=F64)
                for w, row in zip(weights, rows):
                    acc += w * row[:L]
                out[b, i, h] = p.bmm2_scale * acc / total
                lse_e[b, i, h] = top + math.log(total)
                lse_2[b, i, h] = top / math.log(2) + math.log2(total)
    return out, lse_e, lse_2


def naive_errors(result: ReferenceResult, p: DecodeProblem) -> tuple[float, float, float]:
    """(output row error, |lse - naive| base e, |lse_base2 - naive| base 2); NaN when either side is NaN."""
    out, lse_e, lse_2 = naive_decode(p)
    return (row_rel_err(result.out, out), float((result.lse - lse_e).abs().max()),
            float((result.lse_base2 - lse_2).abs().max()))


def sdpa_decode(p: DecodeProblem) -> torch.Tensor:
    """Per sequence: gather its keys through the block table, run SDPA with a bottom-right causal mask."""
    L = p.dims.kv_lora_rank
    outs = []
    for b, n in enumerate(p.seq_lens.tolist()):
        positions = torch.arange(n)
        pages = p.block_table[b].long()[positions // p.page_size]
        keys = p.kv_cache[pages, positions % p.page_size].to(F64)  # [n, L + rope]
        query = p.query[b].to(F64).transpose(0, 1)  # [H, q_len, L + rope]
        # query token i sits at position n - q_len + i and sees every key up to it: bottom-right aligned
        mask = torch.ones(p.q_len, n, dtype=torch.bool).tril(diagonal=n - p.q_len)
        if p.window_left is not None:  # and no key more than window_left positions before it
            mask = mask.triu(diagonal=n - p.q_len - p.window_left)
        k = keys.expand(p.num_heads, n, -1)
        o = F.scaled_dot_product_attention(query, k, k[..., :L], attn_mask=mask, scale=p.bmm1_scale)
        outs.append(o.transpose(0, 1) * p.bmm2_scale)
    return torch.stack(outs)
