"""ProblemSpec: a small, hashable, serializable description of a decode problem, and its materialization.

Strategies draw specs; ``build_problem`` turns one into tensors deterministically (same spec, same device
type -> same bits). Unused cache slots -- the tail of each last page and every unused page -- hold NaN,
as FlashMLA's tests do, so a kernel that reads past a sequence poisons its own output.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..core.dims import MLADims
from ..core.errors import ProblemError
from .json_fields import FieldCheck, checked_fields, is_int, is_ints, is_number
from .layouts import page_counts, used_entries
from .problem import FP8, DecodeProblem

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64, "fp8": FP8}
# the last three reach the score range's edges on purpose (``_extreme``): every raw q.k of a row far below or far
# above a finite sentinel a kernel might start its running max at or mask with, or many keys tied at such a score
EXTREME_VALUES = ("far_below", "far_above", "near_ties")
VALUE_KINDS = ("normal", "outliers", "constant", "large", *EXTREME_VALUES)
# What fp8 problems are drawn with: not the extreme kinds. At |q.k| >= 1.5e5 the fp8 kernels' own arithmetic (e4m3
# operands, QK accumulated with terms truncated below the largest) leaves errors of the same size as their emulated
# baseline's but not below a fixed multiple of it: on an H100 FlashInfer fa2 and fa3 with fp8 caches and FlashMLA
# fp8 all failed just past their bound there and nowhere else (docs/judging.md, "Where kernels broke"), i.e. such
# a draw judged two independent roundings, not the kernel. The finite-sentinel class they stand for is drawn in
# bf16/fp16.
FP8_VALUE_KINDS = tuple(v for v in VALUE_KINDS if v not in EXTREME_VALUES)
SENTINEL = -5e4  # the finite running-max start (raw q.k) a widely used kernel shipped (docs/judging.md)
# |q.k| of an extreme row before any scale is at least this: three times that sentinel, and within fp8 e4m3's
# range (each rope value below 448)
EXTREME_DOT = 1.5e5
PAD_FILLS = ("zero", "garbage", "oob")


@dataclass(frozen=True)
class ProblemSpec:
    seq_lens: tuple[int, ...]
    q_len: int = 1
    num_heads: int = 16
    page_size: int = 64
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    dtype: str = "bf16"  # query and cache; the output is always compared in high precision
    softmax_scale: float | None = None  # None: 1/sqrt(qk_nope + qk_rope)
    q_scale: float = 1.0  # fp8 dequant scales; bmm1 = q_scale * k_scale * softmax_scale
    k_scale: float = 1.0  # one latent row is both K and V, so V's scale is k_scale
    bmm2_extra: float = 1.0  # any further output scale; bmm2 = k_scale * bmm2_extra
    extra_pages: int = 0  # unused (NaN-poisoned) pages in the pool
    shuffle_pages: bool = True
    table_pad: int = 0  # block-table columns beyond what the longest sequence needs
    pad_fill: str = "oob"  # what unused table entries hold: 0, ids of foreign pages, or out-of-range ids
    values: str = "normal"
    max_seq_len: int | None = None
    seed: int = 0
    window_left: int | None = None  # a sliding window (DecodeProblem.window_left); None: plain causal
    q_lens: tuple[int, ...] | None = None  # per-request query tokens, each 1..q_len (DecodeProblem.q_lens)

    @property
    def dims(self) -> MLADims:
        return MLADims(self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, 128, self.num_heads)

    @property
    def batch(self) -> int:
        return len(self.seq_lens)

    @property
    def bmm1_scale(self) -> float:
        base = self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(
            self.qk_nope_head_dim + self.qk_rope_head_dim)
        return self.q_scale * self.k_scale * base

    @property
    def bmm2_scale(self) -> float:
        return self.k_scale * self.bmm2_extra

    @property
    def total_tokens(self) -> int:
        return sum(self.seq_lens)

    @property
    def pool_pages(self) -> int:
        """The pages of the pool ``build_problem`` makes: every sequence's, the unused ones, and at least one (a
        batch of empty requests still has a NaN pool)."""
        return max(1, sum(-(-n // self.page_size) for n in self.seq_lens) + self.extra_pages)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["seq_lens"] = list(self.seq_lens)
        for key in ("window_left", "q_lens"):  # absent unless set, so the ids of specs without them never changed
            if d[key] is None:
                del d[key]
        if self.q_lens is not None:
            d["q_lens"] = list(self.q_lens)
        return d

    @classmethod
    def from_json(cls, d: Any) -> ProblemSpec:
        """The spec ``to_json`` wrote; a field of the wrong type is a ProblemError naming it (ranges are checked
        when the problem is built)."""
        d = checked_fields(d, _JSON_FIELDS, "spec")
        q_lens = d.get("q_lens")
        return cls(**{**d, "seq_lens": tuple(d["seq_lens"]), "q_lens": None if q_lens is None else tuple(q_lens)})

    def case_id(self) -> str:
        """Stable id: a hash of every parameter, the seed included."""
        blob = json.dumps(self.to_json(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def describe(self) -> str:
        lens: list[int | str] = list(self.seq_lens)
        shown = lens if len(lens) <= 8 else lens[:6] + ["..."] + lens[-1:]
        return (f"B={self.batch} H={self.num_heads} q_len={self.q_len} page={self.page_size} "
                f"dims=({self.kv_lora_rank},{self.qk_rope_head_dim}) {self.dtype} seq_lens={shown} "
                f"bmm1={self.bmm1_scale:.6g} bmm2={self.bmm2_scale:.6g} values={self.values} "
                f"pool=+{self.extra_pages} pad=+{self.table_pad}({self.pad_fill}) seed={self.seed}"
                + ("" if self.window_left is None else f" window_left={self.window_left}")
                + ("" if self.q_lens is None else f" q_lens={list(self.q_lens)}"))


# what each ProblemSpec field may hold in JSON: (check, what it says when the check fails)
_JSON_FIELDS: dict[str, FieldCheck] = {
    "seq_lens": (is_ints, "a non-empty list of integers"),
    "q_lens": (lambda v: v is None or is_ints(v), "null or a non-empty list of integers"),
    **{n: (is_int, "an integer") for n in ("q_len", "num_heads", "page_size", "kv_lora_rank", "qk_rope_head_dim",
                                         "qk_nope_head_dim", "extra_pages", "table_pad", "seed")},
    **{n: (lambda v: v is None or is_int(v), "null or an integer") for n in ("max_seq_len", "window_left")},
    **{n: (is_number, "a number") for n in ("q_scale", "k_scale", "bmm2_extra")},
    "softmax_scale": (lambda v: v is None or is_number(v), "null or a number"),
    "shuffle_pages": (lambda v: isinstance(v, bool), "true or false"),
    "dtype": (lambda v: v in DTYPES, f"one of {sorted(DTYPES)}"),
    # names: a drawn spec's are VALUE_KINDS and PAD_FILLS, a shadow reproducer's describe live tensors
    **{n: (lambda v: isinstance(v, str), "a string") for n in ("values", "pad_fill")},
}


def dtype_name(problem: DecodeProblem) -> str:
    """The tolerance model's dtype of a built problem: fp8 when the query or the cache is fp8 (what a spec's
    ``dtype`` says), else the query's."""
    if FP8 in (problem.query.dtype, problem.kv_cache.dtype):
        return "fp8"
    return next((name for name, dtype in DTYPES.items() if dtype == problem.query.dtype), "bf16")


def describing_spec(problem: DecodeProblem, values: str) -> ProblemSpec:
    """The spec whose parameters are this problem's (bmm1 as the softmax scale, bmm2 as the extra factor), for
    a problem no spec generated (a live call, a user's stored tensors): ``values`` says where its tensors come
    from, and, not being a VALUE_KINDS name, keeps ``build_problem`` from taking the spec for one that
    regenerates them."""
    p = problem
    used = p.pages_used()
    return ProblemSpec(seq_lens=tuple(p.seq_lens.tolist()), q_len=p.q_len, num_heads=p.num_heads,
                       page_size=p.page_size, kv_lora_rank=p.dims.kv_lora_rank,
                       qk_rope_head_dim=p.dims.qk_rope_head_dim, qk_nope_head_dim=p.dims.qk_nope_head_dim,
                       dtype=dtype_name(p), softmax_scale=p.bmm1_scale, bmm2_extra=p.bmm2_scale,
                       extra_pages=max(0, p.num_pages - int(used.sum())),
                       table_pad=p.block_table.shape[1] - int(used.max()), values=values,
                       max_seq_len=p.max_seq_len, window_left=p.window_left, q_lens=p.q_lens)


def build_problem(spec: ProblemSpec, device: torch.device | str = "cpu") -> DecodeProblem:
    """Materialize ``spec`` on ``device``; NaN in every cache slot no sequence owns."""
    device = torch.device(device)
    if spec.dtype not in DTYPES:
        raise ProblemError(f"dtype: {spec.dtype!r} is not one of {sorted(DTYPES)}")
    if spec.values not in VALUE_KINDS or spec.pad_fill not in PAD_FILLS:
        raise ProblemError(f"values/pad_fill: {spec.values!r}/{spec.pad_fill!r} not in {VALUE_KINDS}/{PAD_FILLS}")
    if spec.batch < 1 or spec.page_size < 1 or min(spec.seq_lens) < 0:
        raise ProblemError(f"seq_lens: need batch >= 1, page_size >= 1 and lengths >= 0, got {spec.describe()}")
    gen = torch.Generator(device=device)
    gen.manual_seed(spec.seed)
    dims, page, B = spec.dims, spec.page_size, spec.batch
    width = dims.head_dim_qk
    lens = torch.tensor(spec.seq_lens, dtype=torch.int32, device=device)
    pages_needed = page_counts(lens, page).tolist()
    used = sum(pages_needed)
    P = spec.pool_pages
    order = torch.randperm(P, generator=gen, device=device) if spec.shuffle_pages else torch.arange(P, device=device)
    W = max(1, max(pages_needed) + spec.table_pad)
    table = _padding(spec.pad_fill, (B, W), P, gen, device)
    used_mask = used_entries(lens, page, W)
    table[used_mask] = order[:used].to(torch.int32)

    dtype = DTYPES[spec.dtype]
    work = torch.float32
    q = _values(spec.values, (B, spec.q_len, spec.num_heads, width), gen, device, work, is_query=True)
    kv_tokens = _values(spec.values, (used * page, width), gen, device, work, is_query=False)
    if spec.values in EXTREME_VALUES:  # drawn as the values the kernel multiplies: no dequant scale divides them
        q, kv_tokens = _extreme(spec.values, q, kv_tokens, dims.qk_rope_head_dim, gen)
    elif dtype == FP8:
        q, kv_tokens = q / spec.q_scale, kv_tokens / spec.k_scale
    if dtype == FP8:
        q, kv_tokens = q.clamp(-448, 448), kv_tokens.clamp(-448, 448)
    pool = torch.full((P, page, width), float("nan"), dtype=work, device=device)
    slot_valid = (torch.arange(page, device=device)[None, :] + page * torch.arange(W, device=device)[:, None])
    valid = slot_valid[None, :, :] < lens[:, None, None]  # [B, W, page]: token slot holds a real token
    pool[table[used_mask].long()] = torch.where(
        valid[used_mask][..., None], kv_tokens.view(used, page, width), float("nan"))
    problem = DecodeProblem(q.to(dtype), pool.to(dtype), table, lens, dims, spec.bmm1_scale, spec.bmm2_scale,
                            spec.max_seq_len, spec.window_left, spec.q_lens)
    return problem.validate()


def _extreme(kind: str, q: torch.Tensor, kv: torch.Tensor, rope: int,
             gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Query and key rows whose raw q.k (before bmm1_scale) is far from zero: the rope dims (all dims without rope)
    of every query row are +-r * sqrt(EXTREME_DOT) * u and of every key row sqrt(EXTREME_DOT) * u, for one unit
    vector u and r in [1, 2) per query row, so each q.k is r * EXTREME_DOT plus the latent dims' own (unit-normal)
    product -- the same offset for every key of a row, which the softmax cancels: the probabilities and the output
    are those of normal values, and a correct kernel is as exact as on them. far_below: q.k <= -1.5e5 (opposite
    signs); far_above: >= +1.5e5; near_ties: far above, every key one of four rows (a thousandth of noise apart),
    so four groups of keys tie at the top. The same-precision baseline computes the very same rows (compare.py):
    the tolerance model stays what it is on normal values."""
    width = q.shape[-1]
    part = slice(width - rope, width) if rope else slice(0, width)
    if kind == "near_ties":
        kv = kv[torch.arange(kv.shape[0], device=kv.device) % 4] + 1e-3 * kv
    u = torch.randn(part.stop - part.start, generator=gen, device=q.device, dtype=q.dtype)
    u = u / u.norm()
    size = math.sqrt(EXTREME_DOT)
    r = 1 + torch.rand(q.shape[:-1] + (1,), generator=gen, device=q.device, dtype=q.dtype)
    q, kv = q.clone(), kv.clone()
    q[..., part] = (-1 if kind == "far_below" else 1) * size * r * u
    kv[..., part] = size * u
    return q, kv


def _padding(fill: str, shape: tuple[int, int], P: int, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    if fill == "zero":
        return torch.zeros(shape, dtype=torch.int32, device=device)
    if fill == "garbage":  # ids of real pages that belong to other sequences (or to nobody)
        return torch.randint(0, P, shape, generator=gen, device=device, dtype=torch.int32)
    big = torch.randint(P, 2**31 - 1, shape, generator=gen, device=device, dtype=torch.int32)
    return torch.where(torch.rand(shape, generator=gen, device=device) < 0.5, -1, big).to(torch.int32)


def _values(kind: str, shape: tuple[int, ...], gen: torch.Generator, device: torch.device,
            dtype: torch.dtype, is_query: bool) -> torch.Tensor:
    x = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    if kind == "outliers":  # ~0.1% of entries 30x larger: stresses max-subtraction and fp8 range
        spikes = torch.rand(shape, generator=gen, device=device) < 1e-3
        x = torch.where(spikes, x * 30, x)
    elif kind == "constant" and not is_query:  # near-identical keys: an almost uniform softmax
        x = x[:1].expand_as(x) + 1e-2 * x
    elif kind == "large" and is_query:  # scores of std ~9: a very peaked softmax
        x = x * 5
    return x
