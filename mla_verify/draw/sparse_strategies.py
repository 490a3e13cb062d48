"""Hypothesis strategies over a sparse envelope, and the sparse corner cases premerge runs first: each a ``Case``
(draw/strategies.py) of a sparse spec, the call's layout (out passed or not, as the envelope allows; the LSE
always asked) and one of the sparse metamorphic relations (problems/sparse.py's SPARSE_TRANSFORMS).

``sparse_specs`` shrinks toward the plainest problem: the envelope's first format and scale convention, its
smallest topk, one request of one query token and its fewest heads, 64-token pages (or the envelope's first
page size), two used pages and no spare ones, no -1 entries (then few, then many, then all), no -1 front, no
masked leading blocks (then 1, up to 4), no duplicates, no topk_length, no sink, the default softmax scale,
normal values and seed 0 -- each field shrinks on its own toward that end, so a shrunk failure names the one
feature it needs; ``sparse_cases`` adds the layout (toward the envelope's first) and the relation (toward none).
"""
from __future__ import annotations

from dataclasses import replace

from hypothesis import strategies as st

from ..problems.envelope import SparseEnvelope
from ..problems.sparse import SPARSE_LAYOUT, SPARSE_TRANSFORMS, SparseSpec
from .strategies import Case

INVALID_SHARES = (0.0, 0.05, 0.5, 0.95, 1.0)
PAGE_SIZES = (64, 1, 16, 61)  # 64 is what engines use; 1 (vLLM's fa3 path), 16 and an odd 61 move slot arithmetic
SOFTMAX_SCALES = (None, 0.25, 0.02)  # None: d_qk ** -0.5; a peaked and a flat softmax


@st.composite
def sparse_specs(draw: st.DrawFn, env: SparseEnvelope, max_batch: int = 4, max_topk: int = 512) -> SparseSpec:
    fmt = draw(st.sampled_from(env.formats))
    scales = draw(st.sampled_from(env.scales)) if fmt != "V4" else "pow2"
    batch = draw(st.integers(1, max_batch))
    topk = env.topk_multiple * draw(st.integers(1, max(1, min(env.max_topk, max_topk) // env.topk_multiple)))
    lengths = None
    if fmt in env.topk_length_formats and draw(st.booleans()):
        lengths = tuple(draw(st.lists(st.integers(0, topk), min_size=batch, max_size=batch)))
    pages = env.page_sizes or PAGE_SIZES
    return SparseSpec(
        batch=batch, q_len=draw(st.integers(*env.q_len)), num_heads=draw(_heads(env)), topk=topk,
        page_size=draw(st.sampled_from(pages)), used_pages=draw(st.integers(2, 8)),
        extra_pages=draw(st.integers(0, 3)), fmt=fmt, scales=scales, invalid=draw(st.sampled_from(INVALID_SHARES)),
        invalid_front=draw(st.booleans()), front_blocks=draw(st.integers(1, 4)) if draw(st.booleans()) else 0,
        duplicates=draw(st.booleans()), topk_lengths=lengths,
        sink=draw(st.sampled_from(("none", "finite", "+inf", "-inf", "mixed") if env.sinks else ("none",))),
        softmax_scale=draw(st.sampled_from(SOFTMAX_SCALES)), values=draw(st.sampled_from(("normal", "extreme"))),
        seed=draw(st.integers(0, 2 ** 16)))


def _heads(env: SparseEnvelope) -> st.SearchStrategy[int]:
    """The envelope's head counts: any of 1..max_heads (shrinking to 1), or those it names (to its fewest)."""
    return st.integers(1, env.max_heads) if env.heads is None else st.sampled_from(sorted(env.heads))


def _near(allowed: tuple[int, ...] | list[int], want: int) -> int:
    """The value of ``allowed`` nearest ``want`` (the smaller of two as near)."""
    return min(allowed, key=lambda v: (abs(v - want), v))


@st.composite
def sparse_cases(draw: st.DrawFn, env: SparseEnvelope) -> Case:
    """A sparse spec, the call's layout and one metamorphic relation (shrinking toward none)."""
    spec = draw(sparse_specs(env))
    layout = replace(SPARSE_LAYOUT, pass_out=draw(st.sampled_from(env.pass_out)))
    return Case(spec, layout, draw(st.sampled_from(("none", *SPARSE_TRANSFORMS))))


def sparse_corner_cases(env: SparseEnvelope) -> list[Case]:
    """The envelope's extremes, one feature each: every format and scale convention; all entries -1; a -1 front
    (a fully masked leading chunk); the first 1 and 4 top-k blocks of every row all -1 before valid ones (a kernel
    with no guard for a leading block of no key makes NaN); duplicates; topk_length 0 and cutting valid entries;
    each kind of sink; q_len > 1 with slots over many requests; the largest topk; extreme tiles; most heads -- and
    each metamorphic relation once: the pool's pages moved (with spare pages), a row's order, its -1 entries
    moved. Each is two requests of 16 heads, topk 64 over 64-token pages unless it says otherwise -- or the
    envelope's nearest (a kernel of one head count or one topk has every case at it); the sink of a case not about
    sinks is none for a kernel that takes none."""
    pages = env.page_sizes or PAGE_SIZES
    heads = env.heads or tuple(range(1, env.max_heads + 1))
    topks = tuple(range(env.topk_multiple, env.max_topk + 1, env.topk_multiple))
    base = SparseSpec(batch=2, num_heads=_near(heads, 16), topk=_near(topks, 64), page_size=_near(pages, 64),
                      used_pages=3, fmt=env.formats[0], scales=env.scales[0])
    largest = _near(topks, 2048)
    cases = [(replace(base, fmt=f, scales=s), "none") for f in env.formats for s in env.scales
             if f != "V4" or s == "pow2"]

    def sink(kind: str) -> str:  # where the case is not about its sink: none for a kernel that takes none
        return kind if env.sinks else "none"

    cases += [
        (replace(base, invalid=1.0, sink=sink("finite")), "none"),
        (replace(base, invalid_front=True, topk=_near(topks, 256), used_pages=8), "minus1_moved"),
        (replace(base, front_blocks=1, topk=_near(topks, 128), invalid=0.0), "none"),
        (replace(base, front_blocks=4, topk=_near(topks, 320), used_pages=8), "pages"),
        (replace(base, duplicates=True, used_pages=1, page_size=pages[-1]), "topk_order"),
        (replace(base, sink=sink("mixed"), extra_pages=2), "pages"),
        (replace(base, sink="+inf"), "none"),
        (replace(base, sink="-inf"), "none"),
        (replace(base, batch=4, q_len=env.q_len[1], page_size=pages[min(1, len(pages) - 1)], used_pages=8), "none"),
        # the largest topk over a pool a quarter larger (40 pages of 64 for 2048): half of a row's entries valid
        (replace(base, batch=1, topk=largest, used_pages=-(-5 * largest // (4 * base.page_size)), invalid=0.5),
         "none"),
        (replace(base, values="extreme", softmax_scale=0.02), "none"),
        (replace(base, batch=1, num_heads=max(heads)), "none"),
    ]
    cases += [(replace(base, fmt=f, topk=_near(topks, 128), topk_lengths=(0, 69)), "none")
              for f in env.topk_length_formats if f in env.formats]
    layout = replace(SPARSE_LAYOUT, pass_out=env.pass_out[-1])
    return [Case(c, layout, relation) for c, relation in cases if env.why_not(c, layout) is None]
