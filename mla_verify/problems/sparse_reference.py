"""The sparse reference: exact attention of each query token over the cache slots its top-k row lists.

The definition is problems/sparse.py's; the precision modes are the dense reference's (reference.py):
``precision`` float64 (default) or float32 with ``matmul="exact"``, or ``matmul="bf16-split"`` (bf16 operands,
fp32 accumulation, the probabilities split into two bf16 halves for the second product). The gathered rows
are ``B * q_len * topk`` -- the problem's own size, so no grouping is needed.

``sparse_baseline`` is the tolerance model's same-precision computation (judge/compare.py), as
``compare.baseline_result`` is for a dense problem: ``q * softmax_scale`` rounded to bf16, fp32 scores, the
probabilities exp(s - rowmax) rounded to bf16 before the second product, the output rounded to bf16.
"""
from __future__ import annotations

import dataclasses

import torch

from .reference import MATMUL_MODES, ReferenceResult, _bmm, _no_tf32, _probs_times_values
from .sparse import SparseDecodeProblem


def sparse_reference(problem: SparseDecodeProblem, precision: torch.dtype = torch.float64,
                     matmul: str = "exact", values_from: int = 0,
                     p_dtype: torch.dtype | None = None) -> ReferenceResult:
    """(out [B, q_len, H, d_v], natural-log lse [B, q_len, H]); empty rows give out 0 and lse +inf.
    ``values_from`` (diagnosis only): V read from dims [values_from, values_from + d_v) instead of the first.
    ``p_dtype``: the probabilities exp(s - rowmax) rounded to it before the second product (the baseline's)."""
    p = problem
    if matmul not in MATMUL_MODES:
        raise ValueError(f"matmul must be one of {MATMUL_MODES}, got {matmul!r}")
    split = matmul == "bf16-split"
    precision = torch.float32 if split else precision
    operand = torch.bfloat16 if split else precision
    B, Q, H, D = p.query.shape
    K = p.indices.shape[-1]
    masked = p.masked()
    # masked entries read slot 0 and are zeroed: a NaN-poisoned slot can then not leak through p = 0
    kv = p.kv_cache.reshape(-1, D)[p.indices.long().clamp_min(0)]  # [B, Q, K, D]
    kv = kv.masked_fill(masked[..., None], 0).to(operand).view(B * Q, K, D)
    q = p.query.to(operand).view(B * Q, H, D)
    with _no_tf32():
        scores = _bmm(q, kv.transpose(1, 2), split, alpha=p.softmax_scale)  # [B*Q, H, K]
        scores = scores.masked_fill(masked.view(B * Q, 1, K), float("-inf"))
        lse = torch.logsumexp(scores, -1)  # [B*Q, H]; -inf for an empty row
        empty = lse == float("-inf")
        values = kv[..., values_from:values_from + p.d_v]
        if p_dtype is None:
            out = torch.empty((B * Q, 2 * H if split else H, p.d_v), dtype=precision, device=p.query.device)
            probs = torch.exp(scores - torch.where(empty, 0.0, lse)[..., None])
            _probs_times_values(probs, values, split, 1.0, out)
        else:
            top = scores.amax(-1, keepdim=True)
            unnormalized = torch.exp(scores - torch.where(empty[..., None], 0.0, top))
            total = unnormalized.sum(-1, keepdim=True)
            rounded = unnormalized.to(p_dtype).to(values.dtype)
            out = _bmm(rounded, values, False) / torch.where(total == 0, 1.0, total)
    if split:
        out = out[:, :H] + out[:, H:]
    if p.attn_sink is not None:  # 1 / (1 + exp(sink - lse)), without overflow: sigmoid(lse - sink)
        out = out * torch.sigmoid(lse - p.attn_sink.to(precision))[..., None]
    out = out.masked_fill(empty[..., None], 0.0)
    lse = lse.masked_fill(empty, float("inf"))
    return ReferenceResult(out.view(B, Q, H, p.d_v), lse.view(B, Q, H))


def sparse_baseline(problem: SparseDecodeProblem) -> ReferenceResult:
    """The same-precision computation (see the module docstring): bf16 output, and its LSE."""
    scaled_q = (problem.query.to(torch.float64) * problem.softmax_scale).to(torch.bfloat16)
    folded = dataclasses.replace(problem, query=scaled_q, softmax_scale=1.0)
    low = sparse_reference(folded, torch.float32, p_dtype=torch.bfloat16)
    return ReferenceResult(low.out.to(torch.bfloat16), low.lse)
