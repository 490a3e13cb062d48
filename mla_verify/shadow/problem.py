"""A live call in the suite's own terms: the DecodeProblem the reference solves, the LayoutSpec it came in,
the ProblemSpec that describes it (for envelopes, messages and replay), and a reproducer-sized copy of it; a
sparse call's SparseDecodeProblem, over only the pages its indices touch (``live_sparse_problem``).

A live call has no spec it was drawn from: ``describing_spec`` states its parameters, with ``values="live"``
so that nothing can mistake it for a spec that regenerates the tensors (``build_problem`` refuses it); a
reproducer of a live call therefore keeps its tensors (shadow_fixture.py).
"""
from __future__ import annotations

import torch

from ..core.dims import MLADims
from ..problems import generate
from ..problems.generate import ProblemSpec
from ..problems.layouts import LayoutSpec, canonical_cache, padded_width
from ..problems.packed import FORMATS, dequantize
from ..problems.problem import DecodeProblem
from ..problems.sparse import UNPACKED, SparseDecodeProblem
from .contract import DEEPSEEK_QK_NOPE, PagedArgs

LIVE_VALUES = "live"  # ProblemSpec.values of a live call: its tensors are the engine's, not drawn


def live_problem(args: PagedArgs) -> DecodeProblem:
    """The call as a validated DecodeProblem (views of the engine's tensors, no copies); ProblemError if not."""
    q = args.query
    dims = MLADims(args.kv_lora_rank, args.qk_rope_head_dim, args.qk_nope_head_dim or DEEPSEEK_QK_NOPE,
                   num_heads=q.shape[2])
    longest = int(args.seq_lens.max()) if args.seq_lens.numel() else 0
    # a max_seq_len below the longest sequence is reported on its own (check_lengths); the reference attends
    # to every token, so that the kernel's dropped tail also shows in the numbers
    max_seq_len = args.max_seq_len if args.max_seq_len is not None and args.max_seq_len >= longest else None
    problem = DecodeProblem(q, canonical_cache(args.kv_cache), args.block_table, args.seq_lens, dims,
                            float(args.bmm1_scale), float(args.bmm2_scale), max_seq_len)
    return problem.validate()


def live_layout(args: PagedArgs, pass_out: bool, return_lse: bool, table_width: str | None = None) -> LayoutSpec:
    """How the call laid the problem out, in LayoutSpec's terms (page-stride padding in whole token rows); a
    table whose width is a multiple of 128 / page counts as "pad128" unless ``table_width`` says otherwise."""
    cache = canonical_cache(args.kv_cache)
    page, width = cache.shape[1], cache.shape[2]
    pad_rows = max(0, -(-(cache.stride(0) - page * width) // width)) if cache.shape[0] > 1 else 0
    columns = args.block_table.shape[1]
    aligned = columns == padded_width(columns, page)
    return LayoutSpec(cache_dims=args.kv_cache.dim(), page_stride_pad=pad_rows,
                      table_width=table_width or ("pad128" if aligned else "native"), pass_out=pass_out,
                      return_lse=return_lse)


def describing_spec(problem: DecodeProblem) -> ProblemSpec:
    """The spec whose parameters are this live call's (generate.describing_spec), its values ``"live"``."""
    return generate.describing_spec(problem, LIVE_VALUES)


def compact(problem: DecodeProblem, rows: list[int] | None = None) -> DecodeProblem:
    """The same problem (only sequences ``rows``, if given) over just the pages it reads: the pool holds those
    pages in ascending id order and the table is renumbered; entries past a sequence's pages become -1. The
    window and per-request query lengths (of the kept rows) go with it."""
    p = problem
    kept = list(range(p.batch)) if rows is None else list(rows)
    index = torch.tensor(kept, device=p.device, dtype=torch.long)
    table, lens, used = p.block_table[index], p.seq_lens[index], p.used_entries()[index]
    pages, renumbered = torch.unique(table[used], return_inverse=True)
    new_table = torch.full_like(table, -1)
    new_table[used] = renumbered.to(torch.int32)
    q_lens = None if p.q_lens is None else tuple(p.q_lens[b] for b in kept)
    return DecodeProblem(p.query[index].contiguous(), p.kv_cache[pages.long()].contiguous(), new_table, lens.clone(),
                         p.dims, p.bmm1_scale, p.bmm2_scale, p.max_seq_len, p.window_left, q_lens).validate()


def live_sparse_problem(q: torch.Tensor, cache: torch.Tensor, fmt: str, indices: torch.Tensor,
                        topk_length: torch.Tensor | None, attn_sink: torch.Tensor | None,
                        softmax_scale: float) -> SparseDecodeProblem:
    """The validated problem over the pages ``indices`` touch and the pool's last page, renumbered; ProblemError
    if the call's tensors do not make one. ``indices`` must already be -1 or inside the pool."""
    P, page = cache.shape[:2]
    listed = indices[indices >= 0].long() // page
    pages = torch.unique(torch.cat([listed, torch.tensor([P - 1], device=listed.device)]))  # ascending
    idx = indices.long()
    renumbered = torch.searchsorted(pages, idx.clamp_min(0) // page) * page + idx.clamp_min(0) % page
    new_indices = torch.where(idx >= 0, renumbered, -1).to(torch.int32) if indices.dtype == torch.int32 \
        else indices  # another dtype: validate() names it
    packed = None
    if fmt == UNPACKED:
        kv = cache[pages][:, :, 0]
    else:
        spec = FORMATS[fmt]
        raw = cache.view(torch.uint8).as_strided((P, page * spec.bytes_per_token), (cache.stride(0), 1))
        packed = raw[pages]
        kv = dequantize(packed, spec, page, "sm90")
    return SparseDecodeProblem(q, kv, new_indices, float(softmax_scale), topk_length, attn_sink, fmt,
                               packed).validate()


def describe_live(p: DecodeProblem | SparseDecodeProblem) -> str:
    """One line for a report: a dense call's describing spec; a sparse call's shape and what it masks."""
    if isinstance(p, DecodeProblem):
        return describing_spec(p).describe()
    masked = p.masked()
    return (f"sparse {p.fmt} B={p.batch} q_len={p.q_len} H={p.num_heads} topk={p.indices.shape[-1]} "
            f"page={p.page_size} pages read={p.kv_cache.shape[0]} masked={float(masked.float().mean()):.0%} "
            f"topk_length={'given' if p.topk_length is not None else 'none'} "
            f"sink={'given' if p.attn_sink is not None else 'none'} scale={p.softmax_scale:.6g}")
