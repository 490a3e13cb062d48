"""Sparse (top-k) rows of the benchmark: the sparse grid, what a sparse decode must read, and a case's workload.

A sparse case (batch, heads, topk, format, q_len, page size, context) is a ``SparseSpec`` whose every index row
lists ``topk`` distinct, valid slots -- no -1, no ``topk_length``, no sink -- drawn from a pool of
batch x context token rows that the requests share, with DeepSeek's power-of-two scales. So every listed entry
is one cache row the kernel must read, and the bytes a case moves are counted from the format's row width
(docs/bench.md, "Sparse rows").
"""
from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch

from ..backends.base import Backend
from ..core.errors import UsageError
from ..problems.packed import FORMATS
from ..problems.sparse import D_V, SPARSE_FORMATS, SPARSE_LAYOUT, SparseDecodeProblem, SparseSpec, build_sparse_problem
from ..problems.sparse_reference import sparse_reference
from .workload import GridCase, Workload


@dataclass(frozen=True)
class SparseBenchCase(GridCase):
    """One sparse grid point; ``context`` is the cache tokens per request (the pool holds batch x context)."""

    batch: int
    heads: int
    topk: int
    fmt: str = "V32"
    q_len: int = 1
    page_size: int = 64
    context: int = 16384

    kind: ClassVar[str] = "sparse"
    # "sparse-" first: no dense key starts so
    KEY: ClassVar[str] = "sparse-{fmt}-B{batch}-H{heads}-K{topk}-C{context}-p{page_size}-q{q_len}"

    def spec(self, seed: int, input_set: int = 0) -> SparseSpec:
        """Input set ``input_set``: the same sizes, fresh values, pages and slots."""
        pages = -(-self.batch * self.context // self.page_size)
        return SparseSpec(batch=self.batch, q_len=self.q_len, num_heads=self.heads, topk=self.topk,
                          page_size=self.page_size, used_pages=pages, fmt=self.fmt, scales="pow2", invalid=0.0,
                          seed=seed * 1009 + input_set)


SPARSE_AXES: dict[str, tuple[Any, ...]] = {
    "batch": (32, 128), "heads": (64, 128), "topk": (512, 2048), "fmt": SPARSE_FORMATS, "q_len": (1,),
    "page_size": (64,), "context": (16384,)}
SPARSE_ANCHOR_AXES = {**{k: v[-1:] for k, v in SPARSE_AXES.items()}, "fmt": ("bf16", "V32")}
"""DeepSeek V3.2's serving shape (128 heads, top-2048) in the formats the H200's sparse backends read."""
SPARSE_GRIDS = {"default": SPARSE_AXES, "anchor": SPARSE_ANCHOR_AXES}


def check_sparse_axes(axes: Mapping[str, Sequence[Any]]) -> None:
    """UsageError for a format the suite does not know, or a context smaller than a topk (a query token's top-k
    are distinct tokens of the cache)."""
    unknown = [f for f in axes["fmt"] if f not in SPARSE_FORMATS]
    if unknown:
        raise UsageError(f"--format: unknown {unknown} (known: {', '.join(SPARSE_FORMATS)})")
    if min(axes["context"]) < max(axes["topk"]):
        raise UsageError(f"--context {min(axes['context'])} is smaller than --topk {max(axes['topk'])}: a query "
                         "token's top-k are distinct cache tokens; give a context of at least the largest topk")


# ---------------------------------------------------------------------------------------------- counting
def row_bytes(fmt: str) -> int:
    """Bytes of one token's cache row: the packed format's (problems/packed.py), or d_qk bf16 values."""
    return FORMATS[fmt].bytes_per_token if fmt in FORMATS else SparseSpec(fmt=fmt).d_qk * 2


SPARSE_FORMULAS = {  # recorded in every result beside the dense ones; d_qk is the format's (576, or 512)
    "sparse_bytes": "B*q_len*topk*row_bytes(fmt) + B*q_len*H*d_qk*2 + B*q_len*H*512*2 (each listed row once per "
                    "query token, bf16 query, bf16 out); row_bytes: V32 656, V32_NO_ROPE 528, V4 584, bf16 1152",
    "sparse_flops": "2*(d_qk+512)*H*B*q_len*topk (a q.k and a p*v per (query token, head, listed entry))",
}


def sparse_case_bytes(spec: SparseSpec) -> int:
    """Every listed entry's cache row, once per query token, plus the bf16 query and the bf16 output (the
    indices, like the dense block tables, are not counted)."""
    entries = spec.batch * spec.q_len * spec.topk
    rows = spec.batch * spec.q_len * spec.num_heads
    return entries * row_bytes(spec.fmt) + rows * spec.d_qk * 2 + rows * D_V * 2


def sparse_case_flops(spec: SparseSpec) -> int:
    """2 * (d_qk + 512) per (query token, head, listed entry): a d_qk-long q.k and a 512-long p * v."""
    return 2 * (spec.d_qk + D_V) * spec.num_heads * spec.batch * spec.q_len * spec.topk


# ---------------------------------------------------------------------------------------------- workload
def sparse_reference_out(problem: SparseDecodeProblem) -> torch.Tensor:
    """The timed output's sanity check: float64 on CPUs, float32 (exact products, no TF32) on GPUs."""
    return sparse_reference(problem, torch.float64 if problem.query.device.type == "cpu" else torch.float32).out


def sparse_workload(case: SparseBenchCase, backends: Sequence[Backend], device: torch.device,
                    seed: int) -> Workload:
    spec0 = case.spec(seed)
    work = Workload("sparse", case.key, asdict(case), spec0.case_id(), sparse_case_bytes(spec0),
                    sparse_case_flops(spec0), functools.partial(_build, case, seed, device), sparse_reference_out)
    for b in backends:
        reason = b.why_not(spec0, SPARSE_LAYOUT, device)
        if reason is None and case.fmt in b.widened_formats:
            reason = (f"reads {case.fmt} only as bf16 rows its prepare widens it to (outside the call): its "
                      "traffic is the bf16 case's")
        if reason is None:
            work.runnable.append((b.name, functools.partial(b.prepare, layout=SPARSE_LAYOUT)))
        else:
            work.skipped.append((b.name, reason))
    return work


def _build(case: SparseBenchCase, seed: int, device: torch.device, input_set: int) -> SparseDecodeProblem:
    return build_sparse_problem(case.spec(seed, input_set), device)
