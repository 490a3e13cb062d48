"""The sparse misreading catalogue: what a wrong sparse (top-k) decode kernel computes instead.

A sparse case's verdict is the one every kind gets (judge/compare.py's tolerance model against the sparse
reference, with the sparse baseline). On failure ``diagnose_sparse`` asks this catalogue: each entry recomputes
the reference under one misreading of the sparse contract -- mostly a transformed problem handed to
``sparse_reference``, so the reference stays the one source of the arithmetic -- and an entry is named by the rule
every kind's catalogue is held to (explains.py: within ``OUT_TOL`` and ``TRUTH_MARGIN`` times closer than the
truth; a match through NaN only once a re-run of the kernel on the problem with finite values in its unlisted
slots confirms it -- the packed bytes of those slots re-packed too; several at once only as candidates this
case cannot tell apart), in the dense diagnosis's words. An index read as a page id may point past the pool:
the recomputation reads NaN there, memory the kernel was not given. The sink-in-LSE entry is judged on the LSE.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

import torch

from ..core.memory import is_out_of_memory, release_cached
from ..core.tracebacks import exception_line
from ..problems.packed import FORMATS, FP8, byte_rows, dequantize, next_tile, quantize, truncated_to_pow2
from ..problems.reference import ReferenceResult
from ..problems.sparse import FRONT_BLOCK, SparseDecodeProblem
from ..problems.sparse_reference import sparse_reference
from .compare import lse_allowed
from .explains import (
    FAILED,
    OUT_METRIC,
    OUT_TOL,
    SKIPPED,
    Explanation,
    Rerun,
    explaining,
    explanation_lines,
    relative_error,
)

Recompute = Callable[[SparseDecodeProblem, ReferenceResult], "torch.Tensor | None"]  # None: not applicable here


def _problem(transform: Callable[[SparseDecodeProblem], SparseDecodeProblem | None]) -> Recompute:
    def recompute(p: SparseDecodeProblem, truth: ReferenceResult) -> torch.Tensor | None:
        q = transform(p)
        return None if q is None else sparse_reference(q).out
    return recompute


def _as_pages(p: SparseDecodeProblem) -> SparseDecodeProblem | None:
    """Slot = index * page_size; a slot past the pool reads the NaN row appended to it (one token per page)."""
    if p.page_size == 1:  # the misreading is no misreading here
        return None
    slots = torch.where(p.indices >= 0, p.indices.long() * p.page_size, -1).clamp(max=p.slots)
    rows = p.kv_cache.reshape(p.slots, 1, -1)
    beyond = torch.full_like(rows[:1], float("nan"))
    return dataclasses.replace(p, kv_cache=torch.cat([rows, beyond]), indices=slots.to(torch.int32))


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


def _v_rope(p: SparseDecodeProblem, truth: ReferenceResult) -> torch.Tensor | None:
    shift = p.kv_cache.shape[-1] - p.d_v
    return None if shift == 0 else sparse_reference(p, values_from=shift).out


def _front_block_nan(p: SparseDecodeProblem, truth: ReferenceResult) -> torch.Tensor | None:
    """NaN in the rows whose first FRONT_BLOCK entries are all masked, a row of no valid entry included: on a
    problem whose only such rows are empty it reads as empty_row_nan does (a case then cannot tell them apart)."""
    front = p.masked()[..., :FRONT_BLOCK].all(-1)  # [B, q_len]
    return truth.out.masked_fill(front[:, :, None, None], float("nan")) if bool(front.any()) else None


def _empty_nan(p: SparseDecodeProblem, truth: ReferenceResult) -> torch.Tensor | None:
    empty = truth.lse == math.inf
    if not bool(empty.any()):
        return None
    return truth.out.masked_fill(empty[..., None], float("nan"))


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
    "front_block_nan": (f"gives NaN (exp(-inf - -inf)) for a row whose first {FRONT_BLOCK} entries are all masked: "
                        "no guard for a leading block with no valid entry", _front_block_nan),
}
SINK_IN_LSE = "sink_in_lse"  # judged on the LSE: log(exp(lse) + exp(sink)) returned as the LSE


def diagnose_sparse(problem: SparseDecodeProblem, out: torch.Tensor, lse: torch.Tensor | None,
                    lse_base: float = math.e, truth: ReferenceResult | None = None,
                    rerun: Rerun | None = None) -> list[str]:
    """The catalog's explanations of a failing result (``lse`` in ``lse_base``) as explains.py words them;
    ``rerun`` runs the kernel on another problem (to confirm a match through NaN). Never raises (but
    KeyboardInterrupt): an error inside is one "diagnosis failed" line, the verdict stands without it."""
    try:
        return explanation_lines(SPARSE_CATALOGUE, explanations(problem, out, lse, lse_base, truth, rerun))
    except Exception as exc:  # noqa: BLE001 - diagnosis is advice: it must never turn a verdict into a crash
        if is_out_of_memory(exc):
            release_cached(problem.query.device)
            return [f"{SKIPPED}out of device memory"]
        return [f"{FAILED}{exception_line(exc)}"]


def explanations(problem: SparseDecodeProblem, out: torch.Tensor, lse: torch.Tensor | None,
                 lse_base: float = math.e, truth: ReferenceResult | None = None,
                 rerun: Rerun | None = None) -> list[Explanation]:
    """The catalog entries that explain ``out`` [B, q_len, H, 512] and ``lse`` [B, q_len, H] (in ``lse_base``)
    while the correct reference does not; best first. Out is compared as bf16 (``OUT_TOL["other"]``): the cache
    holds bf16 values."""
    truth = truth or sparse_reference(problem)
    found = explaining(SPARSE_CATALOGUE, problem, out.detach(), truth, list(CATALOG), rerun, OUT_TOL["other"])
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


class _SparseCatalogue:
    """CATALOG as explains.py's rule takes it (explains.Catalogue): no nearby problems."""

    nearby_words = ""

    def description(self, name: str) -> str:
        return CATALOG[name][0]

    def error(self, name: str, problem: SparseDecodeProblem, out: torch.Tensor, truth: ReferenceResult) -> float:
        candidate = CATALOG[name][1](problem, truth)
        return math.inf if candidate is None else relative_error(out, candidate)

    def finite_poison(self, problem: SparseDecodeProblem) -> SparseDecodeProblem | None:
        return finite_poison(problem)

    def nearby(self, problem: SparseDecodeProblem) -> Iterator[SparseDecodeProblem]:
        return iter(())

    def reference(self, problem: SparseDecodeProblem) -> ReferenceResult:
        return sparse_reference(problem)


SPARSE_CATALOGUE = _SparseCatalogue()


def finite_poison(p: SparseDecodeProblem) -> SparseDecodeProblem | None:
    """``p`` with finite values (drawn like the cache's own) in every slot no index lists, which hold NaN; for a
    packed cache those slots' bytes are packed anew (power-of-two scales), the listed ones kept. None if no slot
    holds NaN."""
    holes = torch.isnan(p.kv_cache)
    if not bool(holes.any()):
        return None
    gen = torch.Generator(device=p.kv_cache.device).manual_seed(0)
    fill = torch.randn(p.kv_cache.shape, generator=gen, device=p.kv_cache.device).to(p.kv_cache.dtype)
    cache = torch.where(holes, fill, p.kv_cache)
    if p.packed is None:
        return dataclasses.replace(p, kv_cache=cache)
    fmt, page, width = FORMATS[p.fmt], p.page_size, p.packed.shape[1]  # a live call's V4 pages: unpadded
    owner = byte_rows(fmt, page)[:width].to(p.packed.device)
    refill = holes.any(-1)[:, owner.clamp_min(0)] & (owner >= 0)  # [P, width]: the bytes of unlisted rows
    packed = torch.where(refill, quantize(cache, fmt, "pow2")[:, :width], p.packed)
    return dataclasses.replace(p, kv_cache=dequantize(packed, fmt, page, "sm90"), packed=packed)


def _lse_error(natural: torch.Tensor, want: torch.Tensor) -> float:
    """max |lse - want| / (the fixed part of compare.py's LSE bound) over rows with a key; inf where the +inf
    rows (no key) differ or a value is NaN."""
    empty = want == math.inf
    if not torch.equal(natural == math.inf, empty):
        return math.inf
    ratio = torch.where(empty, 0.0, (natural - want).abs() / lse_allowed(want.masked_fill(empty, 0), 0.0))
    return float(torch.nan_to_num(ratio, nan=math.inf).max()) if ratio.numel() else 0.0
