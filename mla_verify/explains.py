"""When a recomputed output explains a kernel's: the bar that diagnose.py (known misreadings) and localize.py
(masked references, the rows that are wrong) both hold a recomputation to, and how their lines start.

A recomputation explains the kernel's output when its relative L2 error against it is below ``OUT_TOL`` and
at least ``TRUTH_MARGIN`` times below that of the correct reference. Import rule: problem.py and torch only.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .problem import FP8, DecodeProblem

# rel L2 below which a recomputation explains the output. fp8: a careful fp8 kernel (fp8 probabilities)
# reaches rel L2 ~3e-2 (compare.py), so it gets 4x that; TRUTH_MARGIN keeps it discriminating.
OUT_TOL = {"fp8": 1.2e-1, "other": 2e-2}
TRUTH_MARGIN = 4.0
WHERE = "where: "  # the start of every localization line (localize.py), as against an explanation


def exact_bf16(problem: DecodeProblem) -> DecodeProblem:
    """An fp8 problem with query and cache in bf16, which holds every fp8 value exactly: the reference gives
    the same numbers, and the tensor operations fp8 lacks on CUDA (roll, indexing, where) all work."""
    if problem.query.dtype != FP8 and problem.kv_cache.dtype != FP8:
        return problem
    return replace(problem, query=problem.query.to(torch.bfloat16), kv_cache=problem.kv_cache.to(torch.bfloat16))
