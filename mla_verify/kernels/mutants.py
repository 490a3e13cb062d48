"""Deliberately faulty MLA decode kernels: each proves the suite catches one real bug class.

Every kernel here is the same small, correct CPU/PyTorch implementation of Contract 1 (the trtllm-style
callable, see docs/contracts.md) -- ``FaultyKernel`` -- with one field of ``Faults`` changed. The defaults of
``Faults`` are the correct behaviour, so each mutant is a one-line variation, not a copy:

    correct_kernel = FaultyKernel(Faults())
    MUTANTS["length_minus_1"] ... FaultyKernel(Faults(length=lambda n, page: n - 1))

The kernel computes like a flash-decoding kernel: fp32 scores over the paged cache, split-KV chunks of
``SPLIT_TOKENS`` tokens merged through their maxima, output rounded to bf16, LSE in base 2.

Each mutant is importable as ``mla_verify.kernels.mutants:<name>`` (``--kernel``), and usable with
``TrtllmStyleBackend(name, MUTANTS[name].fn)``.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..core.dims import R1_SOFTMAX_SCALE
from ..problems.generate import ProblemSpec
from ..problems.layouts import LayoutSpec, canonical_cache, padded_width

SPLIT_TOKENS = 128  # split-KV chunk length: sequences longer than this are merged across chunks


def _exact_length(seq_len: int, page: int) -> int:
    return seq_len


def _own_row(b: int, batch: int) -> int:
    return b


def _table_width(width: int, page: int) -> int:
    return width


@dataclass(frozen=True)
class Faults:
    """One field per place a real kernel goes wrong; every default is the correct behaviour."""

    softmax_scale: float | None = None  # a hard-coded scale used instead of the given bmm1_scale
    bmm2_power: int = 1  # how many times bmm2_scale multiplies the output (0: ignored, 2: doubled)
    rope_first: bool = False  # cache rows read as [rope | latent] instead of [latent | rope]
    length: Callable[[int, int], int] = _exact_length  # (seq_len, page) -> tokens the kernel attends to
    page_size: int | None = None  # a page size assumed instead of read from the cache shape
    page_dim: int = -2  # the cache dimension taken as the page size (1 is wrong for 4-D caches)
    table_row: Callable[[int, int], int] = _own_row  # (b, batch) -> the block-table row sequence b reads
    table_stride: Callable[[int, int], int] = _table_width  # (table width, page) -> assumed row stride
    sort_pages: bool = False  # pages visited in physical (ascending id) order, not block-table order
    causal: bool = True  # query token i sees positions <= seq_len - q_len + i
    mask_values: bool = True  # zero V rows outside the sequence (else NaN tails leak through p = 0)
    rescale_merge: bool = True  # split-KV partials rescaled by exp(chunk max - global max) when merged
    heads_reversed: bool = False  # head h's result written to head H-1-h
    lse_base2: bool = True  # LSE in base 2 (the contract) or natural log
    write_out: bool = True  # write into the given `out` (else return a fresh tensor)
    scratch_tail: bool = False  # zero the unused tail of each last page in place (an input write)
    skip_aligned: bool = False  # leave out rows unwritten when seq_len is a multiple of the page size
    noise: float = 0.0  # relative random noise on the fp32 accumulator (a nondeterministic kernel)


class FaultyKernel:
    """A Contract-1 callable: correct with ``Faults()``, otherwise wrong in exactly the given way."""

    def __init__(self, faults: Faults, name: str = "correct_kernel", description: str = "the correct kernel"):
        self.faults = faults
        self.__name__ = name
        self.__doc__ = description  # what `--kernel` shows as the backend's description

    def __repr__(self) -> str:
        return f"FaultyKernel({self.__name__})"

    def __call__(self, query: torch.Tensor, kv_cache: torch.Tensor, workspace_buffer: torch.Tensor | None,
                 qk_nope_head_dim: int, kv_lora_rank: int, qk_rope_head_dim: int, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_seq_len: int, out: torch.Tensor | None = None,
                 bmm1_scale: float = 1.0, bmm2_scale: float = 1.0, return_lse: bool = False,
                 **kwargs: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        f = self.faults
        B, Q, H, D = query.shape
        L, R = kv_lora_rank, qk_rope_head_dim
        page = f.page_size or kv_cache.shape[f.page_dim]
        cache = canonical_cache(kv_cache)
        rows = cache.reshape(-1, D)  # token rows; row id = page id * page + slot
        flat_table = block_tables.reshape(-1)
        stride = f.table_stride(block_tables.shape[1], page)
        scale = bmm1_scale if f.softmax_scale is None else f.softmax_scale
        target = out if (out is not None and f.write_out) else torch.empty(
            (B, Q, H, L), dtype=torch.bfloat16, device=query.device)
        lens = [f.length(int(n), page) for n in seq_lens.tolist()]
        starts = [f.table_row(b, B) * stride for b in range(B)]
        npages = [-(-n // page) for n in lens]
        res = torch.empty((B, Q, H, L), dtype=torch.float32, device=query.device)
        lse = torch.empty((B, Q, H), dtype=torch.float32, device=query.device)
        for count in sorted(set(npages)):  # sequences with equally many pages are computed together
            idx = [b for b in range(B) if npages[b] == count]
            if max(starts[b] for b in idx) + count > flat_table.numel():
                raise IndexError("a sequence reads block-table entries past the end of the table")
            pages = torch.stack([flat_table[starts[b]:starts[b] + count] for b in idx]).long()
            if f.sort_pages:
                pages = pages.sort(dim=1).values
            slots = (pages[..., None] * page + torch.arange(page, device=query.device)).reshape(len(idx), -1)
            kv = rows[slots].float()  # [b, T, D]; IndexError on a page id outside the pool
            if f.rope_first:
                kv = kv.roll(-R, dims=-1)  # what the kernel takes for [latent | rope]
            n = torch.tensor([lens[b] for b in idx], device=query.device)
            res[idx], lse[idx] = _attend(query[idx].float(), kv, n, scale, L, f)
        res *= bmm2_scale ** f.bmm2_power
        if f.noise:
            res *= 1 + f.noise * torch.randn_like(res)
        if f.heads_reversed:
            res, lse = res.flip(2), lse.flip(2)
        true_lens = seq_lens.tolist()
        written = [b for b in range(B) if not (f.skip_aligned and true_lens[b] % page == 0)]
        target[written] = res[written].to(torch.bfloat16)
        if f.scratch_tail:
            for b, n in enumerate(true_lens):
                if n % page:
                    cache[int(block_tables[b, n // page]), n % page:] = 0
        lse = lse if not f.lse_base2 else lse / math.log(2.0)
        return (target, lse.reshape(B * Q, H)) if return_lse else target


def _attend(q: torch.Tensor, kv: torch.Tensor, n: torch.Tensor, scale: float, L: int,
            f: Faults) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV attention of q [b, Q, H, D] over kv [b, T, D], the first n[i] rows valid in sequence i:
    (out [b, Q, H, L], natural-log lse [b, Q, H])."""
    b, Q, H, D = q.shape
    T = kv.shape[1]
    pos = torch.arange(T, device=q.device)
    outside = pos[None, :] >= n[:, None]  # [b, T]
    v = kv[..., :L].masked_fill(outside[..., None], 0.0) if f.mask_values else kv[..., :L]
    scores = torch.bmm(q.reshape(b, Q * H, D), kv.transpose(1, 2)).mul_(scale).view(b, Q, H, T)
    last = n[:, None] - Q + torch.arange(Q, device=q.device) if f.causal else (n - 1)[:, None].expand(b, Q)
    hidden = (pos[None, None, :] > last[..., None]) | outside[:, None, :]  # [b, Q, T]
    scores = scores.masked_fill(hidden[:, :, None, :], float("-inf")).view(b, Q * H, T)
    chunks = -(-T // SPLIT_TOKENS)
    pad = chunks * SPLIT_TOKENS - T
    scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf")).view(b, Q * H, chunks, SPLIT_TOKENS)
    v = torch.nn.functional.pad(v, (0, 0, 0, pad)).view(b, chunks, SPLIT_TOKENS, L)
    m = scores.amax(-1)  # [b, QH, chunks]; -inf for a fully masked chunk
    e = torch.exp(scores - torch.where(m == float("-inf"), 0.0, m)[..., None])
    part_l = e.sum(-1)
    part_o = torch.einsum("bxcj,bcjl->bxcl", e, v)
    top = m.amax(-1, keepdim=True)
    top = torch.where(top == float("-inf"), 0.0, top)
    w = torch.exp(m - top) if f.rescale_merge else torch.ones_like(m)
    total = (part_l * w).sum(-1)  # [b, QH]
    o = (part_o * w[..., None]).sum(2) / total[..., None]
    return o.view(b, Q, H, L), (top[..., 0] + torch.log(total)).view(b, Q, H)


@dataclass(frozen=True)
class Mutant:
    name: str
    description: str
    bug_class: str
    fn: FaultyKernel
    diagnosis: str | None  # the diagnose.py catalog entry expected to explain it, None if outside the catalog
    trigger: ProblemSpec  # a small problem that exposes the fault (and that diagnosis can explain)
    trigger_layout: LayoutSpec = LayoutSpec()


def _mutant(name: str, bug_class: str, description: str, diagnosis: str | None, trigger: ProblemSpec,
            trigger_layout: LayoutSpec = LayoutSpec(), **faults: Any) -> Mutant:
    return Mutant(name, description, bug_class, FaultyKernel(Faults(**faults), name, description), diagnosis, trigger,
                  trigger_layout)


correct_kernel = FaultyKernel(Faults())

# Trigger problems: two sequences with partial last pages (37 and 100 tokens in 32-token pages), 4 heads;
# variations add only what a fault needs to show (a non-default scale, q_len > 1, a long sequence, ...).
_BASE = ProblemSpec((37, 100), num_heads=4, page_size=32)
_MIXED = replace(_BASE, seq_lens=(37, 64), table_pad=1, pad_fill="garbage")  # one partial, one full last page

_ALL = [
    _mutant("scale_sqrt_576", "softmax scale", "ignores bmm1_scale and uses 1/sqrt(576) (the absorbed width)",
            "scale_1_sqrt_576", _BASE, softmax_scale=1 / math.sqrt(576)),
    _mutant("scale_fixed_192", "softmax scale", "ignores bmm1_scale and uses a fixed 1/sqrt(192): drops YaRN "
            "mscale and fp8 dequant scales", "scale_1_sqrt_192", replace(_BASE, softmax_scale=R1_SOFTMAX_SCALE),
            softmax_scale=1 / math.sqrt(192)),
    _mutant("bmm2_ignored", "output scale", "never multiplies the output by bmm2_scale", "bmm2_missing",
            replace(_BASE, bmm2_extra=0.5), bmm2_power=0),
    _mutant("bmm2_twice", "output scale", "multiplies the output by bmm2_scale twice", "bmm2_doubled",
            replace(_BASE, bmm2_extra=0.5), bmm2_power=2),
    _mutant("halves_swapped", "layout", "reads cache rows as [rope | latent] instead of [latent | rope]",
            "cache_rope_first", _BASE, rope_first=True),
    _mutant("partial_page_dropped", "length", "attends to whole pages only: the last partial page is dropped",
            "partial_page_dropped", _BASE, length=lambda n, page: n // page * page),
    _mutant("length_minus_1", "length", "attends to seq_len - 1 tokens", "length_minus_1", _BASE,
            length=lambda n, page: n - 1),
    # page-aligned lengths and a spare table column of real page ids: the extra token is finite, not NaN
    _mutant("length_plus_1", "length", "attends to seq_len + 1 tokens", "length_plus_1",
            replace(_BASE, seq_lens=(64, 96), table_pad=1, pad_fill="garbage"), length=lambda n, page: n + 1),
    # a page-aligned second sequence (read correctly) tells these apart from length_plus_1 (which reads on)
    _mutant("reads_to_page_end", "length", "attends past seq_len to the end of the last page", "full_page_read",
            _MIXED, length=lambda n, page: -(-n // page) * page),
    _mutant("nan_leak_unmasked_tail", "unused slots", "masks scores past seq_len but multiplies their p = 0 by "
            "the unmasked (NaN) cache tail", "full_page_read", _MIXED, mask_values=False),
    # seed 16 (found by search) gives both sequences a first page id below P/2 = 2, so the 64-token
    # "pages" the kernel reads lie inside the pool and hold real (finite) tokens
    _mutant("page_size_assumed_64", "page size", "assumes 64-token pages instead of reading the cache shape",
            "page_size_64", replace(_BASE, seq_lens=(64, 64), seed=16), page_size=64),
    _mutant("cache_4d_as_3d", "cache rank", "takes kv_cache.shape[1] as the page size (1 for a 4-D cache)",
            None, _BASE, LayoutSpec(cache_dims=4), page_dim=1),
    # a 3-column table that a 128/32 = 4-column stride misreads; page-aligned lengths and zero padding keep
    # every page read a real, full one (finite output)
    _mutant("table_stride_pad128", "block table", "assumes block-table rows are padded to a multiple of "
            "128/page columns", "table_stride_pad128", replace(_BASE, seq_lens=(96, 64), pad_fill="zero"),
            table_stride=padded_width),
    _mutant("table_rows_shifted", "block table", "sequence b reads block-table row b+1 (the last wraps to 0)",
            "table_row_next", replace(_BASE, seq_lens=(100, 100, 100)), table_row=lambda b, batch: (b + 1) % batch),
    # page-aligned lengths with q_len 4: only the causal mask makes page order visible, and values stay finite
    _mutant("pages_sorted", "page order", "visits a sequence's pages in physical order, not block-table order",
            "pages_sorted", replace(_BASE, seq_lens=(128, 96), q_len=4), sort_pages=True),
    _mutant("causal_ignored", "causal mask", "every query token of a q_len > 1 request sees the whole sequence",
            "causal_off", replace(_BASE, q_len=4), causal=False),
    _mutant("heads_reversed", "head mapping", "writes head h's result to head H-1-h", "heads_reversed", _BASE,
            heads_reversed=True),
    _mutant("split_merge_unscaled", "split-KV", "merges split-KV chunks without rescaling by their maxima "
            f"(sequences > {SPLIT_TOKENS} tokens)", None, replace(_BASE, seq_lens=(300, 37)), rescale_merge=False),
    _mutant("lse_natural_log", "LSE", "returns the LSE in natural log where base 2 is promised", "lse_natural",
            _BASE, lse_base2=False),
    _mutant("out_ignored", "out buffer", "ignores `out` and returns a freshly allocated tensor", None, _BASE,
            write_out=False),
    _mutant("cache_written", "input mutation", "zeroes the unused tail of each last page in the input cache",
            None, _BASE, scratch_tail=True),
    _mutant("unwritten_aligned_rows", "unwritten output", "leaves the output of page-aligned sequences "
            "unwritten", None, replace(_BASE, seq_lens=(64, 37)), skip_aligned=True),
    _mutant("nondeterministic", "determinism", "adds ~1/4 bf16 ulp of random noise (like racing atomics)", None,
            _BASE, noise=2.0 ** -10),
]
MUTANTS: dict[str, Mutant] = {m.name: m for m in _ALL}


def __getattr__(name: str) -> FaultyKernel:
    """``mla_verify.kernels.mutants:<mutant name>`` resolves to that mutant's kernel."""
    if name in MUTANTS:
        return MUTANTS[name].fn
    raise AttributeError(f"module 'mla_verify.kernels.mutants' has no attribute {name!r}")
