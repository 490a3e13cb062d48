"""What a problem kind is: everything the one pipeline asks of dense or sparse decode, and nothing it shares.

The harness (run/harness.py) builds a case's problem from its spec, judges the kernel's output against the
kind's reference with an allowance set by the kind's same-precision baseline (judge/compare.py's tolerance model,
the same for every kind), checks one of the kind's metamorphic relations, and on failure asks the kind's
catalogue which misreading explains the output. The search (run/engine.py) draws the kind's cases and corner
cases inside a backend's envelope, and makes a failing one smaller with the kind's steps (run/simplify.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from ..core.memory import case_bytes
from ..draw.strategies import Budget, Case
from ..judge.compare import ErrorStats, compare
from ..judge.explains import Rerun
from ..problems.arithmetic import DEFAULT, Arithmetic
from ..problems.layouts import LayoutSpec
from ..problems.reference import ReferenceResult

__all__ = ["Case", "ProblemKind", "Relation", "Rerun", "Unmap"]

Unmap = Callable[[torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor | None]"]


@dataclass(frozen=True)
class Relation:
    """A metamorphic relation: a change of the problem that must not change a correct kernel's output.

    ``apply(problem, seed)`` gives the changed problem and the map of its output back to the original's order;
    ``bits``: a deterministic kernel gives the very same bits (the change moves data, not arithmetic) -- judged so
    where its backend claims them (``Backend.claims_bits``) --, else its output is judged by the tolerance model
    against the original problem's reference. ``why_not(spec, layout, device)``: why this device cannot check it
    (the memory it needs), before anything runs; None: it can. ``extra_bytes(spec, layout)``: the device memory
    it needs on top of the problem's own (None: nothing more; the large pool's: gigabytes)."""

    description: str
    apply: Callable[[Any, int], tuple[Any, Unmap]]
    bits: bool = True
    why_not: Callable[[Any, LayoutSpec, torch.device], str | None] | None = None
    extra_bytes: Callable[[Any, LayoutSpec], int] | None = None


class ProblemKind(ABC):
    """One kind of decode problem; ``name`` is the one its envelope (``Envelope.kind``) and records carry."""

    name: str
    spec_type: type  # the spec (a frozen dataclass with to_json / from_json / describe / seed)
    problem_type: type  # the problem its builder makes, which its backends take
    relations: dict[str, Relation]  # the metamorphic relations by name ("none" is no relation)
    features: int  # how many incidental features ``plainer`` can name: it tries each once

    def spec_from_json(self, d: Any) -> Any:
        """The spec a record holds (ProblemError naming a bad field)."""
        return self.spec_type.from_json(d)  # type: ignore[attr-defined]

    @abstractmethod
    def build(self, spec: Any, device: torch.device | str) -> Any:
        """The problem of ``spec`` on ``device``, bit for bit the same on one device type."""

    @abstractmethod
    def reference(self, problem: Any) -> ReferenceResult:
        """What a case's output is judged against: exact on CPUs, the reference's fast mode on GPUs."""

    @abstractmethod
    def baseline(self, problem: Any, dtype: str, arithmetic: Arithmetic = DEFAULT) -> ReferenceResult:
        """The same-precision computation whose error against the reference sets the allowance: in the kernel's
        declared ``arithmetic`` (problems/arithmetic.py; DEFAULT: the plain baseline)."""

    @abstractmethod
    def dtype(self, problem: Any) -> str:
        """The tolerance model's dtype for ``problem`` (judge/compare.py's FACTOR and floors)."""

    @abstractmethod
    def cases(self, env: Any, budget: Budget, fp8_probes: bool = False) -> st.SearchStrategy[Case]:
        """Drawn cases inside ``env`` and ``budget``: spec, layout and metamorphic relation; each shrinks toward
        the plainest case. ``fp8_probes``: the profile's (draw/profiles.py), for a kind that has fp8 problems."""

    @abstractmethod
    def corner_cases(self, env: Any, budget: Budget) -> list[Case]:
        """The premerge profile's explicit cases: the envelope's extremes, the cheap discriminating ones first."""

    @abstractmethod
    def smaller(self, case: Case, env: Any) -> Iterator[tuple[str, Case]]:
        """(name, candidate) for each single size reduction of a failing ``case`` (run/simplify.py)."""

    @abstractmethod
    def plainer(self, case: Case, env: Any) -> Iterator[tuple[str, Case]]:
        """(name, candidate) for each incidental feature of ``case`` set to its plain value; each named once."""

    @abstractmethod
    def size(self, case: Case) -> tuple[int, int]:
        """What "smaller" means: the (query token, head, key) triples the case computes, then its batch."""

    @abstractmethod
    def footprint(self, spec: Any) -> tuple[int, int]:
        """(cached tokens, output rows) of ``spec``: what its memory grows with (an out-of-memory skip halves
        both for the rest of the run, draw/strategies.py's ``Budget``)."""

    def device_bytes(self, case: Case) -> int:
        """At most the device memory judging ``case`` takes at its peak: its problem's (core/memory.py's costs
        per cached token and output row) and its relation's own (the large pool's)."""
        relation = self.relations.get(case.transform)
        extra = relation.extra_bytes if relation is not None else None
        return case_bytes(*self.footprint(case.spec)) + (0 if extra is None else extra(case.spec, case.layout))

    @abstractmethod
    def diagnose(self, problem: Any, out: torch.Tensor, lse: torch.Tensor | None, lse_base: float,
                 truth: ReferenceResult | None = None, rerun: Rerun | None = None,
                 arithmetic: Arithmetic = DEFAULT) -> list[str]:
        """The catalogued misreadings that explain a failing output, else where it is wrong (rows judged against
        the baseline in the kernel's declared ``arithmetic``); never raises."""

    def judge_output(self, problem: Any, out: torch.Tensor, lse: torch.Tensor | None, lse_base: float | None,
                     arithmetic: Arithmetic = DEFAULT,
                     empty_lse: float | None = None) -> tuple[ErrorStats | None, list[str]]:
        """(error statistics, failures: none when it passes) of a kernel's canonical output on ``problem``, as
        the harness judges it (``lse`` in ``lse_base``; None: not judged; ``arithmetic``: the kernel's declared
        one, which the baseline emulates; ``empty_lse``: compare()'s)."""
        dtype = self.dtype(problem)
        return compare(out, lse, self.reference(problem), self.baseline(problem, dtype, arithmetic), dtype, lse_base,
                       arithmetic.emulation, empty_lse)

    def transform(self, problem: Any, name: str, seed: int) -> tuple[Any, Unmap]:
        """``problem`` under relation ``name``."""
        return self.relations[name].apply(problem, seed)

    def rerun_layout(self, layout: LayoutSpec) -> LayoutSpec:
        """The layout a diagnosis re-runs the kernel in (the case's, unless the kind says otherwise)."""
        return layout

    def describe_layout(self, layout: LayoutSpec) -> str:
        """The part of a call's layout that matters for this kind, in words."""
        return layout.describe()
