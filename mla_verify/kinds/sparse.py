"""Sparse (top-k, DeepSeek V3.2) decode as a problem kind: each query token over the cache slots its index row
lists.

Its spec, builder and metamorphic relations are problems/sparse.py's, its reference and baseline
problems/sparse_reference.py's, its strategies draw/sparse_strategies.py's and its catalogue
judge/sparse_catalog.py's. The tolerance model is bf16's: the reference holds the kernel to the values its
packed cache dequantizes to (problems/packed.py), so an FP8 cache adds no error of its own.

Smaller (run/simplify.py): keep half the batch (a corner case of two requests becomes one), one head or half
of them, one query token, fewer masked leading blocks, half the top-k (keeping a valid entry after the masked
blocks), half the used pages. Plainer: no spare pages, no -1 entries, no -1 front, no masked blocks, no
duplicates, no topk_length, no sink, the default softmax scale, normal values, the envelope's first
format and scale convention, out as the envelope's first way, no metamorphic relation.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from hypothesis import strategies as st

from ..draw.sparse_strategies import sparse_cases, sparse_corner_cases
from ..draw.strategies import Budget
from ..judge.sparse_catalog import diagnose_sparse
from ..problems import sparse
from ..problems.arithmetic import DEFAULT, Arithmetic
from ..problems.envelope import SPARSE, SparseEnvelope
from ..problems.reference import ReferenceResult
from ..problems.sparse import FRONT_BLOCK, SparseDecodeProblem, SparseSpec, build_sparse_problem
from ..problems.sparse_reference import sparse_baseline, sparse_reference
from .base import Case, ProblemKind, Relation, Rerun

# each field's plain value (plainer); the format and scale convention are the envelope's first
PLAIN_SPEC: dict[str, Any] = dict(extra_pages=0, invalid=0.0, invalid_front=False, front_blocks=0, duplicates=False,
                                  topk_lengths=None, sink="none", softmax_scale=None, values="normal")


def _unmoved(out: torch.Tensor, lse: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    return out, lse


def _relation(name: str) -> Relation:
    description, bits = sparse.SPARSE_TRANSFORMS[name]
    return Relation(description, lambda p, seed: (sparse.transform(p, name, seed), _unmoved), bits)


class SparseKind(ProblemKind):
    name = SPARSE
    spec_type = SparseSpec
    problem_type = SparseDecodeProblem
    relations = {name: _relation(name) for name in sparse.SPARSE_TRANSFORMS}
    features = len(PLAIN_SPEC) + 4  # format, scales, pass_out and the metamorphic relation

    def build(self, spec: SparseSpec, device: torch.device | str) -> SparseDecodeProblem:
        return build_sparse_problem(spec, device)

    def reference(self, problem: SparseDecodeProblem) -> ReferenceResult:
        """float64 on every device: a sparse problem gathers only its B x q_len x topk rows."""
        return sparse_reference(problem)

    def baseline(self, problem: SparseDecodeProblem, dtype: str, arithmetic: Arithmetic = DEFAULT) -> ReferenceResult:
        """problems/sparse_reference.py's: no sparse backend declares an arithmetic of its own."""
        if arithmetic != DEFAULT:
            raise ValueError(f"the sparse baseline emulates no declared arithmetic ({arithmetic.name})")
        return sparse_baseline(problem)

    def dtype(self, problem: SparseDecodeProblem) -> str:
        return "bf16"  # bf16 queries; a packed cache is held to the values it dequantizes to

    def cases(self, env: SparseEnvelope, budget: Budget, fp8_probes: bool = False) -> st.SearchStrategy[Case]:
        """(fp8_probes: a sparse problem's queries are bf16, its packed cache held to what it dequantizes to)"""
        return sparse_cases(env)

    def corner_cases(self, env: SparseEnvelope, budget: Budget) -> list[Case]:
        return sparse_corner_cases(env)

    def size(self, case: Case) -> tuple[int, int]:
        s = case.spec
        return s.batch * s.q_len * s.num_heads * s.topk, s.batch

    def footprint(self, spec: SparseSpec) -> tuple[int, int]:
        return (spec.used_pages + spec.extra_pages) * spec.page_size, spec.batch * spec.q_len * spec.num_heads

    def diagnose(self, problem: SparseDecodeProblem, out: torch.Tensor, lse: torch.Tensor | None, lse_base: float,
                 truth: ReferenceResult | None = None, rerun: Rerun | None = None,
                 arithmetic: Arithmetic = DEFAULT) -> list[str]:
        return diagnose_sparse(problem, out, lse, lse_base, truth, rerun)

    def describe_layout(self, layout: Any) -> str:
        return f"out={'passed' if layout.pass_out else 'returned'}, lse={'yes' if layout.return_lse else 'no'}"

    def smaller(self, case: Case, env: SparseEnvelope) -> Iterator[tuple[str, Case]]:
        s = case.spec
        if s.batch > 1:
            half = s.batch // 2
            yield f"batch first {half}", replace(case, spec=_requests(s, range(half)))
            yield f"batch last {s.batch - half}", replace(case, spec=_requests(s, range(half, s.batch)))
        for heads in sorted({h for h in (1, s.num_heads // 2) if 1 <= h < s.num_heads and env.allows_heads(h)}):
            yield f"heads {heads}", replace(case, spec=replace(s, num_heads=heads))
        if env.q_len[0] < s.q_len:
            yield f"q_len {env.q_len[0]}", replace(case, spec=replace(s, q_len=env.q_len[0]))
        if s.front_blocks > 1:
            yield "front blocks 1", replace(case, spec=replace(s, front_blocks=1))
        m = env.topk_multiple
        front = FRONT_BLOCK * s.front_blocks  # a row with masked leading blocks keeps a valid entry after them
        for topk in sorted({k for k in (m, s.topk // 2 // m * m, front + m)
                            if m <= k < s.topk and (k > front or s.topk <= front)}):
            lengths = None if s.topk_lengths is None else tuple(min(n, topk) for n in s.topk_lengths)
            yield f"topk {topk}", replace(case, spec=replace(s, topk=topk, topk_lengths=lengths))
        if s.used_pages > 1:
            yield f"used pages {s.used_pages // 2}", replace(case, spec=replace(s, used_pages=s.used_pages // 2))

    def plainer(self, case: Case, env: SparseEnvelope) -> Iterator[tuple[str, Case]]:
        s = case.spec
        plain = {**PLAIN_SPEC, "fmt": env.formats[0], "scales": env.scales[0] if s.fmt != "V4" else "pow2"}
        for key, value in plain.items():
            if getattr(s, key) != value:
                yield f"feature {key}", replace(case, spec=replace(s, **{key: value}))
        if case.layout.pass_out != env.pass_out[0]:
            yield "feature pass_out", replace(case, layout=replace(case.layout, pass_out=env.pass_out[0]))
        if case.transform != "none":
            yield "feature transform", replace(case, transform="none")


def _requests(s: SparseSpec, kept: range) -> SparseSpec:
    """``s`` with only the requests ``kept`` (and their topk_lengths)."""
    lengths = None if s.topk_lengths is None else tuple(s.topk_lengths[i] for i in kept)
    return replace(s, batch=len(kept), topk_lengths=lengths)


SPARSE_KIND = SparseKind()
