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

Sparse (top-k) decode has its mutants too, the same way: ``FaultySparseKernel`` is a small correct CPU/PyTorch
kernel with FlashMLA's sparse calling convention (Contract 1's ``flashmla-sparse``: the sgl-flash-mla wheel's
``flash_mla_with_kvcache(..., indices=...)`` over the packed pool ``[pages, page, 1, bytes]``, with ``indices``,
``topk_length``, ``attn_sink``, ``kv_format``), refusing what the wheel's sparse path refuses (h_q 64/128, topk a
multiple of 64, no dynamic topk_length for V3.2, 528 bytes without ``kv_format``) and computing in fp32 with the
SM90 dequant (problems/packed.py) -- unless one field of ``SparseFaults`` says otherwise. ``SPARSE_MUTANTS`` are
those faults, each with a small trigger problem and the sparse catalogue's misreading (judge/sparse_catalog.py)
expected to name it; ``mla_verify.kernels.mutants:<name>`` is the kernel, which ``--kernel`` calls by its
convention, read from its signature (backends/user_kernel.py).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..backends.flashmla_sparse import FLASHMLA_HEADS, WHEEL_FORMAT_BY_BYTES
from ..core.dims import R1_SOFTMAX_SCALE
from ..problems.generate import SENTINEL, ProblemSpec
from ..problems.layouts import LayoutSpec, canonical_cache, padded_width
from ..problems.metamorphic import LARGE_POOL
from ..problems.packed import FORMATS, FP8, dequantize, next_tile, truncated_to_pow2
from ..problems.sparse import FRONT_BLOCK, SparseSpec

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
    max_init: float = -math.inf  # where each split's running max starts, in raw q.k (before bmm1_scale)
    guard_empty_split: bool = True  # a split with no visible key (l == 0) finalised as 0, not 0/0
    # the bits an element offset (page id x page stride + slot x row stride) is computed in; None: the pool is
    # indexed as a tensor, which never wraps
    offset_bits: int | None = None


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
        rows = cache.reshape(-1, D) if f.offset_bits is None else None  # token rows; row id = page id * page + slot
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
            if count == 0:  # requests with no key (kv_len 0): the empty sum, out 0 and LSE -inf
                res[idx], lse[idx] = 0.0, float("-inf")
                continue
            if max(starts[b] for b in idx) + count > flat_table.numel():
                raise IndexError("a sequence reads block-table entries past the end of the table")
            pages = torch.stack([flat_table[starts[b]:starts[b] + count] for b in idx]).long()
            if f.sort_pages:
                pages = pages.sort(dim=1).values
            slot_ids = torch.arange(page, device=query.device)
            if rows is None:  # as a GPU kernel addresses its pool: element offsets from the pages' strides
                kv = _read_by_offset(cache, pages, slot_ids, f.offset_bits or 64).float()
            else:
                kv = rows[(pages[..., None] * page + slot_ids).reshape(len(idx), -1)].float()  # IndexError past it
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


def _read_by_offset(cache: torch.Tensor, pages: torch.Tensor, slots: torch.Tensor, bits: int) -> torch.Tensor:
    """[b, T, D] rows of ``cache`` [P, page, D] (any strides: a view of a larger pool) for the page ids ``pages``
    [b, n], read at element offsets page id x page stride + slot x row stride computed modulo 2^bits, as a kernel
    that keeps them in a ``bits``-bit integer does (past 2^bits elements it reads another page)."""
    storage = cache.untyped_storage().nbytes() // cache.element_size()
    flat = cache.as_strided((storage - cache.storage_offset(),), (1,))
    starts = (pages[..., None] * cache.stride(0) + slots * cache.stride(1)) % (1 << bits)
    return flat[starts.reshape(pages.shape[0], -1)[..., None] + torch.arange(cache.shape[-1], device=cache.device)]


def _attend(q: torch.Tensor, kv: torch.Tensor, n: torch.Tensor, scale: float, L: int,
            f: Faults) -> tuple[torch.Tensor, torch.Tensor]:
    """Split-KV attention of q [b, Q, H, D] over kv [b, T, D], the first n[i] rows valid in sequence i:
    (out [b, Q, H, L], natural-log lse [b, Q, H]). As flash-decoding does it: each split's partial output is
    normalised by its own sum and the splits are merged by their LSE."""
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
    m = scores.amax(-1)  # [b, QH, chunks]; -inf for a chunk with no visible key
    if f.max_init != -math.inf:  # the running max starts at the sentinel (raw q.k, as scale > 0 orders it)
        m = m.clamp_min(f.max_init * scale)
    e = torch.exp(scores - torch.where(m == float("-inf"), 0.0, m)[..., None])
    part_l = e.sum(-1)  # 0 for a chunk with no visible key
    part_o = torch.einsum("bxcj,bcjl->bxcl", e, v)
    o_split = part_o / (torch.where(part_l == 0, 1.0, part_l) if f.guard_empty_split else part_l)[..., None]
    top = m.amax(-1, keepdim=True)
    top = torch.where(top == float("-inf"), 0.0, top)
    # merged by LSE: weight exp(m + log l - top); unscaled, each split's l alone (its own max forgotten)
    w = part_l * torch.exp(m - top) if f.rescale_merge else part_l
    total = w.sum(-1)  # [b, QH]; 0 for a row with no key left (0/0: NaN, as kernels without a guard make it)
    o = (o_split * w[..., None]).sum(2) / total[..., None]
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
    trigger_transform: str = "none"  # the metamorphic relation its trigger needs
    # where premerge catches it: "cuda" for a fault that shows only past 2^32 elements of the pool (a GPU with the
    # memory: problems/metamorphic.py's LARGE_POOL); every other mutant is caught on a CPU
    device: str = "cpu"


def _mutant(name: str, bug_class: str, description: str, diagnosis: str | None, trigger: ProblemSpec,
            trigger_layout: LayoutSpec = LayoutSpec(), trigger_transform: str = "none", **faults: Any) -> Mutant:
    return Mutant(name, description, bug_class, FaultyKernel(Faults(**faults), name, description), diagnosis, trigger,
                  trigger_layout, trigger_transform, "cuda" if trigger_transform == LARGE_POOL else "cpu")


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
    # rows whose raw q.k all lie near -1.5e5 and beyond (generate.py's far_below values)
    _mutant("finite_sentinel", "softmax sentinel", f"starts each split's running max at a finite {SENTINEL:g} over "
            "the raw q.k: a row whose raw scores all lie below it loses every key (0/0)", "finite_max_init_nan",
            replace(_BASE, values="far_below"), max_init=SENTINEL),
    # 129 tokens, 2 query tokens: query token 0 sees none of the second 128-token split
    _mutant("empty_split_unguarded", "split-KV", "finalises each split as its sum of p.v over its sum of p with no "
            "l == 0 guard: a split whose keys are all hidden from a query row gives 0/0", f"empty_split_{SPLIT_TOKENS}",
            replace(_BASE, seq_lens=(129, 37), q_len=2), guard_empty_split=False),
    _mutant("offset_32bit", "page offsets", "computes element offsets (page id x page stride) in 32 bits: past 2^32 "
            "elements of the pool it reads another page", None, _BASE, trigger_transform=LARGE_POOL,
            offset_bits=32),
]
MUTANTS: dict[str, Mutant] = {m.name: m for m in _ALL}


# ------------------------------------------------------------------------------------------------------------ sparse
def _stored(scales: torch.Tensor) -> torch.Tensor:
    return scales


@dataclass(frozen=True)
class SparseFaults:
    """One field per place a sparse kernel goes wrong; every default is the correct behaviour."""

    indices_as_pages: bool = False  # an index taken for a page id: slot = index * page_size
    mask_minus1: bool = True  # -1 entries masked (else read as slot -1: the pool's last row)
    use_topk_length: bool = True  # entries at or past topk_length masked
    sink_in_lse: bool = False  # the sink added into the returned LSE
    scales: Any = _stored  # stored scales -> the scales used
    rope_fp8: bool = False  # the bf16 rope dims rounded to fp8 as if quantized
    v_offset: int = 0  # V read from dims [v_offset, v_offset + 512) (64: the rope dims included)
    empty_rows_zero: bool = True  # a row with no valid entry gives 0 and +inf (else 0/0: NaN)
    block_guard: bool = True  # a top-k block met while every entry so far is masked subtracts 0, not -inf


def _refuse(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


class FaultySparseKernel:
    """The wheel's sparse ``flash_mla_with_kvcache``, computed on CPU, with the faults of ``faults``."""

    def __init__(self, faults: SparseFaults = SparseFaults(), name: str = "correct_sparse_kernel",
                 description: str = "FlashMLA's sparse calling convention on CPU"):
        self.faults, self.__name__, self.__doc__ = faults, name, description

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, block_table: Any, cache_seqlens: Any,
                               head_dim_v: int, tile_scheduler_metadata: Any, num_splits: None = None,
                               softmax_scale: float | None = None, causal: bool = False,
                               is_fp8_kvcache: bool | None = None, indices: torch.Tensor | None = None,
                               attn_sink: torch.Tensor | None = None, topk_length: torch.Tensor | None = None,
                               kv_format: str | None = None, use_legacy: bool = False,
                               **unused: Any) -> tuple[torch.Tensor, torch.Tensor]:
        assert indices is not None and not causal and is_fp8_kvcache is not False, "the stand-in is sparse only"
        assert not any(v is not None for v in unused.values()), f"not taken by the stand-in: {sorted(unused)}"
        _refuse(q.dtype == torch.bfloat16 and q.dim() == 4 and q.shape[2] in FLASHMLA_HEADS,
               "q must be bf16 [b, s_q, h_q, d] with h_q 64 or 128")
        _refuse(k_cache.dim() == 4 and k_cache.shape[2] == 1 and k_cache.element_size() == 1, "k_cache: h_k must be 1")
        _refuse(indices.dtype == torch.int32 and indices.shape[-1] % 64 == 0, "topk must be a multiple of 64")
        _refuse(head_dim_v == 512, "head_dim_v must be 512")
        width = k_cache.shape[-1]
        fmt_name = kv_format or WHEEL_FORMAT_BY_BYTES.get(width, "V41")
        _refuse(fmt_name in FORMATS and FORMATS[fmt_name].bytes_per_token == width,
               f"{width}-byte rows as {fmt_name}: not a format SM90 runs")
        _refuse(topk_length is None or fmt_name != "V32", "V3.2 does not support dynamic topk length")
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        fmt = FORMATS[fmt_name]
        P, page = k_cache.shape[:2]
        pool = k_cache.view(torch.uint8).as_strided((P, k_cache.stride(0)), (k_cache.stride(0), 1))
        out, lse = self._attend(q, dequantize(pool, fmt, page, "sm90", self.faults.scales), fmt.nope, indices,
                                topk_length, attn_sink, scale)
        return out.to(torch.bfloat16), lse.transpose(1, 2)

    def trtllm_sparse(self, query: torch.Tensor, kv_cache: torch.Tensor, workspace_buffer: torch.Tensor,
                      qk_nope_head_dim: int, kv_lora_rank: int, qk_rope_head_dim: int, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor | None, max_seq_len: int, out: torch.Tensor | None = None,
                      bmm1_scale: float = 1.0, bmm2_scale: float = 1.0, return_lse: bool = False,
                      sparse_mla_top_k: int = 0) -> Any:
        """The same arithmetic, and fault, in Contract 1's ``trtllm-sparse`` convention (FlashInfer's trtllm-gen
        sparse MLA) over a bf16 cache ``[P, 1, page, 576]``: block tables ``[B, q_len, topk]`` of token slots,
        -1 masked; the LSE in base 2, ``[B * q_len, H]``. FlashMLA's sparse decode reads packed FP8 only; this is
        how the kernel is handed a bf16 pool (fib/contract1.py wraps it as a flashinfer-bench DSA solution)."""
        _refuse(query.dtype == torch.bfloat16 and query.dim() == 4, "query must be bf16 [B, q_len, H, d]")
        _refuse(kv_cache.dtype == torch.bfloat16 and kv_cache.dim() == 4 and kv_cache.shape[1] == 1,
                "kv_cache must be bf16 [pages, 1, page, d]: this convention's packed cache is not read here")
        _refuse(block_tables.dtype == torch.int32 and block_tables.shape[-1] == sparse_mla_top_k,
                "block_tables must be int32 [B, q_len, sparse_mla_top_k]")
        B, Q, H, _ = query.shape
        o, lse = self._attend(query, kv_cache[:, 0], kv_lora_rank, block_tables, None, None, bmm1_scale)
        o = (o * bmm2_scale).to(torch.bfloat16)
        if out is not None:
            o = out.copy_(o)
        return (o, (lse / math.log(2)).reshape(B * Q, H)) if return_lse else o

    def _attend(self, q: torch.Tensor, rows: torch.Tensor, nope: int, indices: torch.Tensor,
                topk_length: torch.Tensor | None, sink: torch.Tensor | None,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(out fp32 [B, Q, H, 512], lse [B, Q, H] in natural log) of ``q`` over the pool's values ``rows``
        ``[P, page, d]`` (their first ``nope`` dims the latent ones), with the faults of ``self.faults``."""
        f = self.faults
        P, page = rows.shape[:2]
        if f.rope_fp8:
            rows = torch.cat([rows[..., :nope], rows[..., nope:].to(FP8).to(torch.bfloat16)], dim=-1)
        # past its pool a kernel reads memory it was not given: here NaN, the suite's poison for what a kernel must
        # not read (a GPU kernel reads garbage there, or faults)
        flat = torch.cat([rows.reshape(P * page, -1).float(), torch.full_like(rows[0, :1].float(), float("nan"))])
        idx = indices.long()
        slots = (idx * page).clamp(max=P * page) if f.indices_as_pages else idx % (P * page)  # -1: the last row
        masked = idx == -1 if f.mask_minus1 else torch.zeros_like(idx, dtype=torch.bool)
        if topk_length is not None and f.use_topk_length:
            masked |= torch.arange(idx.shape[-1]) >= topk_length.long()[:, None, None]
        kv = flat[slots].masked_fill(masked[..., None], 0.0)  # [B, Q, K, D]; masked rows zeroed, as SM90 does
        scores = torch.einsum("bqhd,bqkd->bqhk", q.float(), kv) * scale
        scores = scores.masked_fill(masked[:, :, None, :], float("-inf"))
        top, total, acc = _blockwise_softmax(scores, kv[..., f.v_offset:f.v_offset + 512], f.block_guard)
        out = acc / total[..., None]
        lse = top + torch.log(total)
        if sink is not None:
            out = out * torch.sigmoid(lse - sink)[..., None]
            if f.sink_in_lse:
                lse = torch.logaddexp(lse, sink)
        if f.empty_rows_zero:  # after the sink: an empty row's -inf lse against a -inf sink would give NaN
            out = out.masked_fill((total == 0)[..., None], 0.0)
            lse = lse.masked_fill(total == 0, float("inf"))
        return out, lse


def _blockwise_softmax(scores: torch.Tensor, values: torch.Tensor,
                       guard: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, sum of exp(s - max), sum of exp(s - max) v) of each row of ``scores`` [B, Q, H, K] (-inf: masked) over
    ``values`` [B, Q, K, d], as FlashMLA's SM90 loop makes them: FRONT_BLOCK entries at a time, the running sums
    rescaled by exp(old max - new max). ``guard``: a block met while the max is still -inf (every entry so far
    masked) subtracts 0, not -inf; without it exp(-inf - -inf) makes the row NaN."""
    m = torch.full(scores.shape[:-1], float("-inf"), dtype=scores.dtype, device=scores.device)
    total = torch.zeros_like(m)
    acc = torch.zeros(scores.shape[:-1] + values.shape[-1:], dtype=scores.dtype, device=scores.device)
    for start in range(0, scores.shape[-1], FRONT_BLOCK):
        s = scores[..., start:start + FRONT_BLOCK]
        m_new = torch.maximum(m, s.amax(-1))
        at = torch.where(m_new == float("-inf"), 0.0, m_new) if guard else m_new
        alpha, p = torch.exp(m - at), torch.exp(s - at[..., None])
        total = total * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + torch.einsum("bqhk,bqkd->bqhd", p, values[:, :, start:start + FRONT_BLOCK])
        m = m_new
    return m, total, acc


@dataclass(frozen=True)
class SparseMutant:
    name: str
    description: str
    faults: SparseFaults
    diagnosis: str  # the judge/sparse_catalog.py misreading expected to name it
    trigger: SparseSpec  # a small problem that shows the fault

    @property
    def fn(self) -> FaultySparseKernel:
        return FaultySparseKernel(self.faults, self.name, self.description)


# Triggers: 64 heads (no padding to hide behind), topk 64 over 4 pages of 64; variations add what a fault needs.
_SPARSE_BASE = SparseSpec(batch=2, num_heads=64, topk=64, page_size=64, used_pages=4, invalid=0.2)

# request 0 empty (topk_length 0), request 1's first 64 entries -1 before 64 valid ones: the two NaN faults of a
# row part here (an empty row alone cannot tell them apart)
_EMPTY_AND_FRONT = replace(_SPARSE_BASE, fmt="V4", topk=128, front_blocks=1, invalid=0.0, topk_lengths=(0, 128))

_ALL_SPARSE = [
    # 2 used pages of 2 slots among 64: seed 10 (found by search) puts both in the pool's first half, so
    # index * 2 stays inside the pool (on NaN slots); duplicates and no -1 keep minus1_read from fitting too
    SparseMutant("indices_as_page_ids", "takes each index for a page id (slot = index * page_size)",
                 SparseFaults(indices_as_pages=True), "indices_as_page_ids",
                 replace(_SPARSE_BASE, page_size=2, used_pages=2, extra_pages=62, invalid=0.0, duplicates=True,
                         seed=10)),
    SparseMutant("minus1_unmasked", "reads -1 entries as slot -1 (the pool's last row) instead of masking them",
                 SparseFaults(mask_minus1=False), "minus1_read", _SPARSE_BASE),
    SparseMutant("topk_length_ignored", "attends to every entry, past topk_length too",
                 SparseFaults(use_topk_length=False), "topk_length_ignored",
                 replace(_SPARSE_BASE, fmt="V4", invalid=0.0, topk=128, topk_lengths=(40, 100))),
    SparseMutant("sink_in_lse", "adds the attention sink into the returned LSE",
                 SparseFaults(sink_in_lse=True), "sink_in_lse", replace(_SPARSE_BASE, sink="finite")),
    SparseMutant("scales_pow2", "cuts fp32 scales to powers of two (an e8m0 cast)",
                 SparseFaults(scales=truncated_to_pow2), "scales_pow2", replace(_SPARSE_BASE, scales="amax")),
    SparseMutant("tile_scale_shifted", "reads each 128-value tile with the next tile's scale",
                 SparseFaults(scales=next_tile), "tile_scale_shifted", replace(_SPARSE_BASE, values="extreme")),
    # a larger softmax scale: the rope part's fp8 rounding then moves the softmax well past bf16's noise
    SparseMutant("rope_quantized", "rounds the bf16 rope dims to fp8 as if they were quantized",
                 SparseFaults(rope_fp8=True), "rope_quantized", replace(_SPARSE_BASE, softmax_scale=0.5)),
    SparseMutant("v_rope_dims", "takes V from dims 64..575 (the rope dims included) instead of 0..511",
                 SparseFaults(v_offset=64), "v_rope_dims", _SPARSE_BASE),
    SparseMutant("empty_row_nan", "divides 0 by 0 for a row with no valid entry (NaN, not 0)",
                 SparseFaults(empty_rows_zero=False), "empty_row_nan", _EMPTY_AND_FRONT),
    SparseMutant("front_block_unguarded", "subtracts the running max -inf from a fully masked leading block "
                 "(no guard): exp(-inf - -inf) makes the row NaN", SparseFaults(block_guard=False),
                 "front_block_nan", _EMPTY_AND_FRONT),
]
SPARSE_MUTANTS: dict[str, SparseMutant] = {m.name: m for m in _ALL_SPARSE}
correct_sparse_kernel = FaultySparseKernel()


def __getattr__(name: str) -> FaultyKernel | FaultySparseKernel:
    """``mla_verify.kernels.mutants:<mutant name>`` resolves to that mutant's kernel, dense or sparse."""
    if name in MUTANTS:
        return MUTANTS[name].fn
    if name in SPARSE_MUTANTS:
        return SPARSE_MUTANTS[name].fn
    raise AttributeError(f"module 'mla_verify.kernels.mutants' has no attribute {name!r}")
