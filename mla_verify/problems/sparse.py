"""One sparse (DeepSeek V3.2 top-k) MLA decode problem: its spec, its tensors and their validation.

Each query token attends only to the ``topk`` cache slots its row of ``indices`` lists (slot = page *
page_size + offset into the pool of token rows). An entry of -1, and an entry at a position at or past its
request's ``topk_length`` (when given), is masked; a duplicated slot counts once per listing. K is the whole
row (latent then rope), V its first ``d_v`` = 512 dims; ``softmax_scale`` multiplies the whole q.k; an
attention sink ``s_h`` scales head h's output by 1 / (1 + exp(s_h - lse)) and is not part of the LSE; a row
with no valid entry gives out 0 and LSE +inf.

The metamorphic relations of a sparse problem (``SPARSE_TRANSFORMS``, ``transform``) move what must not matter:
the pool's pages (the indices renumbered with them: the same values, in the same order, so a deterministic kernel
gives the same bits), the order of a row's entries, and where in a row its -1 entries sit (each a different order
of the same sum: a kernel's bits may change, its values may not beyond the tolerance model). A row's entries move
only among the entries on their side of its request's ``topk_length``.

The canonical problem holds the cache as the values the kernel is held to (``kv_cache`` [P, page, d_qk]) and,
for a packed format, the packed bytes it reads (``packed``, problems/packed.py). Every slot that no index row
lists -- at any position, masked ones included -- holds NaN, so a kernel that reads a slot it was not given
poisons its own output.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import ProblemError
from .json_fields import FieldCheck, checked_fields, is_int, is_ints, is_number
from .layouts import LayoutSpec
from .packed import FORMATS, SCALE_CONVENTIONS, dequantize, packed_format, quantize
from .problem import QueryShape

D_V = 512
FRONT_BLOCK = 64  # top-k entries a sparse kernel's softmax loop takes at once (FlashMLA SM90's B_TOPK)
UNPACKED = "bf16"  # a plain bf16 cache of 576-value rows (no packed format)
SPARSE_FORMATS = (UNPACKED, *FORMATS)
SINKS = ("none", "finite", "+inf", "-inf", "mixed")
SPARSE_VALUES = ("normal", "extreme")
# how a sparse kernel is called unless its envelope says otherwise: it allocates out and returns the LSE (of a
# LayoutSpec, a sparse call reads ``pass_out`` and ``return_lse`` alone: its cache layout is its packed format)
SPARSE_LAYOUT = LayoutSpec(pass_out=False, return_lse=True)
# name -> (what it changes, whether a deterministic kernel keeps its bits: else judged within tolerance)
SPARSE_TRANSFORMS = {
    "pages": ("the pool's pages permuted (indices renumbered)", True),
    "topk_order": ("each row's top-k entries permuted", False),
    "minus1_moved": ("each row's -1 entries moved to its front", False),
}


# what each SparseSpec field may hold in JSON (from_json)
_JSON_FIELDS: dict[str, FieldCheck] = {
    **{n: (is_int, "an integer") for n in ("batch", "q_len", "num_heads", "topk", "page_size", "used_pages",
                                           "extra_pages", "seed")},
    "fmt": (lambda v: v in SPARSE_FORMATS, f"one of {list(SPARSE_FORMATS)}"),
    "scales": (lambda v: v in SCALE_CONVENTIONS, f"one of {list(SCALE_CONVENTIONS)}"),
    "sink": (lambda v: v in SINKS, f"one of {list(SINKS)}"),
    "values": (lambda v: v in SPARSE_VALUES, f"one of {list(SPARSE_VALUES)}"),
    "invalid": (is_number, "a number"),
    **{n: (lambda v: isinstance(v, bool), "true or false") for n in ("invalid_front", "duplicates")},
    "front_blocks": (lambda v: is_int(v) and v >= 0, "an integer >= 0"),
    "topk_lengths": (lambda v: v is None or is_ints(v), "null or a non-empty list of integers"),
    "softmax_scale": (lambda v: v is None or is_number(v), "null or a number"),
}


@dataclass(frozen=True)
class SparseSpec:
    """A small, hashable description of a sparse decode problem (``build_sparse_problem`` makes its tensors)."""

    batch: int = 2
    q_len: int = 1
    num_heads: int = 16
    topk: int = 64
    page_size: int = 64
    used_pages: int = 2  # the pages slots are drawn from (shared by all requests)
    extra_pages: int = 0  # further NaN pages in the pool, listed by no index
    fmt: str = "V32"  # one of SPARSE_FORMATS
    scales: str = "pow2"  # packed formats' scale convention (problems/packed.py)
    invalid: float = 0.05  # the share of entries that are -1
    invalid_front: bool = False  # the first third of every row is -1 (a fully masked leading chunk)
    # the first front_blocks x FRONT_BLOCK entries of every row are -1: whole leading top-k blocks masked before
    # the valid entries (a kernel's first blocks with no key; FlashMLA's SM90 loop takes 64 entries a block)
    front_blocks: int = 0
    duplicates: bool = False  # slots drawn with replacement (else distinct within a row, -1 where they run out)
    topk_lengths: tuple[int, ...] | None = None  # per request: entries at or past it are masked
    sink: str = "none"  # the attention sinks (SINKS): none, finite values, +inf, -inf, or a mix of the three
    softmax_scale: float | None = None  # None: d_qk ** -0.5
    values: str = "normal"  # "extreme": some 128-value tiles all zero, some 1000x larger
    seed: int = 0

    @property
    def d_qk(self) -> int:
        return 576 if self.fmt == UNPACKED else FORMATS[self.fmt].d_qk

    @property
    def scale(self) -> float:
        return self.d_qk ** -0.5 if self.softmax_scale is None else self.softmax_scale

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.topk_lengths is not None:
            d["topk_lengths"] = list(self.topk_lengths)
        return d

    @classmethod
    def from_json(cls, d: Any) -> SparseSpec:
        """The spec ``to_json`` wrote, every field of its type (a missing seed would replay another problem);
        else a ProblemError naming the field. Ranges are checked when the problem is built."""
        d = checked_fields({"front_blocks": 0, **d} if isinstance(d, dict) else d, _JSON_FIELDS, "sparse spec",
                           required=True)  # a record from before front_blocks has none
        lengths = d.get("topk_lengths")
        return cls(**{**d, "topk_lengths": None if lengths is None else tuple(lengths)})

    def case_id(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    def describe(self) -> str:
        return (f"sparse {self.fmt}/{self.scales} B={self.batch} q_len={self.q_len} H={self.num_heads} "
                f"topk={self.topk} page={self.page_size} pages={self.used_pages}+{self.extra_pages} "
                f"invalid={self.invalid:g}{' front' if self.invalid_front else ''}"
                f"{f' front={self.front_blocks}x{FRONT_BLOCK}' if self.front_blocks else ''}"
                f"{' dup' if self.duplicates else ''} topk_lengths={self.topk_lengths} sink={self.sink} "
                f"scale={self.scale:.6g} values={self.values} seed={self.seed}")


@dataclass
class SparseDecodeProblem(QueryShape):
    query: torch.Tensor  # [B, q_len, H, d_qk] bf16
    kv_cache: torch.Tensor  # [P, page, d_qk]: the values the kernel is held to (NaN in unlisted slots)
    indices: torch.Tensor  # [B, q_len, topk] int32 slots, -1 masked
    softmax_scale: float
    topk_length: torch.Tensor | None = None  # [B] int32
    attn_sink: torch.Tensor | None = None  # [H] fp32, natural-log units
    fmt: str = UNPACKED
    packed: torch.Tensor | None = None  # uint8 [P, FORMATS[fmt].page_bytes(page)] for a packed format
    d_v: int = D_V

    @property
    def page_size(self) -> int:
        return self.kv_cache.shape[1]

    @property
    def slots(self) -> int:
        return self.kv_cache.shape[0] * self.kv_cache.shape[1]

    @property
    def out_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.q_len, self.num_heads, self.d_v)

    def masked(self) -> torch.Tensor:
        """[B, q_len, topk] bool: the entries no key comes from (-1, or at or past topk_length)."""
        masked = self.indices == -1
        if self.topk_length is not None:
            at = torch.arange(self.indices.shape[-1], device=self.indices.device)
            masked = masked | (at >= self.topk_length.to(at.device)[:, None, None])
        return masked

    def validate(self) -> SparseDecodeProblem:
        """Raise ProblemError (one line, naming the field) if malformed; return self."""
        q, kv, idx = self.query, self.kv_cache, self.indices
        d = kv.shape[-1] if kv.dim() == 3 else -1
        _expect(q.dim() == 4, "query", f"must be 4-D [batch, q_len, heads, d_qk], got {tuple(q.shape)}")
        _expect(kv.dim() == 3, "kv_cache", f"must be 3-D [pages, page_size, d_qk], got {tuple(kv.shape)}")
        _expect(q.shape[-1] == d, "query", f"last dim {q.shape[-1]} differs from the cache rows' {d}")
        _expect(d >= self.d_v, "kv_cache", f"rows of {d} values are narrower than d_v = {self.d_v}")
        _expect(idx.dtype == torch.int32 and idx.dim() == 3 and tuple(idx.shape[:2]) == tuple(q.shape[:2]),
                "indices", f"must be int32 [batch, q_len, topk] = [{q.shape[0]}, {q.shape[1]}, topk], "
                f"got {idx.dtype} {tuple(idx.shape)}")
        bad = (idx != -1) & ((idx < 0) | (idx >= self.slots))
        if bool(bad.any()):
            at = tuple(int(x) for x in bad.nonzero()[0])
            raise ProblemError(f"indices: indices{list(at)} = {int(idx[at])} is neither -1 nor a slot of the "
                               f"pool (0..{self.slots - 1})")
        tl = self.topk_length
        _expect(tl is None or (tl.dtype == torch.int32 and tuple(tl.shape) == (q.shape[0],)), "topk_length",
                f"must be None or int32 [{q.shape[0]}]")
        sink = self.attn_sink
        _expect(sink is None or (sink.dtype == torch.float32 and tuple(sink.shape) == (q.shape[2],)),
                "attn_sink", f"must be None or fp32 [{q.shape[2]}]")
        _expect(isinstance(self.softmax_scale, (int, float)) and math.isfinite(self.softmax_scale),
                "softmax_scale", f"must be a finite number, got {self.softmax_scale!r}")
        _expect(self.fmt in SPARSE_FORMATS, "fmt", f"{self.fmt!r} is not one of {SPARSE_FORMATS}")
        _expect((self.packed is None) == (self.fmt == UNPACKED), "packed",
                f"a {self.fmt} problem {'has no' if self.packed is None else 'has'} packed bytes")
        return self

    def to(self, device: torch.device | str) -> SparseDecodeProblem:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)
        return dataclasses.replace(self, query=self.query.to(device), kv_cache=self.kv_cache.to(device),
                                   indices=self.indices.to(device), topk_length=move(self.topk_length),
                                   attn_sink=move(self.attn_sink), packed=move(self.packed))


def build_sparse_problem(spec: SparseSpec, device: torch.device | str = "cpu") -> SparseDecodeProblem:
    """Materialize ``spec`` on ``device`` (the same spec gives the same bits on one device type)."""
    s = spec
    if s.fmt not in SPARSE_FORMATS or s.sink not in SINKS or s.values not in SPARSE_VALUES \
            or s.scales not in SCALE_CONVENTIONS:
        raise ProblemError(f"sparse spec: fmt/sink/values/scales {s.fmt!r}/{s.sink!r}/{s.values!r}/{s.scales!r} "
                           f"not in {SPARSE_FORMATS}/{SINKS}/{SPARSE_VALUES}/{SCALE_CONVENTIONS}")
    if min(s.batch, s.q_len, s.num_heads, s.topk, s.page_size, s.used_pages) < 1 or min(s.extra_pages,
                                                                                         s.front_blocks) < 0:
        raise ProblemError(f"sparse spec: sizes must be >= 1 (extra_pages >= 0): {s.describe()}")
    if s.topk_lengths is not None and (len(s.topk_lengths) != s.batch or min(s.topk_lengths) < 0):
        raise ProblemError(f"topk_lengths: {s.topk_lengths} is not {s.batch} lengths >= 0")
    device = torch.device(device)
    gen = torch.Generator(device=device)
    gen.manual_seed(s.seed)
    page, d = s.page_size, s.d_qk
    P = s.used_pages + s.extra_pages
    pages = torch.randperm(P, generator=gen, device=device)[:s.used_pages]  # the used pages, anywhere in the pool
    used_slots = (pages[:, None] * page + torch.arange(page, device=device)).flatten()
    indices = _indices(s, used_slots, gen, device)
    query = torch.randn((s.batch, s.q_len, s.num_heads, d), generator=gen, device=device).to(torch.bfloat16)
    rows = torch.randn((P * page, d), generator=gen, device=device)
    if s.values == "extreme":  # whole tiles of zeros and of large values: the scales' range ends
        tiles = rows[:, :512].unflatten(-1, (8, 64))
        pick = torch.rand(tiles.shape[:2], generator=gen, device=device)
        tiles.mul_(torch.where(pick < 0.2, 0.0, torch.where(pick > 0.8, 1000.0, 1.0))[..., None])
    listed = torch.zeros(P * page, dtype=torch.bool, device=device)
    listed[indices[indices >= 0].long()] = True
    rows[~listed] = float("nan")
    cache = rows.to(torch.bfloat16).view(P, page, d)  # the rope part is stored as bf16: round it once here
    packed = None
    if s.fmt != UNPACKED:
        fmt = packed_format(s.fmt)
        packed = quantize(cache, fmt, s.scales)
        cache = dequantize(packed, fmt, page, "sm90")
    problem = SparseDecodeProblem(query, cache, indices, s.scale, _topk_length(s, device),
                                  _sinks(s, gen, device), s.fmt, packed)
    return problem.validate()


def _indices(s: SparseSpec, used_slots: torch.Tensor, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """[B, q_len, topk] int32 slots of ``used_slots``, with -1 where the spec asks for it: a row's masked front
    blocks first, then its ``topk`` less those entries drawn as a row of that length is."""
    rows, n = s.batch * s.q_len, used_slots.numel()
    front = min(s.topk, s.front_blocks * FRONT_BLOCK)
    topk = s.topk - front
    if s.duplicates:
        picks = torch.randint(0, n, (rows, topk), generator=gen, device=device)
    else:
        keys = torch.rand((rows, n), generator=gen, device=device)
        picks = keys.argsort(-1)[:, :min(n, topk)]
        picks = torch.nn.functional.pad(picks, (0, topk - picks.shape[1]), value=-1)
    picks = torch.nn.functional.pad(picks, (front, 0), value=-1)
    slots = torch.where(picks >= 0, used_slots[picks.clamp_min(0)], -1)
    drop = torch.rand((rows, s.topk), generator=gen, device=device) < s.invalid
    if s.invalid_front:
        drop[:, :s.topk // 3 + 1] = True
    return torch.where(drop, -1, slots).to(torch.int32).view(s.batch, s.q_len, s.topk)


def _topk_length(s: SparseSpec, device: torch.device) -> torch.Tensor | None:
    if s.topk_lengths is None:
        return None
    return torch.tensor(s.topk_lengths, dtype=torch.int32, device=device)


def _sinks(s: SparseSpec, gen: torch.Generator, device: torch.device) -> torch.Tensor | None:
    if s.sink == "none":
        return None
    finite = torch.randn((s.num_heads,), generator=gen, device=device) * 2
    if s.sink == "finite":
        return finite
    if s.sink == "mixed":  # every third head +inf, every third -inf, the rest finite
        h = torch.arange(s.num_heads, device=device) % 3
        return torch.where(h == 1, float("inf"), torch.where(h == 2, float("-inf"), finite))
    return torch.full((s.num_heads,), float(s.sink), device=device)


def _expect(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise ProblemError(f"{field}: {message}")


def transform(p: SparseDecodeProblem, name: str, seed: int = 0) -> SparseDecodeProblem:
    """``p`` under the metamorphic relation ``name`` (SPARSE_TRANSFORMS); the output's order is unchanged."""
    if name not in SPARSE_TRANSFORMS:
        raise ValueError(f"unknown sparse metamorphic transform {name!r}; known: {list(SPARSE_TRANSFORMS)}")
    gen = torch.Generator(device=p.query.device)
    gen.manual_seed(seed)
    if name == "pages":
        P, page = p.kv_cache.shape[:2]
        perm = torch.randperm(P, generator=gen, device=p.query.device)  # page i moves to slot perm[i]
        cache = torch.empty_like(p.kv_cache)
        cache[perm] = p.kv_cache
        packed = None
        if p.packed is not None:
            packed = torch.empty_like(p.packed)
            packed[perm] = p.packed
        idx = p.indices.long().clamp_min(0)
        moved = perm[idx // page] * page + idx % page
        indices = torch.where(p.indices >= 0, moved, -1).to(torch.int32)
        return dataclasses.replace(p, kv_cache=cache, packed=packed, indices=indices)
    K = p.indices.shape[-1]
    at = torch.arange(K, device=p.query.device)
    # each entry's side of its request's topk_length: entries move within their side only
    side = torch.zeros_like(p.indices, dtype=torch.long) if p.topk_length is None else \
        (at >= p.topk_length.to(at.device)[:, None, None]).long().expand_as(p.indices)
    if name == "topk_order":
        key = torch.rand(p.indices.shape, generator=gen, device=p.query.device)
    else:  # minus1_moved: a stable sort putting -1 first, the valid entries in their order
        key = (p.indices != -1).to(torch.float32)
    order = torch.sort(side * 2 + key, dim=-1, stable=True).indices
    return dataclasses.replace(p, indices=torch.gather(p.indices, -1, order))
