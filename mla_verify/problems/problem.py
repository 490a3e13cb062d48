"""One MLA decode problem -- tensors plus metadata -- and its validation.

The canonical form every backend layout is derived from:
  query       [B, q_len, H, kv_lora_rank + qk_rope_head_dim]
  kv_cache    [P, page_size, kv_lora_rank + qk_rope_head_dim]   one latent row per token: kv_c then k_pe
  block_table [B, W] int32; row b's first ceil(seq_len/page) entries are the pages of sequence b
  seq_lens    [B] int32, KV length *including* the q_len new tokens (token i sits at seq_len - q_len + i); 0: an
              empty request, whose query rows see no key (out 0, LSE -inf; Envelope.empty_lse says who takes one)
  q_lens      None (every request has q_len query tokens) or per-request query lengths, each 1..q_len (the
              query's padded length): request b's tokens are its first q_lens[b] query rows, token i sits at
              seq_len - q_lens[b] + i, and the rows after them are padding that no result depends on (FlashInfer's
              ragged ``qo_indptr``)
  window_left None (causal attention over the whole prefix) or a sliding window: query token i also sees the
              window_left positions before its own and no earlier ones (FlashInfer's ``window_left``)
Scores are ``bmm1_scale * q.k`` (bmm1_scale includes the softmax scale and any fp8 dequant scales);
the output is ``bmm2_scale * softmax(scores) @ kv_c``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..core.dims import MLADims
from ..core.errors import ProblemError
from .layouts import page_counts, used_entries

FP8 = torch.float8_e4m3fn
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, FP8)


class QueryShape:
    """What a problem's query ``[B, q_len, H, D]`` says about it (dense and sparse problems alike)."""

    query: torch.Tensor

    @property
    def batch(self) -> int:
        return self.query.shape[0]

    @property
    def q_len(self) -> int:
        return self.query.shape[1]

    @property
    def num_heads(self) -> int:
        return self.query.shape[2]


@dataclass
class DecodeProblem(QueryShape):
    query: torch.Tensor
    kv_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    dims: MLADims
    bmm1_scale: float
    bmm2_scale: float = 1.0
    max_seq_len: int | None = None  # None: max(seq_lens)
    window_left: int | None = None  # None: no sliding window (see the module docstring)
    q_lens: tuple[int, ...] | None = None  # None: q_len query tokens per request (see the module docstring)

    @property
    def page_size(self) -> int:
        return self.kv_cache.shape[1]

    @property
    def num_pages(self) -> int:
        return self.kv_cache.shape[0]

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        """[B, q_len, H, kv_lora_rank]: the canonical output."""
        return (self.batch, self.q_len, self.num_heads, self.dims.kv_lora_rank)

    @property
    def device(self) -> torch.device:
        return self.query.device

    @property
    def effective_max_seq_len(self) -> int:
        return int(self.seq_lens.max()) if self.max_seq_len is None else self.max_seq_len

    def request_q_lens(self) -> torch.Tensor:
        """[B] int64: each request's query tokens (q_len for every one unless the problem is ragged)."""
        if self.q_lens is None:
            return torch.full((self.batch,), self.q_len, dtype=torch.long, device=self.device)
        return torch.tensor(self.q_lens, dtype=torch.long, device=self.device)

    def valid_rows(self) -> torch.Tensor | None:
        """[B, q_len] bool: the query rows that are a request's tokens; None when every row is (not ragged)."""
        if self.q_lens is None:
            return None
        return torch.arange(self.q_len, device=self.device)[None, :] < self.request_q_lens()[:, None]

    def pages_used(self) -> torch.Tensor:
        """[B] number of block-table entries each sequence uses."""
        return page_counts(self.seq_lens, self.page_size)

    def used_entries(self) -> torch.Tensor:
        """[B, W] bool: the block-table entries that hold pages (the rest is padding)."""
        return used_entries(self.seq_lens, self.page_size, self.block_table.shape[1])

    def validate(self) -> DecodeProblem:
        """Raise ProblemError (one line, naming the field) if the problem is malformed; return self."""
        d = self.dims
        width = d.head_dim_qk
        q, kv, bt, sl = self.query, self.kv_cache, self.block_table, self.seq_lens
        _expect(q.dim() == 4, "query", f"must be 4-D [batch, q_len, heads, {width}], got shape {tuple(q.shape)}")
        _expect(kv.dim() == 3, "kv_cache", f"must be 3-D [pages, page_size, {width}], got shape {tuple(kv.shape)}")
        _expect(q.shape[-1] == width, "query",
                f"last dim is {q.shape[-1]}, expected kv_lora_rank + qk_rope_head_dim = {width}")
        _expect(kv.shape[-1] == width, "kv_cache",
                f"last dim is {kv.shape[-1]}, expected kv_lora_rank + qk_rope_head_dim = {width}")
        _expect(q.shape[2] == d.num_heads, "query", f"has {q.shape[2]} heads but dims.num_heads is {d.num_heads}")
        for name, t in (("query", q), ("kv_cache", kv)):
            _expect(t.dtype in SUPPORTED_DTYPES, name, f"dtype {t.dtype} is not one of bf16/fp16/fp32/fp64/fp8-e4m3")
        _expect(min(q.shape) > 0, "query", f"must be non-empty, got shape {tuple(q.shape)}")
        _expect(min(kv.shape) > 0, "kv_cache", f"must be non-empty, got shape {tuple(kv.shape)}")
        _expect(bt.dtype == torch.int32, "block_table", f"must be int32, got {bt.dtype}")
        _expect(sl.dtype == torch.int32, "seq_lens", f"must be int32, got {sl.dtype}")
        _expect(bt.dim() == 2, "block_table", f"must be 2-D [batch, max_pages], got shape {tuple(bt.shape)}")
        _expect(sl.dim() == 1, "seq_lens", f"must be 1-D [batch], got shape {tuple(sl.shape)}")
        _expect(bt.shape[0] == q.shape[0], "block_table", f"has {bt.shape[0]} rows but query has batch {q.shape[0]}")
        _expect(sl.shape[0] == q.shape[0], "seq_lens", f"has {sl.shape[0]} entries but query has batch {q.shape[0]}")
        for name, t in (("kv_cache", kv), ("block_table", bt), ("seq_lens", sl)):
            _expect(t.device == q.device, name, f"is on {t.device} but query is on {q.device}")
        lens = sl.tolist()
        capacity = bt.shape[1] * self.page_size
        for i, n in enumerate(lens):  # 0: a request with no key (whether a kernel takes one is its envelope's)
            _expect(n >= 0, "seq_lens", f"seq_lens[{i}] = {n} < 0")
            _expect(n == 0 or n >= self.q_len, "seq_lens",
                    f"seq_lens[{i}] = {n} is shorter than q_len = {self.q_len}")
            _expect(n <= capacity, "seq_lens", f"seq_lens[{i}] = {n} exceeds what a block-table row addresses "
                    f"({bt.shape[1]} pages x {self.page_size} = {capacity})")
        bad = self.used_entries() & ((bt < 0) | (bt >= self.num_pages))
        if bool(bad.any()):
            b, j = (int(x) for x in bad.nonzero()[0])
            raise ProblemError(f"block_table: block_table[{b}, {j}] = {int(bt[b, j])} is outside the pool "
                               f"of {self.num_pages} pages")
        if self.max_seq_len is not None:
            _expect(self.max_seq_len >= max(lens), "max_seq_len",
                    f"max_seq_len = {self.max_seq_len} is below the longest sequence ({max(lens)})")
        ql = self.q_lens
        _expect(ql is None or (isinstance(ql, tuple) and len(ql) == len(lens)
                               and all(isinstance(n, int) and 1 <= n <= self.q_len for n in ql)), "q_lens",
                f"must be None or a tuple of {len(lens)} ints in 1..q_len = {self.q_len}, got {ql!r}")
        w = self.window_left
        _expect(w is None or (isinstance(w, int) and not isinstance(w, bool) and w >= 0), "window_left",
                f"must be None or an int >= 0, got {w!r}")
        for name, v in (("bmm1_scale", self.bmm1_scale), ("bmm2_scale", self.bmm2_scale)):
            _expect(isinstance(v, (int, float)) and v == v and abs(v) != float("inf"), name,
                    f"must be a finite number, got {v!r}")
        return self

    def to(self, device: torch.device | str) -> DecodeProblem:
        """The same problem with every tensor on ``device``."""
        return dataclasses.replace(self, query=self.query.to(device), kv_cache=self.kv_cache.to(device),
                                   block_table=self.block_table.to(device), seq_lens=self.seq_lens.to(device))


def _expect(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ProblemError(f"{field}: {message}")
