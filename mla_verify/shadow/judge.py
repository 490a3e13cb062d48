"""Shadow mode's judgement of one live call: its arguments before the kernel runs (``precheck``), its result
after (``judge``), with the suite's own reference, tolerance model and diagnosis -- exactly what a drawn case
gets from the harness (the reference precision per device included), applied to the engine's own tensors --
a dense call and a sparse one alike, each by its problem kind (mla_verify/kinds).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import ProblemError
from ..core.tracebacks import exception_line
from ..judge.compare import ErrorStats
from ..kinds import kind_of
from ..problems.layouts import LayoutSpec
from ..problems.problem import DecodeProblem
from ..problems.sparse import SparseDecodeProblem
from .contract import (
    ERROR,
    Finding,
    ModelFacts,
    check_envelope,
    check_layout,
    check_lengths,
    check_scales,
    validation_finding,
)
from .entries import LiveCall
from .problem import describing_spec, live_layout, live_problem


@dataclass
class Precheck:
    """The call read as a problem (None when it cannot be) and what its arguments break."""

    problem: DecodeProblem | SparseDecodeProblem | None
    layout: LayoutSpec | None  # None for a sparse call
    findings: list[Finding]

    @property
    def blocking(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == ERROR and f.blocking]


@dataclass
class Judgement:
    """A kernel's result against the reference (``compared`` False: the numbers were not checked)."""

    findings: list[Finding] = field(default_factory=list)  # what the result's form breaks (out, return value)
    failures: list[str] = field(default_factory=list)  # the tolerance model's verdict reasons
    stats: ErrorStats | None = None
    out: torch.Tensor | None = None  # canonical [B, q_len, H, L]
    lse: torch.Tensor | None = None  # [B, q_len, H] in the contract's base
    compared: bool = False


def precheck(call: LiveCall, facts: ModelFacts) -> Precheck:
    findings = list(call.findings)
    args = call.args
    if args is None:
        return Precheck(call.sparse, None, findings)
    findings += check_layout(args, call.contract)
    if not any(f.blocking for f in findings):
        findings += check_lengths(args)
    problem = layout = None
    if not any(f.blocking for f in findings):
        try:
            problem = live_problem(args)
        except ProblemError as error:
            findings.append(validation_finding(error))
    findings += check_scales(args, facts)
    if problem is not None:
        layout = live_layout(args, call.pass_out, call.return_lse, call.table_width)
        if call.contract.envelope is not None:
            findings += check_envelope(call.contract.envelope.why_not(describing_spec(problem), layout), call.contract)
    return Precheck(problem, layout, findings)


def judge(call: LiveCall, problem: DecodeProblem | SparseDecodeProblem | None, result: Any) -> Judgement:
    """The result's form, then (for a readable, checkable call) its numbers against the reference."""
    if call.to_canonical is None:
        return Judgement()
    try:
        out, lse, found = call.to_canonical(result)
    except (RuntimeError, TypeError, ValueError) as exc:  # e.g. an output with too few elements for its view
        return Judgement(findings=[Finding(ERROR, "result", "not in this entry point's form: "
                                           + exception_line(exc, located=False))])
    verdict = Judgement(findings=found, out=out, lse=lse)
    if problem is None or call.unchecked or out is None:
        return verdict
    base = call.contract.lse_base if call.return_lse else None
    # the baseline in the kernel's own arithmetic where it is known (as in check)
    verdict.stats, verdict.failures = kind_of(problem).judge_output(
        out=out, lse=lse if base else None, problem=problem, lse_base=base, arithmetic=call.arithmetic,
        empty_lse=call.contract.empty_lse)
    verdict.compared = True
    return verdict


def explain(problem: DecodeProblem | SparseDecodeProblem, out: torch.Tensor, lse: torch.Tensor | None,
            lse_base: float | None) -> list[str]:
    """The diagnosis replay gives a mismatching output (the LSE only where its base is known): the kind's
    catalogue's explanations, else where it is wrong. Without a re-run of the live kernel, a misreading seen
    only through NaN is not named and a NaN's cause is not told apart."""
    if tuple(out.shape) != problem.out_shape:
        return []
    use_lse = lse if lse_base is not None and lse is not None and tuple(lse.shape) == problem.out_shape[:3] else None
    return kind_of(problem).diagnose(problem, out, use_lse, lse_base or 2.0)
