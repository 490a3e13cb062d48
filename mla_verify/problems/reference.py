"""The reference: absorbed MLA decode over the paged latent cache, in high precision.

Sequences are sorted by length and processed in groups, each gathered to its own longest length, so
padding is small (on GPUs a group keeps to 70% of its longest once it holds 384 MiB of work) and work memory
is bounded by ``chunk_bytes`` (by default twice the cache bytes the problem reads, not B x max_seq_len) and the
whole problem's row index and causal mask (8 + q_len bytes per sequence and position up to the longest, against
1152 bytes per cached bf16 row).
Each group is exact attention -- one softmax over the whole row, no split-KV merging -- so the reference
stays simple. The lengths are the only values read back to the host, once. What does not depend on the group
(the row index, the causal mask, the halves' sum) is made once for the whole problem, so a group issues nine
operations: on a GPU each costs host time, and how fast the host issues them sets much of the call's time
(docs/reference.md, "Its cost").

Precision: float64 by default (what the harness uses on CPUs). ``precision=torch.float32`` (TF32 forced off):
products of bf16/fp8 inputs are exact and the accumulation error stays below ~4e-6 relative up to T = 16k
(tests/test_reference.py). ``matmul="bf16-split"`` (what the harness uses on GPUs) runs the products on tensor
cores, still more than an order of magnitude under any bf16 kernel's error (docs/reference.md, "Precision").
"""
from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from ..core.errors import UsageError
from .problem import DecodeProblem

LN2 = math.log(2.0)
DEFAULT_CHUNK_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}  # caps on the default work memory per group:
CHUNK_OVER_CACHE = 2  # times the cache bytes the problem reads: keeps the peak within the ~4x goal (docs/reference.md)
MATMUL_MODES = ("exact", "bf16-split")
EXACT_IN_BF16 = (torch.bfloat16, torch.float8_e4m3fn)
# A group ends where the next sequence (in whole pages) is shorter than this fraction of the group's longest,
# so padding stays under 30% of a group's rows (~15% for evenly spread lengths; grouping by memory alone pads
# far more) -- unless the group still holds under MIN_GROUP_BYTES of work memory: on a GPU a group costs nine
# launches of host time, so padding a small group is cheaper than issuing another one. For the same reason a
# group takes every sequence left when they fit in its chunk and would hold under the floor as a group of
# their own; without the "fit" condition the chunk would cut such a group short: padding, and no group saved.
# (On CPUs the chunk cap, 256 MiB, is below the floor: groups there are bounded by memory alone.)
GROUP_LENGTH_RATIO = 0.7
MIN_GROUP_BYTES = 384 << 20


@dataclass
class ReferenceResult:
    out: torch.Tensor  # [B, q_len, H, kv_lora_rank] in the reference precision
    lse: torch.Tensor  # [B, q_len, H] natural-log log-sum-exp of the scaled scores
    valid: torch.Tensor | None = None  # [B, q_len] bool: the rows that are query tokens (None: all; ragged q_lens)

    @property
    def lse_base2(self) -> torch.Tensor:
        return self.lse / LN2


class GroupAttention(Protocol):
    """Attention of one group of requests in another arithmetic (judge/emulation.py): given the group's
    ``requests`` (their indices in the problem), ``q`` [b, Q*H, D] and ``kv`` [b, T, D] in the operand dtype and
    ``hidden`` (as ``_attend`` gets them), it writes ``into`` what ``_attend`` writes there: out (bmm2 applied),
    each row's top score (bmm1 applied), its share of the row's sum (exp(top - lse)), and where it is."""

    def __call__(self, p: DecodeProblem, requests: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                 hidden: torch.Tensor, into: tuple[torch.Tensor, ...]) -> None: ...


def reference_decode(problem: DecodeProblem, precision: torch.dtype = torch.float64,
                     chunk_bytes: int | None = None, p_dtype: torch.dtype | None = None,
                     matmul: str = "exact", attend: GroupAttention | None = None) -> ReferenceResult:
    """Exact attention of every query token over its causal prefix of the paged cache (the part of it within
    the problem's sliding window, if it has one).

    ``matmul="exact"`` converts the operands to ``precision`` (float64 by default). ``matmul="bf16-split"``
    (bf16 / fp8 inputs only; float32 results) keeps the operands in bf16 -- fp8 and bf16 values are exact
    there -- and accumulates in fp32, so the scores are the exact products summed in fp32; the probabilities
    are split into two bf16 terms (hi + lo, relative error 2^-17 ~ 8e-6) for the second product. Tensor cores
    then do the work: the fast mode used on GPUs, more than an order of magnitude more precise than a bf16
    kernel even at T = 131072 (docs/reference.md, "Precision").

    ``p_dtype`` (bf16 / fp8) instead emulates a careful low-precision kernel -- the probabilities
    exp(s - rowmax) rounded to ``p_dtype`` before the second product, as flash-style kernels feed their
    tensor cores -- for the tolerance model's same-precision baseline. ``attend`` computes each group in a
    kernel's declared arithmetic instead (GroupAttention), for the baseline of a kernel that declares one.
    """
    p = problem
    if matmul not in MATMUL_MODES:
        raise ValueError(f"matmul must be one of {MATMUL_MODES}, got {matmul!r}")
    split = matmul == "bf16-split"
    if split and (p.query.dtype not in EXACT_IN_BF16 or p.kv_cache.dtype not in EXACT_IN_BF16):
        raise ValueError("matmul='bf16-split' needs bf16 or fp8 query and cache (exact in bf16)")
    precision = torch.float32 if split else precision
    operand = torch.bfloat16 if split else precision
    if precision == torch.float32 and not split and p.device.type == "cuda" and \
            os.environ.get("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE") == "1":
        raise UsageError("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 forces TF32 into float32 products, which the "
                         "float32 reference cannot allow: unset it")
    L = p.dims.kv_lora_rank
    B, Q, H, D = p.query.shape
    page = p.page_size
    itemsize = precision.itemsize
    # the problem in length order; the only host read: the sorted lengths decide the groups. Everything after
    # is queued without waiting on the GPU.
    seq_lens, longest_first = torch.sort(p.seq_lens, descending=True, stable=True)
    lens = seq_lens.tolist()
    if lens[-1] == 0:
        return _with_empty_requests(p, precision, chunk_bytes, p_dtype, matmul, attend)
    if chunk_bytes is None:
        chunk_bytes = _default_chunk_bytes(p, sum(lens))
    # per gathered token: the gathered row, its converted copy (fp8 to bf16, or to ``precision``), and
    # scores, probabilities and their temporaries for every (query token, head)
    converted = 0 if p.kv_cache.dtype == operand else D * operand.itemsize
    bytes_per_token = D * p.kv_cache.element_size() + converted + 4 * Q * H * itemsize
    # Everything that does not depend on the group is made here, once, for the whole problem in length order:
    # on a GPU every operation costs host time (docs/reference.md), so a group issues only its own
    # nine (gather, two products, mask, max, softmax, the top's share, the two bf16 halves)
    longest = _whole_pages(lens[0], page)  # at least one page: lens >= 1
    positions = torch.arange(longest, device=p.device)
    # [B, Q, 1, longest]: the positions query token i must not see (it sees seq_len - Q + i and before); for one
    # query token, seq_len and after, two launches fewer. Ragged: request b's token i sees seq_len - q_lens[b] + i
    # and before; its padding rows (i >= q_lens[b]) see the whole sequence, finite values no one judges
    if p.q_lens is not None:
        first_hidden_at = torch.minimum(seq_lens[:, None] - p.request_q_lens()[longest_first, None] + 1
                                        + torch.arange(Q, device=p.device), seq_lens[:, None])
    else:
        first_hidden_at = seq_lens[:, None] + torch.arange(1 - Q, 1, device=p.device) if Q > 1 else seq_lens[:, None]
    hidden = positions >= first_hidden_at[:, :, None, None]
    past_end = hidden[:, -1, 0]
    if p.window_left is not None:  # a sliding window also hides what lies before each token's window
        hidden = hidden | (positions < first_hidden_at[:, :, None, None] - (p.window_left + 1))
    rows = _cache_rows(p.block_table[longest_first, :longest // page], past_end, positions[:page], page)
    queries = p.query[longest_first].reshape(B, Q * H, D).to(operand)
    cache_rows = p.kv_cache.flatten(0, 1)  # a copy only for a pool whose pages cannot merge: once, here
    # what each group writes: out (in split mode its two halves' products, summed once at the end), each row's
    # top score, where it is and its share of the sum (exp(0) / sum); the sum and the lse are then made for all
    # groups at once
    halves = split and p_dtype is None and attend is None
    out = torch.empty((B, 2 * Q * H if halves else Q * H, L), dtype=precision, device=p.device)
    top = torch.empty((B, Q * H, 1), dtype=precision, device=p.device)
    top_share = torch.empty_like(top)
    top_at = torch.empty(top.shape, dtype=torch.long, device=p.device)
    with _no_tf32():
        for start, stop, tokens in _groups(lens, page, bytes_per_token, chunk_bytes):
            group = slice(start, stop)
            # embedding = index_select on the slice made contiguous: indexing by the strided slice itself runs
            # a generic indexing kernel, much slower on GPUs. torch.embedding, not F.embedding: the wrapper only
            # checks arguments the reference never passes, and costs host time on every group
            kv = torch.embedding(cache_rows, rows[group, :tokens])
            # positions before the group's shortest sequence's first causal limit are visible to every token
            # (>= 1: validation keeps seq_len >= q_len; a ragged request's limit is later, as q_lens <= q_len)
            # -- unless a sliding window hides the earliest ones
            first_hidden = lens[stop - 1] - Q + 1 if p.window_left is None else 0
            into = (out[group], top[group], top_share[group], top_at[group])
            if attend is None:
                _attend(p, queries[group], kv.to(operand), hidden[group, ..., first_hidden:tokens], p_dtype, split,
                        into)
            else:
                attend(p, longest_first[group], queries[group], kv.to(operand), hidden[group, ..., first_hidden:tokens],
                       into)
    lse = top.sub_(top_share.log_())
    if halves:
        out = out[:, :Q * H].add_(out[:, Q * H:])

    def unsorted(x: torch.Tensor) -> torch.Tensor:  # x may be a view of the halves' buffer: a new, dense tensor
        return torch.empty(x.shape, dtype=x.dtype, device=x.device).index_copy_(0, longest_first, x)
    return ReferenceResult(unsorted(out).view(B, Q, H, L), unsorted(lse).view(B, Q, H), p.valid_rows())


def _with_empty_requests(p: DecodeProblem, precision: torch.dtype, chunk_bytes: int | None,
                         p_dtype: torch.dtype | None, matmul: str, attend: GroupAttention | None) -> ReferenceResult:
    """The reference of a problem with requests of no key (seq_len 0): their query rows are out 0 and LSE -inf,
    the log of an empty sum; the other requests are computed as a problem of their own -- which ``attend`` is
    handed as the requests of ``p`` they are (a declared split schedule is the whole batch's)."""
    B, Q, H, _ = p.query.shape
    dtype = torch.float32 if matmul == "bf16-split" else precision
    out = torch.zeros((B, Q, H, p.dims.kv_lora_rank), dtype=dtype, device=p.device)
    lse = torch.full((B, Q, H), float("-inf"), dtype=dtype, device=p.device)
    keep = (p.seq_lens > 0).nonzero().squeeze(1)
    if keep.numel():
        kept = keep.tolist()
        sub = replace(p, query=p.query[keep], block_table=p.block_table[keep], seq_lens=p.seq_lens[keep],
                      q_lens=None if p.q_lens is None else tuple(p.q_lens[i] for i in kept))
        result = reference_decode(sub, precision, chunk_bytes, p_dtype, matmul,
                                  None if attend is None else _KeptRequests(attend, p, keep))
        out[keep], lse[keep] = result.out, result.lse
    return ReferenceResult(out, lse, p.valid_rows())


class _KeptRequests:
    """``attend`` on a problem of some of ``whole``'s requests (``kept``: their indices in it), handed the
    requests of ``whole`` they are."""

    def __init__(self, attend: GroupAttention, whole: DecodeProblem, kept: torch.Tensor):
        self.attend, self.whole, self.kept = attend, whole, kept

    def __call__(self, p: DecodeProblem, requests: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                 hidden: torch.Tensor, into: tuple[torch.Tensor, ...]) -> None:
        self.attend(self.whole, self.kept[requests], q, kv, hidden, into)


def _groups(lens: list[int], page: int, bytes_per_token: int, chunk_bytes: int):
    """(start, stop, tokens) per group of the longest-first ``lens``: ``tokens`` is the group's longest length
    in whole pages; a group fits ``chunk_bytes`` (at least one sequence) and keeps to GROUP_LENGTH_RATIO of
    its longest once it holds MIN_GROUP_BYTES, unless it can take all the sequences left and they would hold
    under MIN_GROUP_BYTES on their own."""
    padded = [_whole_pages(n, page) for n in lens]
    start = 0
    while start < len(lens):
        tokens = padded[start]
        fits = max(1, chunk_bytes // (tokens * bytes_per_token))
        stop = start + 1
        room = len(lens) - start <= fits  # this group could take every sequence left
        while stop < len(lens) and stop - start < fits and (
                padded[stop] >= GROUP_LENGTH_RATIO * tokens
                or (stop - start) * tokens * bytes_per_token < MIN_GROUP_BYTES
                or room and (len(lens) - stop) * padded[stop] * bytes_per_token < MIN_GROUP_BYTES):
            stop += 1
        yield start, stop, tokens
        start = stop


def _whole_pages(tokens: int, page: int) -> int:
    return -(-tokens // page) * page


def fast_matmul_mode(problem: DecodeProblem) -> str:
    """The quickest mode that stays exact in its products for this problem's dtypes."""
    exact = problem.query.dtype in EXACT_IN_BF16 and problem.kv_cache.dtype in EXACT_IN_BF16
    return "bf16-split" if exact else "exact"


def _default_chunk_bytes(p: DecodeProblem, tokens: int) -> int:
    """Work memory per chunk: CHUNK_OVER_CACHE times the cache bytes the problem reads, within [64 MiB, cap]."""
    cache_bytes = tokens * p.kv_cache.shape[-1] * p.kv_cache.element_size()
    cap = DEFAULT_CHUNK_BYTES["cuda" if p.device.type == "cuda" else "cpu"]
    return max(64 << 20, min(cap, CHUNK_OVER_CACHE * cache_bytes))


def _bmm(a: torch.Tensor, b: torch.Tensor, split: bool, alpha: float = 1.0,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """alpha * (a @ b), into ``out`` if given; in split mode bf16 operands with fp32 accumulation and an fp32
    result. On CUDA alpha rides in the product's epilogue instead of costing a pass over the scores."""
    if a.is_cuda:
        dtype = torch.float32 if split else a.dtype
        if out is None:
            out = torch.empty((a.shape[0], a.shape[1], b.shape[2]), dtype=dtype, device=a.device)
        try:  # beta=0 with out= its own input: the uninitialised buffer is neither read nor copied
            return torch.baddbmm(out, a, b, beta=0, alpha=alpha, out=out, **({"out_dtype": dtype} if split else {}))
        except (TypeError, NotImplementedError):  # a PyTorch without out_dtype: same numbers, slower
            pass
    if split:
        a, b = a.float(), b.float()
    # CPU: bmm then the scale (the chunking tests' results moved in the last bit with baddbmm, not with bmm)
    out = torch.bmm(a, b, out=out)
    return out if alpha == 1.0 else out.mul_(alpha)


def _attend(p: DecodeProblem, q: torch.Tensor, kv: torch.Tensor, hidden: torch.Tensor, p_dtype: torch.dtype | None,
            split: bool, into: tuple[torch.Tensor, ...]) -> None:
    """Exact attention of one group, q [b, Q*H, D] over kv [b, T, D], written ``into`` (out, bmm2_scale applied:
    [b, Q*H, L], or in split mode [b, 2*Q*H, L], the products of the probabilities' two bf16 halves; each row's
    top score; that score's probability; where the top score is) -- no copies, each result lands in place.

    ``hidden`` [b, Q, 1, tail]: which of the last ``tail`` positions each query token must not see (the
    positions before them are visible to all)."""
    out, top, top_share, at = into
    scores = mask_hidden(_bmm(q, kv.transpose(1, 2), split, alpha=p.bmm1_scale), hidden, p.q_len)
    torch.max(scores, -1, keepdim=True, out=(top, at))
    values = kv[..., :p.dims.kv_lora_rank]
    if p_dtype is None:
        probs = torch.softmax(scores, dim=-1)
        torch.gather(probs, -1, at, out=top_share)
        _probs_times_values(probs, values, split, p.bmm2_scale, out)
    else:
        unnormalized = scores.sub_(top).exp_()
        denominator = unnormalized.sum(-1, keepdim=True)
        torch.reciprocal(denominator, out=top_share)
        rounded = unnormalized.to(p_dtype).to(values.dtype)
        torch.div(_bmm(rounded, values, split, alpha=p.bmm2_scale), denominator, out=out)


def mask_hidden(scores: torch.Tensor, hidden: torch.Tensor, q_len: int) -> torch.Tensor:
    """``scores`` [b, Q*H, T] with -inf, in place, where ``hidden`` (GroupAttention's) says a query token must not
    see a key."""
    b, _, T = scores.shape
    scores.view(b, q_len, -1, T)[..., T - hidden.shape[-1]:].masked_fill_(hidden, float("-inf"))
    return scores


def _probs_times_values(probs: torch.Tensor, values: torch.Tensor, split: bool, scale: float,
                        out: torch.Tensor) -> None:
    """out = scale * probs @ values; in split mode probs = hi + lo in bf16 (to 2^-17), both halves in one
    product whose two halves ``out`` [b, 2 * rows, L] receives (the caller sums them)."""
    if not split:
        _bmm(probs, values, split, alpha=scale, out=out)
        return
    b, rows, T = probs.shape
    both = torch.empty((b, 2 * rows, T), dtype=torch.bfloat16, device=probs.device)
    hi, lo = both[:, :rows], both[:, rows:]
    hi.copy_(probs)
    torch.sub(probs, hi, out=lo)  # exact in fp32, rounded once to bf16
    _bmm(both, values, split, alpha=scale, out=out)


def _cache_rows(pages: torch.Tensor, past_end: torch.Tensor, in_page: torch.Tensor, page: int) -> torch.Tensor:
    """[b, T] rows of the flattened cache [pages * page, D], in order, for the sequences whose first T / page
    pages are ``pages`` [b, T / page] (``in_page``: 0 .. page - 1). Positions past a sequence's end (``past_end``
    [b, T]) read that sequence's first row instead: finite, and masked out of the scores, so a NaN-poisoned tail
    can neither leak (0 * NaN) nor be followed through a padding entry. (A page-at-a-time gather moves bytes
    faster but must then zero those rows: slower on all three benchmark cases, docs/reference.md.)"""
    rows = torch.add(in_page, pages[:, :, None], alpha=page).view(past_end.shape)
    return torch.where(past_end, rows[:, :1], rows)


@contextlib.contextmanager
def _no_tf32():
    """TF32 would cut fp32 products to a 10-bit mantissa: never in the reference. PyTorch >= 2.9 refuses to
    read the old ``allow_tf32`` flag once the new ``fp32_precision`` one was set, so the new one is used where
    it exists."""
    matmul = torch.backends.cuda.matmul
    name, strict = ("fp32_precision", "ieee") if hasattr(matmul, "fp32_precision") else ("allow_tf32", False)
    saved = getattr(matmul, name)
    setattr(matmul, name, strict)
    try:
        yield
    finally:
        setattr(matmul, name, saved)


def unabsorbed_decode(problem: DecodeProblem, q_nope: torch.Tensor, w_uk: torch.Tensor,
                      w_uv: torch.Tensor) -> torch.Tensor:
    """Independent cross-check: ordinary MHA with the latent expanded per head, in float64.

    q_nope [B, q_len, H, qk_nope] is the query before absorption (problem.query's latent part must equal
    q_nope @ w_uk); w_uk [H, qk_nope, L]; w_uv [H, L, v_head_dim]. Expands k_nope = kv_c @ w_uk^T and
    v = kv_c @ w_uv for each sequence, with one Python loop over sequences and tokens laid out densely,
    and returns [B, q_len, H, v_head_dim] (a ragged request's padding rows see its whole sequence).
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
        limit = (n - int(p.request_q_lens()[b]) + torch.arange(p.q_len, device=p.device)).clamp(max=n - 1)
        at = torch.arange(n, device=p.device)[None, None, :]
        hidden = at > limit[None, :, None]
        if p.window_left is not None:
            hidden |= at < limit[None, :, None] - p.window_left
        s = s.masked_fill(hidden, float("-inf"))
        outs.append((torch.softmax(s, -1) @ v).transpose(0, 1) * p.bmm2_scale)  # [Q, H, v]
    return torch.stack(outs)


def _sequence_rows(p: DecodeProblem, b: int) -> torch.Tensor:
    """The seq_lens[b] cache rows of sequence b, in order."""
    n = int(p.seq_lens[b])
    pages = p.block_table[b, : -(-n // p.page_size)].long()
    return p.kv_cache[pages].reshape(-1, p.kv_cache.shape[-1])[:n]
