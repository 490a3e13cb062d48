"""The sparse misreading catalogue: what a wrong sparse (top-k) decode kernel computes instead.

A sparse case's verdict is the one every kind gets (judge/compare.py's tolerance model against the sparse
reference, with the sparse baseline). On failure ``diagnose_sparse`` asks this catalogue: each entry recomputes
the reference under one misreading of the sparse contract -- mostly a transformed problem handed to
``sparse_reference``, so the reference stays the one source of the arithmetic -- and an entry that explains the
kernel's result is named by the dense diagnosis's bar (explains.py: within ``OUT_TOL`` with non-finite values at
the same places, and ``TRUTH_MARGIN`` times closer than the truth), in the dense diagnosis's words
(diagnose.py's ``Explanation``). The sink-in-LSE entry is judged on the LSE.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch

from ..core.memory import is_out_of_memory, release_cached
from ..core.tracebacks import exception_line
from ..problems.packed import FORMATS, FP8, dequantize, next_tile, truncated_to_pow2
from ..problems.reference import ReferenceResult
from ..problems.sparse import SparseDecodeProblem
from ..problems.sparse_reference import sparse_reference
from .compare import lse_allowed
from .diagnose import FAILED, OUT_METRIC, SKIPPED, Explanation, relative_error
from .explains import OUT_TOL, TRUTH_MARGIN, Rerun

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
                    lse_base: float = math.e, truth: ReferenceResult | None = None,
                    rerun: Rerun | None = None) -> list[str]:
    """Each catalog entry that explains the result (``lse`` in ``lse_base``), best first, as diagnose.py words
    an ``Explanation``; never raises (but KeyboardInterrupt): an error inside is one "diagnosis failed" line."""
    try:
        return [str(e) for e in explanations(problem, out, lse, lse_base, truth)]
    except Exception as exc:  # noqa: BLE001 - diagnosis is advice: it must never turn a verdict into a crash
        if is_out_of_memory(exc):
            release_cached(problem.query.device)
            return [f"{SKIPPED}out of device memory"]
        return [f"{FAILED}{exception_line(exc)}"]


def explanations(problem: SparseDecodeProblem, out: torch.Tensor, lse: torch.Tensor | None,
                 lse_base: float = math.e, truth: ReferenceResult | None = None) -> list[Explanation]:
    """The catalog entries that explain ``out`` [B, q_len, H, 512] and ``lse`` [B, q_len, H] (in ``lse_base``)
    while the correct reference does not; best first."""
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
            found.append(Explanation(name, says, err, truth_err, OUT_METRIC))
    if lse is not None and problem.attn_sink is not None:
        natural = lse.detach().double().cpu() * math.log(lse_base)
        truth_error = _lse_error(natural, truth.lse.double().cpu())
        if truth_error > 1:
            folded = torch.logaddexp(truth.lse, problem.attn_sink.double())
            folded = torch.where(truth.lse == math.inf, math.inf, folded)
            error = _lse_error(natural, folded.double().cpu())
            if error <= 1:
                found.append(Explanation(SINK_IN_LSE, "adds the attention sink into the returned LSE", error,
                                         truth_error, "LSE error / tolerance"))
    return sorted(found, key=lambda e: (e.metric != OUT_METRIC, e.error))


def _lse_error(natural: torch.Tensor, want: torch.Tensor) -> float:
    """max |lse - want| / (the fixed part of compare.py's LSE bound) over rows with a key; inf where the +inf
    rows (no key) differ or a value is NaN."""
    empty = want == math.inf
    if not torch.equal(natural == math.inf, empty):
        return math.inf
    ratio = torch.where(empty, 0.0, (natural - want).abs() / lse_allowed(want.masked_fill(empty, 0), 0.0))
    return float(torch.nan_to_num(ratio, nan=math.inf).max()) if ratio.numel() else 0.0
