"""Hypothesis strategies over a backend's envelope: one drawn ``Case`` = problem spec + layout + metamorphic check.

Strategies know nothing about FlashInfer: they read an ``Envelope`` and a per-device ``Budget``. Every choice
shrinks toward the plainest case (one short sequence, few heads, bf16, contiguous 3-D cache), so a failure is
reported as the smallest problem that still fails.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np
import torch
from hypothesis import strategies as st

from ..core.dims import R1_SOFTMAX_SCALE
from ..core.memory import memory_budget, spare_bytes
from ..problems.envelope import SPLIT_SIZES, Envelope
from ..problems.generate import FP8_VALUE_KINDS, PAD_FILLS, VALUE_KINDS, ProblemSpec
from ..problems.layouts import LayoutSpec
from ..problems.metamorphic import LARGE_POOL, TRANSFORMS
from .edges import declared_edges, split_edges

TP_HEADS = (128, 64, 32, 16, 8, 4, 2, 1)
TILE_EDGE_HEADS = (63, 65, 96, 127, 3, 5, 7, 9, 15, 17, 33)
DEFAULT_PAGE_SIZES = (1, 16, 32, 64)
T = TypeVar("T")


@dataclass
class Budget:
    """How big one case may be on a device, so that runs fit their time and memory.

    ``max_tokens`` (cached tokens, pool pages included) and ``max_rows`` (output rows: batch x q_len x heads)
    bound what a case's memory grows with (memory.py). After an out-of-memory error the engine lowers
    ``cap_tokens``/``cap_rows`` for the rest of the run; they clamp each drawn case afterwards (its lengths
    scaled down, its batch cut) rather than change what is drawn, since Hypothesis requires the same choices
    to draw the same way for the whole run.
    """

    units: int  # sum(seq_lens) * heads * q_len: the (query token, head, KV token) triples to compute
    max_batch: int
    max_seq_len: int
    max_tokens: int
    max_rows: int
    cap_tokens: int | None = None
    cap_rows: int | None = None
    spare_bytes: int = 0  # this process's share of the device's free memory at the start (0 on a CPU)

    def shrink_below(self, tokens: int, rows: int) -> None:
        """After an out-of-memory error on a case of ``tokens`` cached tokens and ``rows`` output rows: at most
        half of each from now on."""
        self.cap_tokens = max(1, min(self.cap_tokens or tokens, tokens // 2))
        self.cap_rows = max(1, min(self.cap_rows or rows, rows // 2))


# (units, max_batch, max_seq_len, max_tokens, max_rows) per device type
BUDGETS = {
    # 2e5 triples ~ 0.4 GFLOP a pass; a case makes ~5 passes (kernel, fp64 reference, baseline, repeat,
    # metamorphic), ~0.1-0.3 s on one 2-core CI machine. Tokens and rows are bounded by the units here.
    "cpu": (200_000, 1024, 1 << 17, 1 << 18, 1 << 18),
    # ~6e7 triples: B=128, H=128, ~3.6k tokens; a few ms of kernel and reference on an H200. At most 2^20
    # cached tokens (1.2 GB of bf16 cache) and 2^17 output rows (e.g. B=1024 x H=128): larger cases cost more
    # time and memory than they find bugs that the longest sequence (2^17) and the largest batch do not;
    # memory.memory_budget lowers both on a shared GPU.
    "cuda": (64_000_000, 1024, 1 << 17, 1 << 20, 1 << 17),
}


@dataclass(frozen=True)
class Case:
    """One case of any problem kind (mla_verify/kinds): its spec (a ProblemSpec, a SparseSpec), the call's
    layout and the metamorphic relation checked ("none": none)."""

    spec: Any
    layout: LayoutSpec
    transform: str = "none"


def budget_for(device: torch.device | str, max_seq_len: int | None = None) -> Budget:
    """A fresh budget for a run on ``device`` (on a GPU, sized from this process's share of free memory)."""
    device = torch.device(device)
    units, batch, longest, tokens, rows = BUDGETS["cuda" if device.type == "cuda" else "cpu"]
    longest = longest if max_seq_len is None else min(longest, max_seq_len)
    return Budget(units, batch, longest, *memory_budget(device, tokens, rows), spare_bytes=spare_bytes(device))


def cached_tokens(seq_lens: tuple[int, ...], page: int, extra_pages: int) -> int:
    """The cache rows a problem's pool holds: every sequence's whole pages and the unused ones."""
    return sum(-(-n // page) * page for n in seq_lens) + extra_pages * page


def clamp_lengths(lens: tuple[int, ...], page: int, q_len: int, heads: int, extra_pages: int,
                  cap_tokens: int | None, cap_rows: int | None) -> tuple[int, ...]:
    """``lens`` cut to at most ``cap_rows`` output rows and to ``cap_tokens`` cached tokens: the lengths scaled
    down (each at least ``q_len``), then requests dropped from the end while whole pages still exceed it. One
    request is always left. Unchanged without caps or when they fit."""
    def tokens(ns: tuple[int, ...]) -> int:
        return cached_tokens(ns, page, extra_pages)

    if cap_rows is not None:
        lens = lens[:max(1, cap_rows // (q_len * heads))]
    if cap_tokens is None or tokens(lens) <= cap_tokens:
        return lens
    scale = cap_tokens / tokens(lens)
    lens = tuple(max(q_len, int(n * scale)) for n in lens)
    while len(lens) > 1 and tokens(lens) > cap_tokens:
        lens = lens[:-1]
    return lens


# Drawing must cost far less than judging. Hypothesis validates every new strategy object it draws from (and
# reads the source of filter predicates), so the strategies below are built once: module constants, and
# integer ranges cached by their bounds. A choice between a named value and any value is a boolean and then
# one draw, not a one_of: it shrinks the same way (False: the named values, the first one first).
_BOOL = st.booleans()
_SEED = st.integers(0, 2**31 - 1)
_PROFILE_SEED = st.integers(0, 2**32 - 1)
_SOFTMAX = st.floats(0.02, 0.3)
_FP8_SCALE = st.floats(0.05, 4.0)
_BMM2 = st.floats(0.1, 4.0)
NAMED_SOFTMAX = (None, R1_SOFTMAX_SCALE)
NAMED_SCALES = (1.0, 0.5, 2.0)


@functools.cache
def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.integers(lo, hi)


def _pick(draw: st.DrawFn, items: Sequence[T]) -> T:
    """One of ``items``; shrinks toward the first."""
    return items[draw(_ints(0, len(items) - 1))] if len(items) > 1 else items[0]


def _named_or(draw: st.DrawFn, named: Sequence[T], anything: st.SearchStrategy[T]) -> T:
    """Mostly one of ``named`` (shrinking toward the first), else any value ``anything`` draws."""
    return draw(anything) if draw(_BOOL) or not named else _pick(draw, named)


def _heads(draw: st.DrawFn, env: Envelope) -> int:
    named, allowed = _head_choices(env)
    return _pick(draw, named) if named and not draw(_BOOL) else _pick(draw, allowed)


@functools.cache
def _head_choices(env: Envelope) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the TP and tile-edge head counts the envelope allows, every head count it allows)."""
    allowed = tuple(h for h in range(1, env.max_heads + 1) if env.allows_heads(h))
    return tuple(h for h in TP_HEADS[::-1] + TILE_EDGE_HEADS if h in allowed), allowed


def _seq_len(draw: st.DrawFn, page: int, lo: int, hi: int, window: int | None = None,
             declared: tuple[int, ...] = ()) -> int:
    """A length in [lo, hi] biased to the edges: the shortest, page-1, page, page+1, multiples of the page, the
    maximum, the first lengths a sliding window cuts, and the lengths the kernel declares fragile (edges.py).
    Shrinks to ``lo``."""
    return _named_or(draw, _edges(page, lo, hi, window, declared), _ints(lo, hi))


@functools.lru_cache(maxsize=4096)
def _edges(page: int, lo: int, hi: int, window: int | None = None, declared: tuple[int, ...] = ()) -> tuple[int, ...]:
    near: tuple[int, ...] = (lo, page - 1, page, page + 1, 2 * page, 2 * page + 1, 3 * page - 1, hi, *declared)
    if window is not None:  # query token i sees window + 1 positions: lengths past window + lo are cut
        near += (window, window + 1, window + lo, window + lo + 1, window + page + 1)
    return tuple(sorted({e for e in near if lo <= e <= hi}))


EXPLICIT_BATCH = 8  # up to this many requests the lengths are drawn one by one; above it, as a profile
LENGTH_PROFILES = ("equal", "uniform", "edges", "one_long")  # in shrinking order: the plainest first


def expand_lengths(profile: str, batch: int, page: int, lo: int, hi: int, seed: int,
                   declared: tuple[int, ...] = ()) -> tuple[int, ...]:
    """``batch`` lengths in [lo, hi] from a profile and a seed (numpy's generator: the same on every machine).

    equal: all ``hi``; uniform: uniform in [lo, hi]; edges: page edges, the ``declared`` lengths (edges.py) and
    ``hi`` (partial and full pages, one token past a page); one_long: all ``lo`` but one request at ``hi``.
    """
    rng = np.random.default_rng(seed)
    if profile == "equal":
        lens = np.full(batch, hi)
    elif profile == "uniform":
        lens = rng.integers(lo, hi + 1, batch)
    elif profile == "edges":
        lens = rng.choice(np.array(_edges(page, lo, hi, None, declared) or (hi,)), batch)
    elif profile == "one_long":
        lens = np.full(batch, lo)
        lens[rng.integers(batch)] = hi
    else:
        raise ValueError(f"unknown length profile {profile!r}; known: {LENGTH_PROFILES}")
    return tuple(int(n) for n in lens)


def _batch_lengths(draw: st.DrawFn, batch: int, page: int, lo: int, hi: int,
                   window: int | None = None, declared: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The requests' KV lengths in [lo, hi], one of them often ``hi``.

    Drawing cost does not grow with the batch: up to EXPLICIT_BATCH requests each length is drawn (and
    shrinks on its own toward ``lo`` and the page edges); a larger batch draws a length profile, a floor and a
    seed (expand_lengths), which shrink toward equal lengths, the smallest floor and seed 0. A failure that
    needs many requests thus stays readable, and one that does not shrinks to the explicit form.
    """
    if batch <= EXPLICIT_BATCH:
        lens = [_seq_len(draw, page, lo, hi, window, declared) for _ in range(batch)]
        if draw(_BOOL):  # one request at the case's maximum
            lens[_pick(draw, range(batch))] = hi
        return tuple(lens)
    profile = _pick(draw, LENGTH_PROFILES)
    floor = draw(_ints(lo, hi)) if draw(_BOOL) else lo
    return expand_lengths(profile, batch, page, floor, hi, draw(_PROFILE_SEED), declared)


# fp8 cases the fuzz profile draws as often as all others (``probes``): near-identical keys (every probability
# near 1, where e4m3 is coarsest) and one key (the LSE is then one scaled q.k: the QK product itself), each
# alone and both; they found FlashMLA fp8's arithmetic in the first seconds (issue #38)
FP8_PROBES = ("constant", "one_key", "both")


def _spec(draw: st.DrawFn, env: Envelope, budget: Budget, probes: bool = False) -> ProblemSpec:
    page = _pick(draw, env.page_sizes or DEFAULT_PAGE_SIZES)
    dtype = _pick(draw, env.dtypes)
    rank, rope = _pick(draw, env.dims_for(dtype))
    heads = _heads(draw, env)
    q_hi = max(env.q_len[0], min(env.q_len[1], int((budget.units // heads) ** 0.5),  # q_len tokens >= q_len
                                 budget.max_rows // heads))
    if env.q_lens is not None:
        q_len = _pick(draw, [q for q in env.q_lens if q <= q_hi] or [min(env.q_lens)])
    else:
        q_len = draw(_ints(env.q_len[0], q_hi)) if draw(_BOOL) else env.q_len[0]
    window = _pick(draw, env.windows)  # no draw for (None,): other envelopes' cases are unchanged
    declared = declared_edges(env, q_len)  # empty unless the kernel declares where it is fragile
    extra_pages = draw(_ints(0, 8))
    # cached tokens the sequences may take: the budget less the unused pages (at least one page)
    room = max(page, budget.max_tokens - extra_pages * page)
    # the longest sequence of this case, then a batch that fits the budget with it
    top = max(q_len, min(env.max_seq_len, budget.max_seq_len, budget.units // (heads * q_len), room))
    cap = _seq_len(draw, page, q_len, top, window, declared)
    max_b = max(1, min(env.max_batch, budget.max_batch, budget.units // (cap * heads * q_len),
                       room // (-(-cap // page) * page), budget.max_rows // (heads * q_len)))
    if env.batch_sizes is not None:
        batch = _pick(draw, [b for b in env.batch_sizes if b <= max_b] or [min(env.batch_sizes)])
    else:
        batch = draw(_ints(1, max_b if draw(_BOOL) else min(4, max_b)))
    # (after an OOM the clamp may cut a batch to a size outside env.batch_sizes: then its case is a skip)
    lens = clamp_lengths(_batch_lengths(draw, batch, page, q_len, cap, window, declared), page, q_len, heads,
                         extra_pages, budget.cap_tokens, budget.cap_rows)
    if env.empty_lse is not None:  # no draw otherwise
        lens = _emptied(draw, lens)
    q_lens = _q_lens(draw, len(lens), q_len) if env.ragged_q and q_len > 1 else None  # no draw otherwise
    softmax = _named_or(draw, NAMED_SOFTMAX, _SOFTMAX)
    q_scale = k_scale = 1.0
    if dtype == "fp8":  # realistic per-tensor scales, k_scale != 1 included
        q_scale = _named_or(draw, NAMED_SCALES, _FP8_SCALE)
        k_scale = _named_or(draw, NAMED_SCALES, _FP8_SCALE)
    probe = _pick(draw, FP8_PROBES) if probes and dtype == "fp8" and draw(_BOOL) else None
    if probe in ("one_key", "both"):  # every request q_len long: its first query token sees one key
        lens, q_lens = (q_len,) * len(lens), None
    return ProblemSpec(
        seq_lens=lens, q_len=q_len, num_heads=heads, page_size=page, kv_lora_rank=rank,
        qk_rope_head_dim=rope, dtype=dtype, softmax_scale=softmax, q_scale=q_scale, k_scale=k_scale,
        bmm2_extra=_named_or(draw, NAMED_SCALES, _BMM2), extra_pages=extra_pages,
        shuffle_pages=not draw(_BOOL), table_pad=draw(_ints(0, 4)), pad_fill=_pick(draw, PAD_FILLS),
        values="constant" if probe in ("constant", "both") else
        _pick(draw, FP8_VALUE_KINDS if dtype == "fp8" else VALUE_KINDS), seed=draw(_SEED),
        window_left=window, q_lens=q_lens)


def _emptied(draw: st.DrawFn, lens: tuple[int, ...]) -> tuple[int, ...]:
    """``lens`` with one request often emptied (kv_len 0, for an envelope that takes them); shrinks to none."""
    if not draw(_BOOL):
        return lens
    i = _pick(draw, range(len(lens)))
    return lens[:i] + (0,) + lens[i + 1:]


def _q_lens(draw: st.DrawFn, batch: int, q_len: int) -> tuple[int, ...] | None:
    """Per-request query lengths in 1..q_len, or None (every request q_len long), which they shrink toward: up to
    EXPLICIT_BATCH requests each is drawn as q_len less an amount that shrinks to 0; a larger
    batch takes them from a seed. None when all come out q_len."""
    if not draw(_BOOL):
        return None
    if batch <= EXPLICIT_BATCH:
        lens = [q_len - draw(_ints(0, q_len - 1)) for _ in range(batch)]
    else:
        lens = [int(n) for n in np.random.default_rng(draw(_PROFILE_SEED)).integers(1, q_len + 1, batch)]
    return None if min(lens) == q_len else tuple(lens)


def _layout(draw: st.DrawFn, env: Envelope) -> LayoutSpec:
    pad = draw(_ints(1, 8)) if env.page_strided and draw(_BOOL) else 0
    return LayoutSpec(cache_dims=_pick(draw, env.cache_dims), page_stride_pad=pad,
                      table_width=_pick(draw, env.table_widths), pass_out=_pick(draw, env.pass_out),
                      return_lse=env.lse and draw(_BOOL))


@st.composite
def specs(draw: st.DrawFn, env: Envelope, budget: Budget) -> ProblemSpec:
    """Problems inside ``env`` and ``budget``; each choice shrinks toward the plainest case."""
    return _spec(draw, env, budget)


# this process's share of free device memory from which pages past 2^32 elements are drawn: a bf16 pool of 8 GiB,
# its input snapshot, a strided layout's copy and the comparison's mask (the harness asks each case's own need)
LARGE_POOL_SPARE = 24 << 30


@st.composite
def cases(draw: st.DrawFn, env: Envelope, budget: Budget, probes: bool = False) -> Case:
    """A problem, its layout and one metamorphic check (shrinking toward none); ``probes``: half the fp8 cases are
    FP8_PROBES (shrinking toward the other half); pages past 2^32 elements only where the device has
    LARGE_POOL_SPARE to spare (no draw changes elsewhere)."""
    relations = TRANSFORMS + (LARGE_POOL,) if budget.spare_bytes >= LARGE_POOL_SPARE else TRANSFORMS
    return Case(_spec(draw, env, budget, probes), _layout(draw, env), _pick(draw, relations))


def corner_cases(env: Envelope, budget: Budget) -> list[Case]:
    """The premerge profile's explicit cases: the envelope's extremes, each with out passed and LSE asked.

    Cheap, discriminating cases come first (non-default scales, q_len > 1, the smallest page, a native-width
    table) so a faulty kernel is usually caught in seconds; the largest batch and longest sequence come last.
    """
    pages = env.page_sizes or DEFAULT_PAGE_SIZES
    small, large = min(pages), max(pages)
    rank, rope = env.dims[0]
    allowed = [h for h in range(1, env.max_heads + 1) if env.allows_heads(h)]
    h_min, h_max = min(allowed), max(allowed)
    h_few = min(allowed, key=lambda h: abs(h - 4))
    q_lo, q_hi = (min(env.q_lens), max(env.q_lens)) if env.q_lens else env.q_len
    window = env.windows[-1]
    full = LayoutSpec(cache_dims=max(env.cache_dims), page_stride_pad=5 if env.page_strided else 0,
                      table_width=env.table_widths[-1], pass_out=env.pass_out[0], return_lse=env.lse)
    native = LayoutSpec(cache_dims=min(env.cache_dims), table_width=env.table_widths[0],
                        pass_out=env.pass_out[0], return_lse=env.lse)
    r1: dict[str, Any] = dict(kv_lora_rank=rank, qk_rope_head_dim=rope, dtype=env.dtypes[0],
                              softmax_scale=R1_SOFTMAX_SCALE, extra_pages=3, table_pad=2, pad_fill="oob",
                              window_left=window)

    def fit(lens: list[int]) -> tuple[int, ...]:
        """The last of ``lens``, as many as the largest batch size allowed takes (repeated up to the smallest)."""
        n = min(len(lens), env.max_batch, budget.max_batch)
        if env.batch_sizes is not None:
            n = max([b for b in env.batch_sizes if b <= n] or [min(env.batch_sizes)])
            lens = lens * n
        return tuple(lens[-n:])

    def edges(page: int) -> tuple[int, ...]:
        near: tuple[int, ...] = (q_hi, q_hi + 1, page - 1, page, page + 1, 2 * page + 3)
        if window is not None:
            near += (window, window + 1, window + q_hi, window + page + 1)
        return fit(sorted({max(q_hi, n) for n in near}))

    # cached tokens left beside the unused pages; at least two pages, as _spec has it: on a GPU with little free
    # memory the budget can be smaller than the pages alone, and a case too big for it is a memory skip
    room = max(2 * large, budget.max_tokens - r1["extra_pages"] * large)
    longest = max(q_lo, min(env.max_seq_len, budget.max_seq_len, budget.units // (h_min * q_lo), room))
    # each of the widest batch's sequences (at most large + 1 tokens) takes up to two pages
    widest = len(fit([1] * max(1, min(env.max_batch, budget.max_batch, budget.units // (h_min * q_lo * (large + 1)),
                                      room // (2 * large), budget.max_rows // (h_min * q_lo)))))
    out = [
        Case(ProblemSpec(seq_lens=edges(small), q_len=q_hi, num_heads=h_few, page_size=small, bmm2_extra=1.5,
                         seed=1, **r1), native, "pages"),
        Case(ProblemSpec(seq_lens=edges(large), q_len=q_hi, num_heads=h_few, page_size=large, bmm2_extra=0.5,
                         seed=2, **r1), full, "table"),
        Case(ProblemSpec(seq_lens=fit([max(q_lo, min(3 * large + 1, budget.units // (h_max * 2 * q_lo))), 1 + q_lo]),
                         q_len=q_lo, num_heads=h_max, page_size=large, seed=3, **r1), full),
    ]
    if "fp8" in env.dtypes:
        fp8_rank, fp8_rope = env.dims_for("fp8")[0]
        out.append(Case(ProblemSpec(seq_lens=edges(large), q_len=q_lo, num_heads=h_few, page_size=large,
                                    q_scale=2.0, k_scale=0.5, bmm2_extra=1.5, seed=4,
                                    **{**r1, "dtype": "fp8", "kv_lora_rank": fp8_rank,
                                       "qk_rope_head_dim": fp8_rope}), full, "pool"))
    if env.ragged_q and q_hi > 1:  # requests of 1, q_hi and between tokens, in reversed order too
        lens = edges(small)
        steps = (1, q_hi, (1 + q_hi) // 2)
        out.append(Case(ProblemSpec(seq_lens=lens, q_len=q_hi, q_lens=tuple(steps[i % 3] for i in range(len(lens))),
                                    num_heads=h_few, page_size=small, bmm2_extra=1.5, seed=8, **r1), native, "batch"))
    for other_rank, other_rope in env.dims[1:]:
        out.append(Case(ProblemSpec(seq_lens=edges(small), q_len=q_lo, num_heads=h_few, page_size=small, seed=5,
                                    **{**r1, "kv_lora_rank": other_rank, "qk_rope_head_dim": other_rope}), full))
    out += _tile_corners(env, budget, allowed, fit, r1, native)
    out += _shipped_bug_corners(env, budget, (h_few, h_min), q_hi, fit, r1, native)
    out += _declared_corners(env, budget, (h_few, h_min), fit, r1, native)
    out += [
        Case(ProblemSpec(seq_lens=tuple(max(q_lo, i % (large + 1) + 1) for i in range(widest)), q_len=q_lo,
                         num_heads=h_min, page_size=large, seed=6, **r1), full, "batch"),
        Case(ProblemSpec(seq_lens=(longest,), q_len=q_lo, num_heads=h_min, page_size=large, seed=7, **r1), full),
    ]
    return out


TILE_ROWS = (64, 128)  # query rows (q_len x heads) and KV tokens at which kernels change tiles


def _tile_corners(env: Envelope, budget: Budget, heads: list[int], fit: Callable[[list[int]], tuple[int, ...]],
                  r1: dict[str, Any], layout: LayoutSpec) -> list[Case]:
    """Where kernels change tiles: q_len x heads just past 64 and 128 rows (several query tokens where the
    envelope allows them, so the causal mask is in play), with sequences at page and tile ends +-1."""
    q_lens = env.q_lens or tuple(range(env.q_len[0], env.q_len[1] + 1))
    page = min(env.page_sizes or DEFAULT_PAGE_SIZES)
    found: list[Case] = []
    for i, rows in enumerate(TILE_ROWS):
        # the fewest rows past the tile, most query tokens first: q_len x heads = rows + 1 where it can be
        pairs = sorted(((q * h, -q, q, h) for q in q_lens for h in heads if q * h > rows), key=lambda x: x[:2])
        if not pairs:
            continue
        _, _, q, h = pairs[0]
        near = {page - 1, page, page + 1, *(t + d for t in TILE_ROWS for d in (-1, 0, 1))}
        lens = fit(sorted(n for n in near if q <= n <= min(env.max_seq_len, budget.max_seq_len)))
        spec = ProblemSpec(seq_lens=lens, q_len=q, num_heads=h, page_size=page, seed=10 + i, **r1)
        if lens and sum(lens) * q * h <= budget.units and len(lens) * q * h <= budget.max_rows \
                and env.why_not(spec, layout) is None:
            found.append(Case(spec, layout))
    return found



def _shipped_bug_corners(env: Envelope, budget: Budget, heads: tuple[int, ...], q_hi: int,
                         fit: Callable[[list[int]], tuple[int, ...]], r1: dict[str, Any],
                         layout: LayoutSpec) -> list[Case]:
    """Where released MLA decode kernels broke (docs/judging.md, "Where kernels broke"), each once: rows whose raw
    q.k all lie far below, and far above, any finite sentinel, and four keys tied there (generate.py's
    EXTREME_VALUES); sequences at the edges of 64- to 1024-token splits with several query tokens, so that the
    first rows see none of the last split; a request with no key where the envelope takes one; and the pages moved
    past 2^31 and 2^32 elements of the pool (a skip with its reason on a device without the memory)."""
    page = min(env.page_sizes or DEFAULT_PAGE_SIZES)
    q = max([n for n in (env.q_lens or range(env.q_len[0], env.q_len[1] + 1)) if n <= 4] or [env.q_len[0]])
    short = fit([max(q_hi, page + 1), max(q_hi, 2 * page + 3)])  # two requests, a partial page each
    found = [Case(ProblemSpec(seq_lens=short, q_len=q_hi, num_heads=heads[0], page_size=page, values=values,
                              seed=30 + i,
                              **r1), layout, relation)
             for i, (values, relation) in enumerate((("far_below", "none"), ("far_above", "pages"),
                                                     ("near_ties", "batch")))
             if r1["dtype"] != "fp8"]  # generate.py's FP8_VALUE_KINDS says why
    # S + 1 .. S + q - 1 for q tokens (at most 4: rows 0..q-2 see none of the last split; q 1: S + 1, a one-token
    # split), as many as the budget takes
    lens, h = _fitting([n for size in SPLIT_SIZES for n in split_edges((size,), q, (1,))
                        if size < n <= min(env.max_seq_len, budget.max_seq_len)], q, heads, budget)
    found.append(Case(ProblemSpec(seq_lens=fit(lens), q_len=q, num_heads=h, page_size=page, seed=33, **r1), layout))
    if env.empty_lse is not None:  # an empty request between two others, and one alone at the end
        found.append(Case(ProblemSpec(seq_lens=fit([q_hi + 1, 0, max(q_hi, 2 * page + 3), 0]), q_len=q_hi,
                                      num_heads=heads[0], page_size=page, seed=34, **r1), layout, "batch"))
    found.append(Case(ProblemSpec(seq_lens=short, q_len=q_hi, num_heads=heads[0], page_size=page, seed=35, **r1),
                      replace(layout, page_stride_pad=0), LARGE_POOL))
    return [c for c in found if c.spec.seq_lens and env.why_not(c.spec, c.layout) is None
            and c.spec.total_tokens * c.spec.q_len * c.spec.num_heads <= budget.units]


def _declared_corners(env: Envelope, budget: Budget, heads: tuple[int, ...],
                      fit: Callable[[list[int]], tuple[int, ...]], r1: dict[str, Any],
                      layout: LayoutSpec) -> list[Case]:
    """Where the kernel says it is fragile (edges.declared_edges: its splits' edges, its special lengths): one
    batch of sequences at those lengths for the fewest query tokens, for two (one speculative token, the
    commonest multi-token decode) and for the most, on the smallest page, as many as the budget takes
    (``_fitting``). None when it declares nothing."""
    q_lens = env.q_lens or tuple(range(env.q_len[0], env.q_len[1] + 1))
    page = min(env.page_sizes or DEFAULT_PAGE_SIZES)
    found: list[Case] = []
    for i, q in enumerate(sorted({q for q in (min(q_lens), 2, max(q_lens)) if q in q_lens})):
        lens, h = _fitting([n for n in declared_edges(env, q) if q <= n <= min(env.max_seq_len, budget.max_seq_len)],
                           q, heads, budget)
        batch = fit(lens)
        spec = ProblemSpec(seq_lens=batch, q_len=q, num_heads=h, page_size=page, seed=20 + i, **r1)
        if batch and sum(batch) * q * h <= budget.units and env.why_not(spec, layout) is None:
            found.append(Case(spec, layout))
    return found


def _fitting(lens: list[int], q: int, heads: tuple[int, ...], budget: Budget) -> tuple[list[int], int]:
    """One batch of ``lens`` (ascending) at ``q`` query tokens: the first of ``heads`` with which all of them fit
    the budget, else the last, the longest lengths left out until the rest fit."""
    h = next((h for h in heads if sum(lens) * q * h <= budget.units), heads[-1])
    while lens and (sum(lens) * q * h > budget.units or len(lens) * q * h > budget.max_rows):
        lens = lens[:-1]
    return lens, h
