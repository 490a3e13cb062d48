"""The reference: absorbed MLA decode over the paged latent cache, in high precision.

Sequences are sorted by length and processed in groups, each gathered to its own longest length, so
padding is small and peak memory is bounded by ``chunk_bytes`` (by default twice the cache bytes the problem
reads, not B x max_seq_len). Each group is exact attention -- one softmax over the whole row, no split-KV
merging -- so the reference stays simple.

Precision: float64 by default (what the harness uses on CPUs). ``precision=torch.float32`` (TF32 forced off):
products of bf16/fp8 inputs are exact and the accumulation error stays below ~4e-6 relative up to T = 16k
(tests/test_reference.py). ``matmul="bf16-split"`` (what the harness uses on GPUs) runs the products on tensor
cores: measured on an H200 against float64, 2e-6 to 8e-6 relative, at most 1.2e-4 at T = 131072 -- still
more than an order of magnitude under any bf16 kernel's error (~2e-3, docs/gpu_results.md).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from .problem import DecodeProblem

LN2 = math.log(2.0)
DEFAULT_CHUNK_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}  # caps; the default is 2x the cache bytes read
MATMUL_MODES = ("exact", "bf16-split")
EXACT_IN_BF16 = (torch.bfloat16, torch.float8_e4m3fn)


@dataclass
class ReferenceResult:
    out: torch.Tensor  # [B, q_len, H, kv_lora_rank] in the reference precision
    lse: torch.Tensor  # [B, q_len, H] natural-log log-sum-exp of the scaled scores

    @property
    def lse_base2(self) -> torch.Tensor:
        return self.lse / LN2


def reference_decode(problem: DecodeProblem, precision: torch.dtype = torch.float64,
                     chunk_bytes: int | None = None, p_dtype: torch.dtype | None = None,
                     matmul: str = "exact") -> ReferenceResult:
    """Exact attention of every query token over its causal prefix of the paged cache.

    ``matmul="exact"`` converts the operands to ``precision`` (float64 by default). ``matmul="bf16-split"``
    (bf16 / fp8 inputs only; float32 results) keeps the operands in bf16 -- fp8 and bf16 values are exact
    there -- and accumulates in fp32, so the scores are the exact products summed in fp32; the probabilities
    are split into two bf16 terms (hi + lo, relative error 2^-17 ~ 8e-6) for the second product. Tensor cores
    then do the work: the fast mode used on GPUs, ~200x more precise than any bf16 kernel (~2e-3).

    ``p_dtype`` (bf16 / fp8) instead emulates a careful low-precision kernel -- the probabilities
    exp(s - rowmax) rounded to ``p_dtype`` before the second product, as flash-style kernels feed their
    tensor cores -- for the tolerance model's same-precision baseline.
    """
    p = problem
    if matmul not in MATMUL_MODES:
        raise ValueError(f"matmul must be one of {MATMUL_MODES}, got {matmul!r}")
    split = matmul == "bf16-split"
    if split and (p.query.dtype not in EXACT_IN_BF16 or p.kv_cache.dtype not in EXACT_IN_BF16):
        raise ValueError("matmul='bf16-split' needs bf16 or fp8 query and cache (exact in bf16)")
    precision = torch.float32 if split else precision
    L = p.dims.kv_lora_rank
    B, Q, H, D = p.query.shape
    page = p.page_size
    itemsize = torch.empty((), dtype=precision).element_size()
    in_itemsize = p.kv_cache.element_size()
    if chunk_bytes is None:
        chunk_bytes = _default_chunk_bytes(p)
    # per gathered token: the gathered row, its converted copy (exact mode), and scores, probabilities and
    # their temporaries for every (query token, head)
    bytes_per_token = D * in_itemsize + (0 if split else D * itemsize) + 4 * Q * H * itemsize
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
            o, s = _group(p, idx, tokens // page, precision, p_dtype, split)
            out[idx], lse[idx] = o, s
            start += count
    return ReferenceResult(out, lse)


def fast_matmul_mode(problem: DecodeProblem) -> str:
    """The quickest mode that stays exact in its products for this problem's dtypes."""
    exact = problem.query.dtype in EXACT_IN_BF16 and problem.kv_cache.dtype in EXACT_IN_BF16
    return "bf16-split" if exact else "exact"


def _default_chunk_bytes(p: DecodeProblem) -> int:
    """Work memory per chunk: twice the cache bytes the problem reads, within [64 MiB, cap]."""
    cache_bytes = int(p.seq_lens.sum()) * p.kv_cache.shape[-1] * p.kv_cache.element_size()
    cap = DEFAULT_CHUNK_BYTES["cuda" if p.device.type == "cuda" else "cpu"]
    return max(64 << 20, min(cap, 2 * cache_bytes))


def _bmm(a: torch.Tensor, b: torch.Tensor, split: bool) -> torch.Tensor:
    """a @ b; in split mode bf16 operands with fp32 accumulation and an fp32 result."""
    if not split:
        return torch.bmm(a, b)
    if a.is_cuda:
        try:
            return torch.bmm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):  # an older PyTorch: same numbers, slower
            pass
    return torch.bmm(a.float(), b.float())


def _group(p: DecodeProblem, idx: torch.Tensor, npages: int, precision: torch.dtype,
           p_dtype: torch.dtype | None, split: bool):
    """Attention for the sequences ``idx``, all gathered to ``npages`` pages."""
    L = p.dims.kv_lora_rank
    Q, H, page = p.q_len, p.num_heads, p.page_size
    lens = p.seq_lens[idx].long()
    b = idx.numel()
    T = npages * page
    operand = torch.bfloat16 if split else precision
    pos = torch.arange(T, device=p.device)
    kv = _gather_rows(p, idx, lens, npages).to(operand)
    q = p.query[idx].reshape(b, Q * H, -1).to(operand)
    scores = _bmm(q, kv.transpose(1, 2), split).mul_(p.bmm1_scale).view(b, Q, H, T)
    last_visible = lens[:, None] - Q + torch.arange(Q, device=p.device)[None, :]  # [b, Q]: causal limit
    hidden = pos[None, None, :] > last_visible[:, :, None]
    scores.masked_fill_(hidden[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    values = kv[..., :L]
    if p_dtype is None:
        probs = torch.softmax(scores, dim=-1).view(b, Q * H, T)
        if split:  # probs = hi + lo in bf16 to 2^-17, both halves in one product
            both = torch.empty((b, 2 * Q * H, T), dtype=torch.bfloat16, device=p.device)
            both[:, :Q * H] = probs
            both[:, Q * H:] = probs.sub_(both[:, :Q * H])
            halves = _bmm(both, values, split)
            out = halves[:, :Q * H] + halves[:, Q * H:]
        else:
            out = torch.bmm(probs, values)
    else:
        unnormalized = torch.exp(scores - scores.amax(-1, keepdim=True))
        denominator = unnormalized.sum(-1).view(b, Q * H, 1)
        rounded = unnormalized.to(p_dtype).to(operand).view(b, Q * H, T)
        out = _bmm(rounded, values, split) / denominator
    return out.mul_(p.bmm2_scale).view(b, Q, H, L), lse


def _gather_rows(p: DecodeProblem, idx: torch.Tensor, lens: torch.Tensor, npages: int) -> torch.Tensor:
    """[b, npages * page, D] cache rows of the sequences ``idx``, in order. Positions past a sequence's end
    read that sequence's first row instead: finite, and masked out of the scores, so a NaN-poisoned tail can
    neither leak (0 * NaN) nor be followed through a padding entry of the block table."""
    page = p.page_size
    T = npages * page
    pos = torch.arange(T, device=p.device)
    pages = p.block_table[idx, :npages].long().gather(1, (pos // page).expand(idx.numel(), T))
    rows = pages * page + pos % page
    first = p.block_table[idx, :1].long() * page
    rows = torch.where(pos[None, :] < lens[:, None], rows, first)
    return p.kv_cache.flatten(0, 1)[rows.reshape(-1)].view(idx.numel(), T, -1)


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
