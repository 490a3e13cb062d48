"""Verdict and diagnosis of one sparse decode result against the sparse reference.

The verdict (``judge_sparse``): out must be finite; exactly 0 where the reference is exactly 0 (a row with no
valid entry, a head whose sink is +inf); within ``REL_L2_TOL`` of the reference as a whole and ``ROW_TOL`` in
every row; the LSE +inf exactly where the reference's is, elsewhere within compare.py's LSE bound.

The diagnosis (``diagnose_sparse``): each catalog entry recomputes the reference under one misreading of the
sparse contract -- mostly a transformed problem handed to ``sparse_reference``, so the reference stays the one
source of the arithmetic -- and the entries that explain the kernel's result are named, by the dense
diagnosis's rule (explains.py: within ``OUT_TOL`` with non-finite values at the same places, and ``TRUTH_MARGIN``
times closer than the truth). The sink-in-LSE entry is judged on the LSE.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from ..problems.packed import FORMATS, FP8, dequantize, next_tile, truncated_to_pow2
from ..problems.reference import ReferenceResult
from ..problems.sparse import SparseDecodeProblem
from ..problems.sparse_reference import sparse_reference
from .compare import lse_allowed
from .diagnose import relative_error
from .explains import OUT_TOL, TRUTH_MARGIN

# A correct kernel rounds out to bf16 (relative 2^-9 an element, ~1.1e-3 in rel L2) and sums fp32 products of the
# same bf16 values the reference uses (the SM90 dequant is modelled): FlashMLA's SM90 sparse decode measured 2e-3
# on the H200 (issue 30). 1e-2 leaves 5x; every misreading in the catalog is off by more on its trigger.
REL_L2_TOL = 1e-2
# One row (a request's token and head) may be off by more than the whole -- bf16 rounding of a row of few large
# values -- but a wrong row (a head's sink ignored, one row's entries misread) is off by far more than 3e-2.
ROW_TOL = 3e-2


def judge_sparse(problem: SparseDecodeProblem, out: torch.Tensor, lse: torch.Tensor | None,
                 ref: ReferenceResult) -> list[str]:
    """The failures of (out [B, q_len, H, 512], natural lse [B, q_len, H] or None): empty when it passes."""
    if tuple(out.shape) != tuple(ref.out.shape):
        return [f"out has shape {tuple(out.shape)}, expected {tuple(ref.out.shape)}"]
    failures = []
    o, r = out.detach().double().cpu(), ref.out.double().cpu()
    bad = ~torch.isfinite(o)
    if bool(bad.any()):
        at = [int(x) for x in bad.nonzero()[0]]
        failures.append(f"{int(bad.sum())} non-finite values in out (first at [b, token, head, dim] = {at})")
    zero_rows = (r == 0).all(-1)
    stray = zero_rows & (o != 0).any(-1)
    if bool(stray.any()):
        at = [int(x) for x in stray.nonzero()[0]]
        failures.append(f"{int(stray.sum())} rows are not 0 where the reference is (no valid entry or a +inf "
                        f"sink), first at [b, token, head] = {at}")
    err = relative_error(o, r) if not bad.any() else math.inf
    if not bad.any() and err > REL_L2_TOL:
        failures.append(f"out: rel L2 {err:.3g} > {REL_L2_TOL:g}")
    if not bad.any():
        norms = r.norm(dim=-1)
        rows = (o - r).norm(dim=-1) / norms.clamp_min(1e-30)
        rows = torch.where(norms > 0, rows, 0.0)
        if float(rows.max()) > ROW_TOL:
            at = [int(x) for x in (rows == rows.max()).nonzero()[0]]
            failures.append(f"out: a row's rel L2 {float(rows.max()):.3g} > {ROW_TOL:g} at [b, token, head] = {at}")
    if lse is not None:
        failures += _lse_failures(lse.detach().double().cpu(), ref.lse.double().cpu())
    return failures


def _lse_failures(lse: torch.Tensor, want: torch.Tensor) -> list[str]:
    if tuple(lse.shape) != tuple(want.shape):
        return [f"lse has shape {tuple(lse.shape)}, expected {tuple(want.shape)}"]
    empty = want == math.inf
    if not torch.equal(lse == math.inf, empty):
        return [f"lse: +inf at {int((lse == math.inf).sum())} rows, expected at the {int(empty.sum())} rows with "
                "no valid entry"]
    broken = ~torch.isfinite(lse) & ~empty
    if bool(broken.any()):
        at, n = [int(x) for x in broken.nonzero()[0]], int(broken.sum())
        return [f"lse: {n} row{'s' * (n != 1)} NaN or -inf where the reference is finite (first at "
                f"[b, token, head] = {at})"]
    gap = torch.where(empty, 0.0, (lse - want).abs() / lse_allowed(want.masked_fill(empty, 0), 0.0))
    if float(gap.max()) > 1:
        at = [int(x) for x in (gap == gap.max()).nonzero()[0]]
        return [f"lse: off by {float(gap.max()):.3g}x its bound at [b, token, head] = {at}"]
    return []


Recompute = Callable[[SparseDecodeProblem, ReferenceResult], "ReferenceResult | None"]


def _problem(transform: Callable[[SparseDecodeProblem], SparseDecodeProblem | None]) -> Recompute:
    def recompute(p: SparseDecodeProblem, truth: ReferenceResult) -> ReferenceResult | None:
        q = transform(p)
        return None if q is None else sparse_reference(q)
    return recompute


def _as_pages(p: SparseDecodeProblem) -> SparseDecodeProblem | None:
    slots = torch.where(p.indices >= 0, p.indices.long() * p.page_size, -1)
    if int(slots.max()) >= p.slots:  # the kernel would read outside the pool: nothing to recompute
        return None
    return dataclasses.replace(p, indices=slots.to(torch.int32))


def _minus1_read(p: SparseDecodeProblem) -> SparseDecodeProblem:
    return dataclasses.replace(p, indices=torch.where(p.indices == -1, p.slots - 1, p.indices).to(torch.int32))


def _scales(misread: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[SparseDecodeProblem],
                                                                          SparseDecodeProblem | None]:
    def transform(p: SparseDecodeProblem) -> SparseDecodeProblem | None:
        if p.packed is None:
            return None
        cache = dequantize(p.packed, FORMATS[p.fmt], p.page_size, "sm90", misread)
        return dataclasses.replace(p, kv_cache=cache)
    return transform


def _rope_fp8(p: SparseDecodeProblem) -> SparseDecodeProblem | None:
    nope = FORMATS[p.fmt].nope if p.packed is not None else p.d_v
    if nope == p.kv_cache.shape[-1]:
        return None
    cache = p.kv_cache.clone()
    cache[..., nope:] = cache[..., nope:].to(FP8).to(cache.dtype)
    return dataclasses.replace(p, kv_cache=cache)


def _v_rope(p: SparseDecodeProblem, truth: ReferenceResult) -> ReferenceResult | None:
    shift = p.kv_cache.shape[-1] - p.d_v
    return None if shift == 0 else sparse_reference(p, values_from=shift)


def _empty_nan(p: SparseDecodeProblem, truth: ReferenceResult) -> ReferenceResult | None:
    empty = truth.lse == math.inf
    if not bool(empty.any()):
        return None
    return ReferenceResult(truth.out.masked_fill(empty[..., None], float("nan")), truth.lse)


# name -> (what it says, recompute); out is compared as bf16 (OUT_TOL["other"]): the cache holds bf16 values
CATALOG: dict[str, tuple[str, Recompute]] = {
    "indices_as_page_ids": ("reads each index as a page id (slot = index * page_size)", _problem(_as_pages)),
    "minus1_read": ("reads -1 entries as slot -1 instead of masking them", _problem(_minus1_read)),
    "topk_length_ignored": ("attends past topk_length", _problem(lambda p: dataclasses.replace(p, topk_length=None))),
    "scales_pow2": ("cuts the fp32 tile scales to powers of two", _problem(_scales(truncated_to_pow2))),
    "tile_scale_shifted": ("reads each tile with the next tile's scale", _problem(_scales(next_tile))),
    "rope_quantized": ("rounds the bf16 rope dims to fp8", _problem(_rope_fp8)),
    "v_rope_dims": ("takes V from the row's last d_v dims (rope included), not its first", _v_rope),
    "empty_row_nan": ("gives NaN (0/0) for a row with no valid entry instead of 0", _empty_nan),
}
SINK_IN_LSE = "sink_in_lse"  # judged on the LSE: log(exp(lse) + exp(sink)) returned as the LSE


def diagnose_sparse(problem: SparseDecodeProblem, out: torch.Tensor, lse: torch.Tensor | None,
                    truth: ReferenceResult | None = None) -> list[str]:
    """'name: what it says (rel L2 x)' for each catalog entry that explains the result, best first."""
    truth = truth or sparse_reference(problem)
    o = out.detach().double().cpu()
    truth_err = relative_error(o, truth.out)
    found = []
    for name, (says, recompute) in CATALOG.items():
        candidate = recompute(problem, truth)
        if candidate is None:
            continue
        err = relative_error(o, candidate.out)
        if err < OUT_TOL["other"] and (truth_err == math.inf or truth_err >= TRUTH_MARGIN * max(err, 1e-12)):
            found.append((err, f"{name}: {says} (rel L2 of out {err:.2g}, the truth's {truth_err:.2g})"))
    if lse is not None and problem.attn_sink is not None and _lse_failures(lse.double().cpu(), truth.lse):
        folded = torch.logaddexp(truth.lse, problem.attn_sink.double())
        folded = torch.where(truth.lse == math.inf, math.inf, folded)
        if not _lse_failures(lse.double().cpu(), folded):
            found.append((0.0, f"{SINK_IN_LSE}: adds the attention sink into the returned LSE"))
    return [line for _, line in sorted(found, key=lambda x: x[0])]
