"""What a kernel claims to handle: the envelope of problems a backend (or a user kernel) takes.

A problem-side notion: the strategies draw inside it and the backends declare it, so it lives below both. An
envelope's type names the kind of problem it bounds (``kind``: dense decode, or sparse top-k decode), and so the
kind of problem a backend is judged on (mla_verify/kinds).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from .generate import ProblemSpec
from .layouts import LayoutSpec
from .metamorphic import RELATIONS
from .sparse import SPARSE_TRANSFORMS

LSE_BASE_2 = 2.0
# the split and tile sizes (KV tokens) MLA decode kernels commonly cut a sequence into: premerge draws their edges
# (draw/strategies.py) and the diagnosis names an empty split of each (judge/diagnose.py)
SPLIT_SIZES = (64, 128, 256, 512, 1024)
DENSE, SPARSE = "dense", "sparse"  # the problem kinds (mla_verify/kinds), as envelopes and records name them
ENVELOPE_PREFIX = "outside its envelope"  # how Envelope.why_not starts its sentence


class _HeadCounts:
    """What both kinds of envelope say of head counts: ``heads`` the ones taken (None: any of 1..``max_heads``)."""

    heads: tuple[int, ...] | None
    max_heads: int

    def allows_heads(self, h: int) -> bool:
        return (h in self.heads) if self.heads is not None else 1 <= h <= self.max_heads


@dataclass(frozen=True)
class Envelope(_HeadCounts):
    """The problems a backend claims to handle. ``None`` in a field means "any"."""

    kind: ClassVar[str] = DENSE
    devices: tuple[str, ...] = ("cuda",)  # device types: "cpu", "cuda"
    archs: tuple[tuple[int, int], ...] | None = None  # CUDA compute capabilities, e.g. ((10, 0), (10, 3))
    page_sizes: tuple[int, ...] | None = None
    dims: tuple[tuple[int, int], ...] = ((512, 64),)  # (kv_lora_rank, qk_rope_head_dim)
    # dtypes limited to a subset of ``dims`` (e.g. FlashInfer's FA paths take an fp8 cache only with (512, 64))
    dims_by_dtype: tuple[tuple[str, tuple[tuple[int, int], ...]], ...] = ()
    heads: tuple[int, ...] | None = None  # allowed head counts (None: 1..max_heads)
    max_heads: int = 128
    dtypes: tuple[str, ...] = ("bf16",)
    q_len: tuple[int, int] = (1, 1)  # inclusive range
    q_lens: tuple[int, ...] | None = None  # the only q_len values taken within that range (None: all of them)
    batch_sizes: tuple[int, ...] | None = None  # the only batch sizes taken (None: 1..max_batch)
    # per-request query lengths (ProblemSpec.q_lens): only a kernel told each request's own q_len takes them
    # (FlashInfer's wrapper, through qo_indptr); Contract 1's callable has one q_len for the whole batch
    ragged_q: bool = False
    windows: tuple[int | None, ...] = (None,)  # sliding windows (window_left) taken; None: plain causal
    cache_dims: tuple[int, ...] = (3,)
    page_strided: bool = True
    table_widths: tuple[str, ...] = ("native",)
    pass_out: tuple[bool, ...] = (True, False)
    lse: bool = True
    lse_base: float = LSE_BASE_2
    max_batch: int = 1024
    max_seq_len: int = 1 << 17
    # requests with no KV token (kv_len 0) taken, and the LSE their query rows get -- -inf, the log of an empty
    # sum (FlashInfer fa2), or +inf (FlashMLA) -- besides out 0; None: not taken (Contract 1's default)
    empty_lse: float | None = None
    # Where the kernel is fragile, by its own account (nothing here narrows what it takes): the KV tokens per
    # tile or split it cuts sequences into, and lengths it treats specially. The strategies and the corner
    # cases then hit their edges (draw/edges.py), as they hit page edges.
    split_sizes: tuple[int, ...] = ()
    special_lengths: tuple[int, ...] = ()
    notes: str = ""
    # the metamorphic relations (metamorphic.RELATIONS) whose output the backend claims bit for bit; the others
    # are judged by the tolerance model against the same reference (a kernel whose split-KV schedule depends on
    # the whole batch moves its bits, not its values, when the batch is reordered). A user's kernel claims none
    # unless it declares them (user_kernel.py): even a correct PyTorch kernel's BLAS paths may depend on where
    # a request sits in the batch
    bit_invariant: tuple[str, ...] = RELATIONS

    def dims_for(self, dtype: str) -> tuple[tuple[int, int], ...]:
        """The (kv_lora_rank, qk_rope_head_dim) pairs this envelope takes with ``dtype``."""
        limited = dict(self.dims_by_dtype).get(dtype)
        return self.dims if limited is None else tuple(d for d in self.dims if d in limited)

    def why_not(self, spec: ProblemSpec, layout: LayoutSpec) -> str | None:
        """A sentence saying why (spec, layout) is outside this envelope, or None."""
        checks = [
            (self.page_sizes is None or spec.page_size in self.page_sizes,
             f"page size {spec.page_size} (supported: {self.page_sizes})"),
            ((spec.kv_lora_rank, spec.qk_rope_head_dim) in self.dims,
             f"dims ({spec.kv_lora_rank}, {spec.qk_rope_head_dim}) (supported: {list(self.dims)})"),
            (self.allows_heads(spec.num_heads), f"{spec.num_heads} heads"),
            (spec.dtype in self.dtypes, f"dtype {spec.dtype} (supported: {list(self.dtypes)})"),
            ((spec.kv_lora_rank, spec.qk_rope_head_dim) not in self.dims  # said once, above
             or (spec.kv_lora_rank, spec.qk_rope_head_dim) in self.dims_for(spec.dtype),
             f"{spec.dtype} with dims ({spec.kv_lora_rank}, {spec.qk_rope_head_dim}) "
             f"(supported: {list(self.dims_for(spec.dtype))})"),
            (self.q_len[0] <= spec.q_len <= self.q_len[1],
             f"q_len {spec.q_len} (supported {self.q_len[0]}..{self.q_len[1]})"),
            (self.q_lens is None or spec.q_len in self.q_lens, f"q_len {spec.q_len} (supported: {self.q_lens})"),
            (self.ragged_q or spec.q_lens is None,
             f"per-request q_lens {list(spec.q_lens or ())} (this kernel takes one q_len for every request)"),
            (self.batch_sizes is None or spec.batch in self.batch_sizes,
             f"batch {spec.batch} (supported: {self.batch_sizes})"),
            (spec.window_left in self.windows, f"window_left {spec.window_left} (supported: {list(self.windows)})"),
            (layout.cache_dims in self.cache_dims, f"a {layout.cache_dims}-D cache"),
            (self.page_strided or layout.page_stride_pad == 0, "a page-strided cache"),
            (layout.table_width in self.table_widths, f"block-table width '{layout.table_width}'"),
            (layout.pass_out in self.pass_out, "out passed" if layout.pass_out else "out not passed"),
            (self.lse or not layout.return_lse, "returning LSE"),
            (spec.batch <= self.max_batch, f"batch {spec.batch} (max {self.max_batch})"),
            (max(spec.seq_lens) <= self.max_seq_len, f"seq_len {max(spec.seq_lens)} (max {self.max_seq_len})"),
            (self.empty_lse is not None or min(spec.seq_lens) > 0, "a request with kv_len 0"),
        ]
        bad = [what for ok, what in checks if not ok]
        return (f"{ENVELOPE_PREFIX}: " + "; ".join(bad)) if bad else None

    def narrowed(self, **changes: Any) -> Envelope:
        return replace(self, **changes)


@dataclass(frozen=True)
class SparseEnvelope(_HeadCounts):
    """The sparse (top-k) decode problems a backend claims to handle (problems/sparse.py). ``None``: any."""

    kind: ClassVar[str] = SPARSE
    devices: tuple[str, ...] = ("cuda",)
    archs: tuple[tuple[int, int], ...] | None = None
    formats: tuple[str, ...] = ("V32",)  # SPARSE_FORMATS the backend reads
    scales: tuple[str, ...] = ("pow2", "amax")
    topk_multiple: int = 64  # topk must be a multiple of this
    max_topk: int = 2048
    heads: tuple[int, ...] | None = None  # the head counts taken (None: 1..max_heads), as Envelope's
    max_heads: int = 128
    q_len: tuple[int, int] = (1, 2)
    page_sizes: tuple[int, ...] | None = None
    topk_length_formats: tuple[str, ...] = ()  # the formats it takes a per-request topk_length with
    sinks: bool = True
    pass_out: tuple[bool, ...] = (False,)  # whether the kernel is handed an ``out`` buffer (True), allocates (False)
    lse_base: float = 2.718281828459045
    empty_lse: float = math.inf  # the LSE of a row with no valid entry (out 0): +inf, FlashMLA's and trtllm-gen's
    notes: str = ""
    # the sparse relations (sparse.SPARSE_TRANSFORMS) whose output the backend claims bit for bit, as an
    # Envelope's; a relation that reorders a row's sum is judged within tolerance whatever is claimed
    bit_invariant: tuple[str, ...] = tuple(SPARSE_TRANSFORMS)

    def why_not(self, spec: Any, layout: LayoutSpec | None = None) -> str | None:
        """A sentence saying why the SparseSpec ``spec`` (called as ``layout`` says) is outside this envelope, or
        None."""
        checks = [
            (spec.fmt in self.formats, f"format {spec.fmt} (supported: {list(self.formats)})"),
            (spec.fmt == "bf16" or spec.scales in self.scales, f"{spec.scales} scales"),
            (spec.topk % self.topk_multiple == 0 and spec.topk <= self.max_topk,
             f"topk {spec.topk} (a multiple of {self.topk_multiple} up to {self.max_topk})"),
            (self.allows_heads(spec.num_heads), f"{spec.num_heads} heads ("
             + (f"max {self.max_heads})" if self.heads is None else f"supported: {list(self.heads)})")),
            (self.q_len[0] <= spec.q_len <= self.q_len[1], f"q_len {spec.q_len}"),
            (self.page_sizes is None or spec.page_size in self.page_sizes, f"page size {spec.page_size}"),
            (spec.topk_lengths is None or spec.fmt in self.topk_length_formats, f"topk_length with {spec.fmt}"),
            (self.sinks or spec.sink == "none", "attention sinks"),
            (layout is None or layout.pass_out in self.pass_out, "out passed" if layout and layout.pass_out
             else "out not passed"),
        ]
        bad = [what for ok, what in checks if not ok]
        return (f"{ENVELOPE_PREFIX}: " + "; ".join(bad)) if bad else None
