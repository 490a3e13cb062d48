"""The benchmark's grid: one kind of grid case per problem kind (mla_verify/kinds) -- its axes and key, its input
sets, the bytes and FLOPs it must move and compute, and its workload: which backends of its kind run it, with
what prepare, or why not (``GridCase.workload``). The timing loop (measure.py) is the same for every kind.

Dense (``BenchCase``): per case (batch, heads, max sequence length, page size, dtype, q_len) the input sets are
``build_problem``'s -- the same ragged lengths, different values and page permutations.

Sparse (``SparseBenchCase``): a case (batch, heads, topk, format, q_len, page size, context) is a ``SparseSpec``
whose every index row lists ``topk`` distinct, valid slots -- no -1, no ``topk_length``, no sink -- drawn from a
pool of batch x context token rows that the requests share, with DeepSeek's power-of-two scales. So every listed
entry is one cache row the kernel must read, and the bytes a case moves are counted from the format's row width
(docs/bench.md, "Sparse rows").
"""
from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

import torch

from ..backends import Backend
from ..backends.base import PreparedCall
from ..core.errors import UsageError
from ..kinds import KINDS
from ..problems.envelope import DENSE
from ..problems.generate import DTYPES, ProblemSpec, build_problem
from ..problems.layouts import LayoutSpec
from ..problems.packed import FORMATS
from ..problems.problem import DecodeProblem
from ..problems.sparse import D_V, SPARSE_FORMATS, SPARSE_LAYOUT, SparseDecodeProblem, SparseSpec, build_sparse_problem
from ..problems.sparse_reference import sparse_reference
from .workload import GridCase, Workload

# One bench layout per backend: the first of these its envelope accepts (3-D cache, out passed, no LSE:
# what a serving engine's decode step asks for).
LAYOUT_CHOICES = (LayoutSpec(3, 0, "native", True, False), LayoutSpec(4, 0, "native", True, False),
                  LayoutSpec(3, 0, "pad128", True, False), LayoutSpec(4, 0, "pad128", True, False),
                  LayoutSpec(3, 0, "native", False, False), LayoutSpec(3, 0, "native", True, True))


# ---------------------------------------------------------------------------------------------- dense
@dataclass(frozen=True)
class BenchCase(GridCase):
    """One grid point. Lengths are drawn uniformly in [q_len, max_seq_len] from a seeded RNG."""

    batch: int
    heads: int
    max_seq_len: int
    page_size: int
    dtype: str = "bf16"
    q_len: int = 1

    kind: ClassVar[str] = "dense"
    KEY: ClassVar[str] = "B{batch}-H{heads}-S{max_seq_len}-p{page_size}-{dtype}-q{q_len}"

    def seq_lens(self, seed: int) -> tuple[int, ...]:
        rng = random.Random(f"mla-verify-bench:{self.batch}:{self.max_seq_len}:{self.q_len}:{seed}")
        return tuple(rng.randint(self.q_len, self.max_seq_len) for _ in range(self.batch))

    def spec(self, seed: int, input_set: int = 0) -> ProblemSpec:
        """Input set ``input_set``: the same lengths, fresh values and page order."""
        return ProblemSpec(self.seq_lens(seed), q_len=self.q_len, num_heads=self.heads, page_size=self.page_size,
                           dtype=self.dtype, pad_fill="zero", seed=seed * 1009 + input_set)


    def workload(self, backends: Sequence[Backend], device: torch.device, seed: int) -> Workload:
        """Each backend with its layout (LAYOUT_CHOICES), or why it cannot run the case."""
        return dense_workload(self, backends, device, seed)

ANCHOR = BenchCase(batch=512, heads=16, max_seq_len=4096, page_size=64)
"""The case FlashInfer fa3 was measured on independently of this benchmark (docs/bench.md, "The grid")."""
DEFAULT_AXES: dict[str, tuple[Any, ...]] = {
    "batch": (32, 128, 512), "heads": (16, 128), "max_seq_len": (1024, 4096, 16384), "page_size": (32, 64),
    "dtype": ("bf16",), "q_len": (1, 2)}
GRIDS = {"default": DEFAULT_AXES, "anchor": {k: (getattr(ANCHOR, k),) for k in DEFAULT_AXES}}




def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


DENSE_FORMULAS = {  # D = kv_lora_rank + rope (576), L = kv_lora_rank (512)
    "bytes": "sum(seq_lens)*D*itemsize + B*q_len*H*D*itemsize + B*q_len*H*L*2 (cache rows owned, query, bf16 out)",
    "flops": "2*(D+L)*H*sum_b(q_len*n_b - q_len*(q_len-1)/2) (causal: query token i sees n - q_len + i + 1 tokens)",
}


def case_bytes(spec: ProblemSpec) -> int:
    """Bytes the case must move: every cached latent row a sequence owns, read once; the query; the bf16 out.

    sum(seq_lens) * (kv_lora_rank + rope) * itemsize + B * q_len * H * (kv_lora_rank + rope) * itemsize
    + B * q_len * H * kv_lora_rank * 2. Page tails, block tables and seq_lens are not counted.
    """
    d = spec.dims
    rows = spec.batch * spec.q_len * spec.num_heads
    return (spec.total_tokens + rows) * d.head_dim_qk * _itemsize(spec.dtype) + rows * d.kv_lora_rank * 2


def case_flops(spec: ProblemSpec) -> int:
    """2 * (kv_lora_rank + rope + kv_lora_rank) per (query token, head, visible KV token).

    Query token i of a request of length n sees n - q_len + i + 1 tokens (causal), so a request contributes
    q_len * n - q_len * (q_len - 1) / 2 (query token, KV token) pairs.
    """
    d = spec.dims
    q = spec.q_len
    pairs = sum(q * n - q * (q - 1) // 2 for n in spec.seq_lens)
    return 2 * (d.head_dim_qk + d.kv_lora_rank) * spec.num_heads * pairs


def pick_layout(backend: Backend, spec: ProblemSpec, device: torch.device) -> tuple[LayoutSpec | None, str]:
    """The first of LAYOUT_CHOICES the backend accepts for ``spec``, or (None, why not)."""
    first_reason = ""
    for layout in LAYOUT_CHOICES:
        reason = backend.why_not(spec, layout, device)
        if reason is None:
            return layout, ""
        first_reason = first_reason or reason
    return None, first_reason


def dense_workload(case: BenchCase, backends: Sequence[Backend], device: torch.device, seed: int) -> Workload:
    spec0 = case.spec(seed)
    work = Workload("dense", case.key, asdict(case), spec0.case_id(), case_bytes(spec0), case_flops(spec0),
                    functools.partial(_build_dense, case, seed, device), _dense_reference_out)
    for b in backends:
        layout, reason = pick_layout(b, spec0, device)
        if layout is None:
            work.skipped.append((b.name, reason))
        else:
            work.runnable.append((b.name, functools.partial(_prepare_dense, b, layout)))
    return work


def _build_dense(case: BenchCase, seed: int, device: torch.device, input_set: int) -> DecodeProblem:
    return build_problem(case.spec(seed, input_set), device)


def _dense_reference_out(problem: DecodeProblem) -> torch.Tensor:
    return KINDS[DENSE].reference(problem).out


def _prepare_dense(backend: Backend, layout: LayoutSpec, problem: DecodeProblem) -> PreparedCall:
    return backend.prepare(problem, layout)


# ---------------------------------------------------------------------------------------------- sparse
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


    def workload(self, backends: Sequence[Backend], device: torch.device, seed: int) -> Workload:
        return sparse_workload(self, backends, device, seed)

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


def row_bytes(fmt: str) -> int:
    """Bytes of one token's cache row: the packed format's (problems/packed.py), or d_qk bf16 values."""
    return FORMATS[fmt].bytes_per_token if fmt in FORMATS else SparseSpec(fmt=fmt).d_qk * 2


SPARSE_FORMULAS = {  # d_qk is the format's (576, or 512)
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


# ---------------------------------------------------------------------------------------------- the grid
Case = BenchCase | SparseBenchCase
CASE_COLUMNS = list(dict.fromkeys([*DEFAULT_AXES, *SPARSE_AXES]))  # bench.csv: every axis of either kind
FORMULAS = {  # recorded in every result
    **DENSE_FORMULAS, **SPARSE_FORMULAS,
    "copy_fraction": "achieved bytes/s / device-to-device copy bytes/s (the copy's read + write counted)",
}


def make_grid(axes: Mapping[str, Sequence[Any]], case_type: type[Case] = BenchCase) -> list[Case]:
    """Every combination of the axis values (the anchor case is one of the default grid's)."""
    names = [f.name for f in fields(case_type)]
    return [case_type(**dict(zip(names, values))) for values in itertools.product(*(axes[n] for n in names))]
