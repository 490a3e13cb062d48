"""Which known misreading explains a failing kernel's output?

Each catalog entry recomputes the reference under one misreading -- mostly by handing
``reference_decode`` a transformed problem (cache rows rolled to [rope | latent], seq_lens off by one, the
pool re-viewed with another page size, ...) so the reference stays the single source of the arithmetic --
and the entries whose result matches the kernel's output are reported, best first.

An entry *explains* the output by explains.py's rule, the one every kind's catalogue is held to: within
``OUT_TOL`` (2e-2 for bf16: a correct bf16 kernel sits near 2e-3 against an exact reference -- bf16 output
rounding alone is ~1e-3 -- so 10x leaves room for any sane accumulation order, while every misreading in the
catalog moves the output by far more on the problems the suite draws) and ``TRUTH_MARGIN`` times closer than the
correct reference; a match through NaN only once a re-run of the kernel confirms it; several at once told apart
by re-running the kernel with each sequence a token or two shorter (where the misread lengths part), else named
as candidates this case cannot tell apart (``CANDIDATES``).
The LSE entries use compare.py's LSE tolerance (a base mix-up misses it by a factor ~1.44).
An fp8 problem is recomputed in bf16 (``exact_bf16``: the same values, and the operations fp8 lacks on
CUDA, such as ``roll``, work).

``diagnose_safely`` is what the harness calls: the explanations as lines or, when none fits, where the output
is wrong (localize.py); any error inside becomes one "diagnosis failed: ..." line.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import replace

import torch

from ..core.dims import R1_YARN_FACTOR, yarn_mscale
from ..core.errors import ProblemError
from ..core.memory import is_out_of_memory, release_cached
from ..core.tracebacks import exception_line
from ..problems.arithmetic import DEFAULT, Arithmetic
from ..problems.envelope import SPLIT_SIZES
from ..problems.generate import SENTINEL
from ..problems.layouts import padded_width
from ..problems.problem import FP8, DecodeProblem
from ..problems.reference import ReferenceResult, reference_decode
from .compare import judged_rows, lse_allowed
from .explains import (
    CANDIDATES,
    FAILED,
    OUT_METRIC,
    OUT_TOL,
    SKIPPED,
    WHERE,
    Explanation,
    Rerun,
    exact_bf16,
    explaining,
    explanation_lines,
    finite_poison,
    relative_error,
)

__all__ = ["CANDIDATES", "CATALOG", "Explanation", "LSE_BASES", "OUT_METRIC", "WHERE", "diagnose", "diagnose_safely",
           "explained", "relative_error", "says_more"]

PAGE_SIZES = (16, 32, 64, 128)  # page sizes a kernel may assume instead of reading the cache shape
FP32_EXP_FLOOR = math.log(torch.finfo(torch.float32).tiny)  # -87.3: exp below it flushes to 0 on a GPU
R1_MSCALE_SQ = yarn_mscale(R1_YARN_FACTOR) ** 2
SHORTER = (1, 2)  # tokens cut from every sequence to tell candidates apart (full-page read vs one token more)


Recompute = Callable[[DecodeProblem, ReferenceResult], "torch.Tensor | None"]  # None: not applicable here


def _solve(p: DecodeProblem) -> torch.Tensor | None:
    """The reference output of a transformed problem, or None when the misreading makes it malformed."""
    try:  # validated as if q_len were 1: a misread length may leave early query tokens nothing to see,
        # which a kernel turns into NaN rows just as the reference does, so that is no reason to give up
        replace(p, query=p.query[:, :1], q_lens=None).validate()
    except ProblemError:
        return None
    # fp32 is ~1e-5 from fp64 (reference.py): three orders below OUT_TOL, and twice as fast.
    return reference_decode(p, precision=torch.float32).out


def _rope_first(cache: bool, query: bool) -> Recompute:
    def recompute(p: DecodeProblem, truth: ReferenceResult) -> torch.Tensor | None:
        R = p.dims.qk_rope_head_dim
        roll = lambda t: t.roll(-R, dims=-1)  # noqa: E731 - rows as the kernel takes them
        return _solve(replace(p, kv_cache=roll(p.kv_cache) if cache else p.kv_cache,
                              query=roll(p.query) if query else p.query))
    return recompute


def _page_size(size: int) -> Recompute:
    def recompute(p: DecodeProblem, truth: ReferenceResult) -> torch.Tensor | None:
        if size == p.page_size:
            return None
        flat = p.kv_cache.reshape(-1, p.kv_cache.shape[-1])
        rows = flat.shape[0] // size * size
        return _solve(replace(p, kv_cache=flat[:rows].view(-1, size, flat.shape[-1]))) if rows else None
    return recompute


def _length(fn: Callable[[torch.Tensor, int], torch.Tensor]) -> Recompute:
    def recompute(p: DecodeProblem, truth: ReferenceResult) -> torch.Tensor | None:
        lens = fn(p.seq_lens, p.page_size).to(torch.int32)
        return None if torch.equal(lens, p.seq_lens) else _solve(replace(p, seq_lens=lens, max_seq_len=None))
    return recompute


def _bmm1(fn: Callable[[DecodeProblem], float]) -> Recompute:
    def recompute(p: DecodeProblem, truth: ReferenceResult) -> torch.Tensor | None:
        scale = fn(p)
        # 1e-6: the scales are equal up to float formatting, so the misreading is no misreading here
        return None if math.isclose(scale, p.bmm1_scale, rel_tol=1e-6) else _solve(replace(p, bmm1_scale=scale))
    return recompute


def _bmm2(power: int) -> Recompute:
    def recompute(p: DecodeProblem, truth: ReferenceResult) -> torch.Tensor | None:
        return None if p.bmm2_scale in (0.0, 1.0) else truth.out * p.bmm2_scale ** (power - 1)
    return recompute


def _causal_off(p: DecodeProblem, truth: ReferenceResult) -> torch.Tensor | None:
    """Non-causal attention = each query token as an extra head of a q_len-1 request (it sees everything)."""
    B, Q, H, D = p.query.shape
    if Q == 1:
        return None
    out = _solve(replace(p, query=p.query.reshape(B, 1, Q * H, D), dims=p.dims.with_heads(Q * H), q_lens=None))
    return None if out is None else out.view(B, Q, H, -1)


def _table(fn: Callable[[DecodeProblem], torch.Tensor | None]) -> Recompute:
    def recompute(p: DecodeProblem, truth: ReferenceResult) -> torch.Tensor | None:
        table = fn(p)
        used = p.used_entries()
        if table is None or torch.equal(torch.where(used, table, 0), torch.where(used, p.block_table, 0)):
            return None
        return _solve(replace(p, block_table=table.to(torch.int32)))
    return recompute


def _padded_stride(p: DecodeProblem) -> torch.Tensor | None:
    """Row b read from flat offset b * (width padded to 128/page); -1 past the end of the table."""
    B, W = p.block_table.shape
    stride = padded_width(W, p.page_size)
    idx = torch.arange(B, device=p.device)[:, None] * stride + torch.arange(W, device=p.device)[None, :]
    flat = p.block_table.reshape(-1)
    return torch.where(idx < flat.numel(), flat[idx.clamp(max=flat.numel() - 1)], -1)


def _sorted_pages(p: DecodeProblem) -> torch.Tensor:
    used = p.used_entries()
    big = torch.iinfo(torch.int32).max
    return torch.where(used, torch.where(used, p.block_table, big).sort(dim=1).values, p.block_table)


def _heads_reversed(p: DecodeProblem, truth: ReferenceResult) -> torch.Tensor | None:
    return None if p.num_heads == 1 else truth.out.flip(2)


def _finite_sentinel(value: float) -> Recompute:
    def recompute(p: DecodeProblem, truth: ReferenceResult) -> torch.Tensor | None:
        """``value`` in the rows whose every exp((raw q.k - SENTINEL) x bmm1) underflows fp32: the row's LSE (at
        least its largest scaled score) lies more than FP32_EXP_FLOOR below SENTINEL x bmm1 (bmm1 > 0 orders raw
        and scaled scores alike)."""
        if p.bmm1_scale <= 0:
            return None
        lost = truth.lse - SENTINEL * p.bmm1_scale < FP32_EXP_FLOOR
        return truth.out.masked_fill(lost[..., None], value) if bool(lost.any()) else None
    return recompute


def _empty_split(size: int) -> Recompute:
    def recompute(p: DecodeProblem, truth: ReferenceResult) -> torch.Tensor | None:
        """NaN in the rows that see no key of their sequence's last ``size``-token split (a causal limit before
        its start: a split finalised as 0/0)."""
        lens = p.seq_lens.long()[:, None]
        last_visible = lens - p.request_q_lens()[:, None] + torch.arange(p.q_len, device=p.device)
        hidden = (size * ((lens - 1) // size) > last_visible) & (lens > 0)  # [B, q_len]
        return truth.out.masked_fill(hidden[..., None, None], float("nan")) if bool(hidden.any()) else None
    return recompute


CATALOG: dict[str, tuple[str, Recompute]] = {
    "cache_rope_first": ("reads cache rows as [rope | latent] instead of [latent | rope]", _rope_first(True, False)),
    "query_rope_first": ("reads the query as [rope | latent] instead of [latent | rope]", _rope_first(False, True)),
    "both_rope_first": ("reads query and cache rows as [rope | latent]", _rope_first(True, True)),
    **{f"page_size_{s}": (f"assumes {s}-token pages instead of the cache's page size", _page_size(s))
       for s in PAGE_SIZES},
    "length_minus_1": ("attends to seq_len - 1 tokens", _length(lambda n, page: n - 1)),
    "length_plus_1": ("attends to seq_len + 1 tokens", _length(lambda n, page: n + 1)),
    "partial_page_dropped": ("drops the last partial page (whole pages only)",
                             _length(lambda n, page: n // page * page)),
    "full_page_read": ("reads past seq_len to the end of the last page",
                       _length(lambda n, page: -(-n // page) * page)),
    "scale_1_sqrt_576": ("uses softmax scale 1/sqrt(576) instead of bmm1_scale", _bmm1(lambda p: 1 / math.sqrt(576))),
    "scale_1_sqrt_192": ("uses a fixed 1/sqrt(qk_nope + qk_rope) instead of bmm1_scale (YaRN / fp8 scales dropped)",
                         _bmm1(lambda p: 1 / math.sqrt(p.dims.qk_nope_head_dim + p.dims.qk_rope_head_dim))),
    "yarn_mscale_missing": ("bmm1_scale lacks DeepSeek-R1's YaRN mscale^2",
                            _bmm1(lambda p: p.bmm1_scale / R1_MSCALE_SQ)),
    "yarn_mscale_twice": ("bmm1_scale has DeepSeek-R1's YaRN mscale^2 applied twice",
                          _bmm1(lambda p: p.bmm1_scale * R1_MSCALE_SQ)),
    "bmm2_missing": ("ignores bmm2_scale", _bmm2(0)),
    "bmm2_doubled": ("applies bmm2_scale twice", _bmm2(2)),
    "causal_off": ("ignores the causal mask: every query token sees the whole sequence", _causal_off),
    "table_stride_pad128": ("reads block-table rows with a stride padded to a multiple of 128/page",
                            _table(_padded_stride)),
    "table_row_next": ("sequence b reads block-table row b+1", _table(lambda p: p.block_table.roll(-1, 0))),
    "pages_sorted": ("visits pages in physical order instead of block-table order", _table(_sorted_pages)),
    "heads_reversed": ("writes head h's result to head H-1-h", _heads_reversed),
    **{f"finite_max_init{suffix}": (f"starts the running max at a finite {SENTINEL:g} (raw q.k): rows whose raw "
                                    f"scores all lie below it lose every key and come out {said}",
                                    _finite_sentinel(value))
       for suffix, said, value in (("", "0", 0.0), ("_nan", "0/0 (NaN)", math.nan))},
    **{f"empty_split_{s}": (f"finalises a {s}-token split with no visible key as 0/0 (no l == 0 guard): NaN in "
                            "the rows that see none of their sequence's last split", _empty_split(s))
       for s in SPLIT_SIZES},
}
LSE_BASES = {"lse_natural": (math.e, "returns the LSE in natural log"), "lse_base2": (2.0, "returns the LSE in base 2")}


def diagnose(problem: DecodeProblem, kernel_out: torch.Tensor, kernel_lse: torch.Tensor | None = None,
             lse_base: float = 2.0, truth: ReferenceResult | None = None,
             rerun: Rerun | None = None) -> list[Explanation]:
    """Catalog entries that explain ``kernel_out`` [B, q_len, H, L] (any float dtype) and ``kernel_lse``
    [B, q_len, H] (in ``lse_base``) while the correct reference does not; best first.

    ``truth`` (the reference of ``problem``) saves one recomputation when the caller already has it; ``rerun``
    runs the kernel on another problem, to confirm a match that leans on NaN and to tell candidates apart.
    """
    tol = OUT_TOL["fp8" if problem.query.dtype == FP8 else "other"]
    problem = exact_bf16(problem)
    truth = truth if truth is not None else reference_decode(problem, precision=torch.float32)
    names = list(CATALOG)
    if problem.num_heads > 2:
        # Screen on heads {0, H-1} first: every misreading acts on each head alike (the set is symmetric, so
        # reversing heads maps it onto itself), and the recomputation costs ~H/2 times less.
        heads = torch.tensor([0, problem.num_heads - 1], device=problem.device)
        sub = replace(problem, query=problem.query[:, :, heads], dims=problem.dims.with_heads(2))
        sub_truth = ReferenceResult(truth.out[:, :, heads], truth.lse[:, :, heads], truth.valid)
        names = [n for n in names if _error(n, sub, kernel_out[:, :, heads], sub_truth) < tol]
    found = explaining(DENSE_CATALOGUE, problem, kernel_out, truth, names, rerun, tol)
    if kernel_lse is not None:
        natural = kernel_lse.detach().to(torch.float64) * math.log(lse_base)
        truth_lse_error = _lse_error(natural, truth.lse, truth)
        for name, (base, description) in LSE_BASES.items():
            if base == lse_base or not truth_lse_error > 1:
                continue
            # the kernel returned base-`base` values that we read as lse_base: undo that reading
            error = _lse_error(natural, truth.lse * math.log(lse_base) / math.log(base), truth)
            if error <= 1:
                found.append(Explanation(name, f"{description} where base {lse_base:g} is promised", error,
                                         truth_lse_error, "LSE error / tolerance"))
    return sorted(found, key=lambda e: (e.metric != OUT_METRIC, e.error))


def diagnose_safely(problem: DecodeProblem, out: torch.Tensor, lse: torch.Tensor | None = None,
                    lse_base: float = 2.0, truth: ReferenceResult | None = None,
                    rerun: Rerun | None = None, arithmetic: Arithmetic = DEFAULT) -> list[str]:
    """The catalog's explanations of a failing output, else localize.py's lines on where it is wrong; never
    raises (but KeyboardInterrupt): an error inside is reported as one line, the verdict stands without it.
    ``rerun`` runs the kernel on another problem (localize.py uses it to tell where a NaN comes from);
    ``arithmetic``: the kernel's declared one, which localize.py's row-by-row tolerance emulates."""
    from .localize import localize  # localize builds on this module's bar for a match

    try:
        truth = truth if truth is not None else reference_decode(exact_bf16(problem), precision=torch.float32)
        found = diagnose(problem, out, lse, lse_base, truth, rerun)
        if found:
            return explanation_lines(DENSE_CATALOGUE, found)
        return localize(problem, out, truth, lse, lse_base, rerun, arithmetic)
    except Exception as exc:  # noqa: BLE001 - diagnosis is advice: it must never turn a verdict into a crash
        if is_out_of_memory(exc):
            release_cached(problem.device)
            return [f"{SKIPPED}out of device memory"]
        return [f"{FAILED}{exception_line(exc)}"]


def explained(lines: list[str]) -> bool:
    """Whether ``diagnose_safely``'s lines name a catalogued misreading (not only where the output is wrong)."""
    return any(not line.startswith((WHERE, FAILED, SKIPPED, CANDIDATES)) for line in lines)


def says_more(lines: list[str], than: list[str]) -> bool:
    """Whether diagnosis ``lines`` tell more than ``than``: one misreading named beats candidates this case
    cannot tell apart, which beat none; a key rule that fits, and a rule naming the wrong rows by a property
    (seq_len, position) or a mapping, beat their absence."""
    def weight(ds: list[str]) -> int:
        alone = explained(ds) and not any(d.startswith(CANDIDATES) for d in ds)
        return (8 * alone + 4 * explained(ds)
                + 2 * any("keys: " in d and (" matches out " in d or "keys: none" in d) for d in ds)
                + any(" swapped" in d or " holds " in d or "batch entries with" in d or "query tokens at positions" in d
                      for d in ds))
    return weight(lines) > weight(than)


def _shorter(p: DecodeProblem, cut: int) -> DecodeProblem | None:
    """``p`` with every sequence ``cut`` tokens shorter (finite values in its poisoned slots), or None where a
    sequence would be shorter than its query tokens."""
    lens = p.seq_lens - cut
    if bool((lens < p.request_q_lens().to(lens.device)).any()) or bool((lens < 1).any()):
        return None
    moved = replace(p, seq_lens=lens.to(torch.int32), max_seq_len=None)
    try:
        moved.validate()
    except ProblemError:
        return None
    return finite_poison(moved) or moved


def _error(name: str, problem: DecodeProblem, out: torch.Tensor, truth: ReferenceResult) -> float:
    """``out`` against catalog entry ``name`` recomputed on ``problem`` (on the rows compare.py judges); inf where
    it does not apply."""
    candidate = CATALOG[name][1](problem, truth)
    return math.inf if candidate is None else relative_error(judged_rows(out, truth), judged_rows(candidate, truth))


def _lse_error(natural: torch.Tensor, want: torch.Tensor, truth: ReferenceResult) -> float:
    """max |lse - want| / (the fixed part of compare.py's LSE bound), in natural-log units, over the rows judged;
    inf on a NaN mismatch."""
    want = want.to(torch.float64).to(natural.device)
    ratio = judged_rows((natural - want).abs() / lse_allowed(want, 0.0), truth)
    return float(torch.nan_to_num(ratio, nan=math.inf).max()) if ratio.numel() else 0.0


class _DenseCatalogue:
    """CATALOG as explains.py's rule takes it (explains.Catalogue)."""

    nearby_words = " and on its sequences a token or two shorter"

    def description(self, name: str) -> str:
        return CATALOG[name][0]

    def error(self, name: str, problem: DecodeProblem, out: torch.Tensor, truth: ReferenceResult) -> float:
        return _error(name, exact_bf16(problem), out, truth)

    def finite_poison(self, problem: DecodeProblem) -> DecodeProblem | None:
        return finite_poison(problem)

    def nearby(self, problem: DecodeProblem) -> Iterator[DecodeProblem]:
        for cut in SHORTER:
            q = _shorter(problem, cut)
            if q is not None:
                yield q

    def reference(self, problem: DecodeProblem) -> ReferenceResult:
        return reference_decode(exact_bf16(problem), precision=torch.float32)


DENSE_CATALOGUE = _DenseCatalogue()
