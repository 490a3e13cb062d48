"""The reference: absorbed MLA decode over the paged latent cache, in high precision.

Sequences are sorted by length and processed in groups, each gathered to its own longest length, so
padding is small and peak memory is bounded by ``chunk_bytes`` (not by B x max_seq_len). Each group is
exact attention -- one softmax over the whole row, no split-KV merging -- so the reference stays simple.

Precision: float64 by default. ``precision=torch.float32`` (TF32 forced off) is allowed for speed on GPUs;
products of bf16/fp8 inputs are then exact and the softmax/accumulation error is ~sqrt(T) * 2^-24 relative,
below 1e-5 for T <= 64k tokens: two orders of magnitude under any bf16 kernel's error (~2e-3).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from .problem import DecodeProblem

LN2 = math.log(2.0)
DEFAULT_CHUNK_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}


@dataclass
class ReferenceResult:
    out: torch.Tensor  # [B, q_len, H, kv_lora_rank] in the reference precision
    lse: torch.Tensor  # [B, q_len, H] natural-log log-sum-exp of the scaled scores

    @property
    def lse_base2(self) -> torch.Tensor:
        return self.lse / LN2


def reference_decode(problem: DecodeProblem, precision: torch.dtype = torch.float64,
                     chunk_bytes: int | None = None, p_dtype: torch.dtype | None = None) -> ReferenceResult:
    """Exact attention of every query token over its causal prefix of the paged cache.

    ``p_dtype`` (bf16 / fp8) instead emulates a careful low-precision kernel -- the probabilities
    exp(s - rowmax) rounded to ``p_dtype`` before the second product, as flash-style kernels feed their
    tensor cores -- for the tolerance model's same-precision baseline.
    """
    p = problem
    L = p.dims.kv_lora_rank
    B, Q, H, D = p.query.shape
    page = p.page_size
    itemsize = torch.empty((), dtype=precision).element_size()
    if chunk_bytes is None:
        chunk_bytes = DEFAULT_CHUNK_BYTES["cuda" if p.device.type == "cuda" else "cpu"]
    # per gathered token: the cache row, plus scores and probabilities for every (query token, head)
    bytes_per_token = itemsize * (D + 2 * Q * H)
    out = torch.empty((B, Q, H, L), dtype=precision, device=p.device)
    lse = torch.empty((B, Q, H), dtype=precision, device=p.device)
    lens = p.seq_lens.tolist()
    order = sorted(range(B), key=lambda i: -lens[i])
    start = 0
    with _no_tf32():
        while start < B:
            tokens = -(-lens[order[start]] // page) * page  # the group's longest length, whole pages
            count = max(1, min(B - start, chunk_bytes // (tokens * bytes_per_token)))
            idx = torch.tensor(order[start:start + count], device=p.device)
            o, s = _group(p, idx, tokens // page, precision, p_dtype)
            out[idx], lse[idx] = o, s
            start += count
    return ReferenceResult(out, lse)


def _group(p: DecodeProblem, idx: torch.Tensor, npages: int, precision: torch.dtype,
           p_dtype: torch.dtype | None):
    """Attention for the sequences ``idx``, all gathered to ``npages`` pages."""
    L = p.dims.kv_lora_rank
    Q, H, page = p.q_len, p.num_heads, p.page_size
    lens = p.seq_lens[idx].long()
    b = idx.numel()
    T = npages * page
    cols = torch.arange(npages, device=p.device)
    table = p.block_table[idx, :npages].long()
    table = torch.where(cols[None, :] < ((lens + page - 1) // page)[:, None], table, 0)  # never follow padding
    pos = torch.arange(T, device=p.device)
    kv = p.kv_cache[table].reshape(b, T, -1)
    kv = _zero_rows(kv, pos[None, :] >= lens[:, None]).to(precision)  # NaN-poisoned tails must not leak
    q = p.query[idx].to(precision).reshape(b, Q * H, -1)
    scores = torch.bmm(q, kv.transpose(1, 2)).mul_(p.bmm1_scale).view(b, Q, H, T)
    last_visible = lens[:, None] - Q + torch.arange(Q, device=p.device)[None, :]  # [b, Q]: causal limit
    hidden = pos[None, None, :] > last_visible[:, :, None]
    scores.masked_fill_(hidden[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if p_dtype is None:
        probs = torch.exp(scores - lse[..., None]).view(b, Q * H, T)
        out = torch.bmm(probs, kv[..., :L])
    else:
        unnormalized = torch.exp(scores - scores.amax(-1, keepdim=True))
        denominator = unnormalized.sum(-1).view(b, Q * H, 1)
        rounded = unnormalized.to(p_dtype).to(precision).view(b, Q * H, T)
        out = torch.bmm(rounded, kv[..., :L]) / denominator
    return out.mul_(p.bmm2_scale).view(b, Q, H, L), lse


def _zero_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x with rows[...] set to +0.0, done on the raw bits (all-zero bits are +0.0 in every float format;
    fp8 has no masked_fill)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
    return x.view(ints).masked_fill(rows[..., None], 0).view(x.dtype)


@contextlib.contextmanager
def _no_tf32():
    """TF32 would cut fp32 products to a 10-bit mantissa: never in the reference."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def unabsorbed_decode(problem: DecodeProblem, q_nope: torch.Tensor, w_uk: torch.Tensor,
                      w_uv: torch.Tensor) -> torch.Tensor:
    """Independent cross-check: ordinary MHA with the latent expanded per head, in float64.

    q_nope [B, q_len, H, qk_nope] is the query before absorption (problem.query's latent part must equal
    q_nope @ w_uk); w_uk [H, qk_nope, L]; w_uv [H, L, v_head_dim]. Expands k_nope = kv_c @ w_uk^T and
    v = kv_c @ w_uv for each sequence, with one Python loop over sequences and tokens laid out densely,
    and returns [B, q_len, H, v_head_dim].
    """
    p = problem
    L = p.dims.kv_lora_rank
    outs = []
    for b in range(p.batch):
        n = int(p.seq_lens[b])
        rows = _sequence_rows(p, b).double()  # [n, L + rope]
        kv_c, k_pe = rows[:, :L], rows[:, L:]
        k_nope = torch.einsum("tl,hdl->htd", kv_c, w_uk.double())  # [H, n, nope]
        v = torch.einsum("tl,hlv->htv", kv_c, w_uv.double())  # [H, n, v]
        qn = q_nope[b].double().transpose(0, 1)  # [H, Q, nope]
        qp = p.query[b, :, :, L:].double().transpose(0, 1)  # [H, Q, rope]
        s = (qn @ k_nope.transpose(1, 2) + qp @ k_pe.T[None]) * p.bmm1_scale  # [H, Q, n]
        limit = n - p.q_len + torch.arange(p.q_len, device=p.device)
        s = s.masked_fill(torch.arange(n, device=p.device)[None, None, :] > limit[None, :, None], float("-inf"))
        outs.append((torch.softmax(s, -1) @ v).transpose(0, 1) * p.bmm2_scale)  # [Q, H, v]
    return torch.stack(outs)


def _sequence_rows(p: DecodeProblem, b: int) -> torch.Tensor:
    """The seq_lens[b] cache rows of sequence b, in order."""
    n = int(p.seq_lens[b])
    pages = p.block_table[b, : -(-n // p.page_size)].long()
    return p.kv_cache[pages].reshape(-1, p.kv_cache.shape[-1])[:n]
