"""When a recomputed output explains a kernel's: the bar that diagnose.py (known misreadings) and localize.py
(masked references, the rows that are wrong) both hold a recomputation to, how their lines start, and the
problem with finite values in its NaN-poisoned cache slots that both re-run the kernel on.

A recomputation explains the kernel's output when its relative L2 error against it is below ``OUT_TOL`` and
at least ``TRUTH_MARGIN`` times below that of the correct reference. Import rule: problem.py and torch only.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from ..problems.problem import FP8, DecodeProblem

# rel L2 below which a recomputation explains the output. fp8: a careful fp8 kernel (fp8 probabilities)
# reaches rel L2 ~3e-2 (compare.py), so it gets 4x that. Other (bf16, fp16): a correct kernel sits about its
# output rounding, 2^-9 ~ 2e-3, from exact arithmetic; 2e-2 leaves 10x for its accumulation order.
OUT_TOL = {"fp8": 1.2e-1, "other": 2e-2}
# ...and the recomputation must be this many times closer than the correct reference. A kernel that is only
# noisier than a correct one is about as far from every nearby recomputation as from the truth, so no
# explanation beats the truth by 4x; one that computes a wrong formula is close to that formula alone.
TRUTH_MARGIN = 4.0
WHERE = "where: "  # the start of every localization line (localize.py), as against an explanation
Rerun = Callable[[DecodeProblem], "torch.Tensor | None"]  # the kernel's canonical out on another problem


def exact_bf16(problem: DecodeProblem) -> DecodeProblem:
    """An fp8 problem with query and cache in bf16, which holds every fp8 value exactly: the reference gives
    the same numbers, and the tensor operations fp8 lacks on CUDA (roll, indexing, where) all work."""
    if problem.query.dtype != FP8 and problem.kv_cache.dtype != FP8:
        return problem
    return replace(problem, query=problem.query.to(torch.bfloat16), kv_cache=problem.kv_cache.to(torch.bfloat16))


def finite_poison(p: DecodeProblem) -> DecodeProblem | None:
    """``p`` with a finite value (drawn like the cache's own) in every cache slot that holds NaN; None if none."""
    wide = exact_bf16(p).kv_cache
    holes = torch.isnan(wide)
    if not bool(holes.any()):
        return None
    gen = torch.Generator(device=wide.device).manual_seed(0)
    fill = torch.randn(wide.shape, generator=gen, device=wide.device, dtype=torch.float32).to(wide.dtype)
    return replace(p, kv_cache=torch.where(holes, fill, wide).to(p.kv_cache.dtype))
