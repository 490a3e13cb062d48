"""Dense decode as a problem kind: a paged latent cache, each query token over its causal prefix.

Its spec and builder are problems/generate.py's, its reference problems/reference.py's (judged against float64
on CPUs, the fast mode on GPUs), its baseline judge/compare.py's, its metamorphic relations
problems/metamorphic.py's, its strategies draw/strategies.py's and its catalogue judge/diagnose.py's.

Smaller (run/simplify.py): keep half the batch, fewer heads or query tokens, a shorter longest sequence -- lengths
approach the shortest failing one geometrically (half, then three quarters, ...), so a failure that needs a long
sequence is reported near the shortest length that shows it. Plainer: drop an incidental feature (unused pages,
table padding, a strided pool, a non-default scale, per-request q_lens, a metamorphic check).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch
from hypothesis import strategies as st

from ..core.memory import FIXED_BYTES, spare_bytes
from ..draw import strategies
from ..judge.compare import baseline_result
from ..judge.diagnose import diagnose_safely
from ..problems import metamorphic
from ..problems.arithmetic import DEFAULT, Arithmetic
from ..problems.envelope import DENSE, Envelope
from ..problems.generate import DTYPES, ProblemSpec, build_problem, dtype_name
from ..problems.layouts import LayoutSpec
from ..problems.problem import DecodeProblem
from ..problems.reference import ReferenceResult, fast_matmul_mode, reference_decode
from .base import Case, ProblemKind, Relation, Rerun

PLAIN_SPEC: dict[str, Any] = dict(extra_pages=0, table_pad=0, pad_fill="zero", values="normal", shuffle_pages=False,
                                  softmax_scale=None, bmm2_extra=1.0, q_scale=1.0, k_scale=1.0, q_lens=None)
PLAIN_LAYOUT = ("page_stride_pad", "cache_dims", "table_width")  # set to the envelope's plainest (plainer)
FEATURES = len(PLAIN_SPEC) + len(PLAIN_LAYOUT) + 1  # and the metamorphic relation: each tried once


def _relation(name: str) -> Relation:
    """A deterministic kernel keeps its bits under each (judged so where its backend claims them); the large pool's
    is checked only where the device has its memory."""
    return Relation(metamorphic.DESCRIPTIONS[name], lambda p, seed: metamorphic.transform(p, name, seed),
                    why_not=large_pool_reason if name == metamorphic.LARGE_POOL else None,
                    extra_bytes=large_pool_bytes if name == metamorphic.LARGE_POOL else None)


def _large_pool_elements(spec: ProblemSpec) -> int:
    stride = spec.page_size * (spec.kv_lora_rank + spec.qk_rope_head_dim)
    return metamorphic.large_pool_elements(spec.pool_pages, stride)


def large_pool_bytes(spec: ProblemSpec, layout: LayoutSpec) -> int:
    """The device memory ``spec``'s pages past 2^32 elements take: the pool (4-8 GiB), its input snapshot, a
    strided layout's copy and the bit comparison's mask (one bool per element)."""
    elements = _large_pool_elements(spec)
    return elements * DTYPES[spec.dtype].itemsize * (2 + (layout.page_stride_pad > 0)) + elements


def large_pool_reason(spec: ProblemSpec, layout: LayoutSpec, device: torch.device) -> str | None:
    """Why ``device`` cannot check ``spec``'s pages past 2^32 elements: they must fit this process's share of its
    free memory (large_pool_bytes)."""
    pool = _large_pool_elements(spec) * DTYPES[spec.dtype].itemsize
    need = large_pool_bytes(spec, layout) + FIXED_BYTES
    spare = spare_bytes(torch.device(device))
    if spare >= need:
        return None
    where = "a CPU run does not place them" if torch.device(device).type != "cuda" else \
        f"this process's share of the free memory is {spare / 2**30:.1f} GiB"
    return (f"pages past 2^32 elements need a {pool / 2**30:.1f} GiB pool, {need / 2**30:.1f} GiB with its copies "
            f"on the device; {where}")


class DenseKind(ProblemKind):
    name = DENSE
    spec_type = ProblemSpec
    problem_type = DecodeProblem
    relations = {name: _relation(name) for name in metamorphic.RELATIONS}
    features = FEATURES

    def build(self, spec: ProblemSpec, device: torch.device | str) -> DecodeProblem:
        return build_problem(spec, device)

    def reference(self, problem: DecodeProblem) -> ReferenceResult:
        """float64 on CPUs; on GPUs the fast mode (exact bf16 products, fp32 sums; reference.py states its bound)."""
        if problem.device.type == "cpu":
            return reference_decode(problem, torch.float64)
        return reference_decode(problem, torch.float32, matmul=fast_matmul_mode(problem))

    def baseline(self, problem: DecodeProblem, dtype: str, arithmetic: Arithmetic = DEFAULT) -> ReferenceResult:
        """judge/compare.py's, emulating a declared arithmetic (judge/emulation.py)."""
        return baseline_result(problem, dtype, arithmetic)

    def dtype(self, problem: DecodeProblem) -> str:
        return dtype_name(problem)

    def cases(self, env: Envelope, budget: strategies.Budget, fp8_probes: bool = False) -> st.SearchStrategy[Case]:
        return strategies.cases(env, budget, fp8_probes)

    def corner_cases(self, env: Envelope, budget: strategies.Budget) -> list[Case]:
        return strategies.corner_cases(env, budget)

    def size(self, case: Case) -> tuple[int, int]:
        s = case.spec
        return sum(s.seq_lens) * s.num_heads * s.q_len, s.batch

    def footprint(self, spec: ProblemSpec) -> tuple[int, int]:
        return (strategies.cached_tokens(spec.seq_lens, spec.page_size, spec.extra_pages),
                spec.batch * spec.q_len * spec.num_heads)

    def diagnose(self, problem: DecodeProblem, out: torch.Tensor, lse: torch.Tensor | None, lse_base: float,
                 truth: ReferenceResult | None = None, rerun: Rerun | None = None,
                 arithmetic: Arithmetic = DEFAULT) -> list[str]:
        return diagnose_safely(problem, out, lse, lse_base, truth, rerun=rerun, arithmetic=arithmetic)

    def rerun_layout(self, layout: LayoutSpec) -> LayoutSpec:
        """Contiguous pages: the NaN between strided pages must not stand in for the poison a re-run replaced."""
        return replace(layout, page_stride_pad=0)

    def smaller(self, case: Case, env: Envelope) -> Iterator[tuple[str, Case]]:
        """Each reduction makes the attempts after it cheaper."""
        s = case.spec
        lens = s.seq_lens
        if len(lens) > 1:
            half = len(lens) // 2
            yield f"batch first {half}", replace(case, spec=_requests(s, range(half)))
            yield f"batch last {len(lens) - half}", replace(case, spec=_requests(s, range(half, len(lens))))
            if len(lens) <= 8:
                for i in range(len(lens)):
                    others = [j for j in range(len(lens)) if j != i]
                    yield f"batch without {i}", replace(case, spec=_requests(s, others))
        for heads in sorted({h for h in (1, s.num_heads // 2) if h < s.num_heads and env.allows_heads(h)}):
            yield f"heads {heads}", replace(case, spec=replace(s, num_heads=heads))
        low_q = env.q_len[0]
        for q in sorted({q for q in (low_q, s.q_len // 2) if low_q <= q < s.q_len}):
            if min(lens) >= q:
                q_lens = None if s.q_lens is None else tuple(min(n, q) for n in s.q_lens)
                yield f"q_len {q}", replace(case, spec=replace(s, q_len=q, q_lens=q_lens))
        longest = max(range(len(lens)), key=lambda i: lens[i])
        n, lo = lens[longest], s.q_len
        for step in (2, 4, 8, 16, 32):  # n - (n - lo) / 2, then closer to n: the shortest failing length is near
            shorter = n - (n - lo) // step
            if lo <= shorter < n:
                yield f"length {shorter}", replace(case, spec=replace(s, seq_lens=lens[:longest] + (shorter,)
                                                                       + lens[longest + 1:]))

    def plainer(self, case: Case, env: Envelope) -> Iterator[tuple[str, Case]]:
        s, layout = case.spec, case.layout
        for key, plain in PLAIN_SPEC.items():
            if getattr(s, key) != plain:
                yield f"feature {key}", replace(case, spec=replace(s, **{key: plain}))
        plain_layout: dict[str, Any] = dict(page_stride_pad=0, cache_dims=min(env.cache_dims),
                                            table_width=env.table_widths[0])
        assert tuple(plain_layout) == PLAIN_LAYOUT
        for key, plain in plain_layout.items():
            if getattr(layout, key) != plain:
                yield f"feature {key}", replace(case, layout=replace(layout, **{key: plain}))
        if case.transform != "none":
            yield "feature transform", replace(case, transform="none")


def _requests(s: ProblemSpec, kept: Sequence[int]) -> ProblemSpec:
    """``s`` with only the requests ``kept`` (their seq_lens and, if ragged, their q_lens)."""
    return replace(s, seq_lens=tuple(s.seq_lens[i] for i in kept),
                   q_lens=None if s.q_lens is None else tuple(s.q_lens[i] for i in kept))


DENSE_KIND = DenseKind()
