"""flashinfer-bench's own judgement of a solution's outputs -- what its evaluator would say -- beside ours.

Its DefaultEvaluator.check_correctness, trial by trial and output by output, in its order: a call that raised is
RUNTIME_ERROR; then a shape or dtype that differs from the reference's; then any inf or NaN in an output
(INCORRECT_NUMERICAL, the LSE's too); then ``compute_error_stats`` with its default BenchmarkConfig (an element
fails where its absolute error exceeds atol = 1e-2 *and* its relative error exceeds rtol = 1e-2; any failing
element fails the trial). Otherwise PASSED. The functions are flashinfer-bench's own; only the loop is here,
since the evaluator's synchronizes CUDA (a CPU run has none) -- backends/fib_solution.run_as_evaluator makes
the outputs it judges.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

PASSED = "PASSED"


@dataclass(frozen=True)
class FibJudgement:
    status: str  # flashinfer-bench's EvaluationStatus name: PASSED, RUNTIME_ERROR, INCORRECT_SHAPE, ...
    max_abs: float | None  # over the trials judged numerically (the evaluator's Correctness)
    max_rel: float | None
    detail: str
    reference_nonfinite: bool = False  # its reference's own outputs hold inf/NaN: it fails every solution here

    @property
    def flagged(self) -> bool:
        return self.status != PASSED

    def line(self) -> str:
        """One line: would flashinfer-bench's evaluator flag it, and by what."""
        errors = "" if self.max_abs is None else f"max abs error {self.max_abs:.3g}, max rel error {self.max_rel:.3g}"
        unjudgeable = (" -- its own reference's outputs are non-finite on this workload (an all-masked sparse row's "
                       "LSE is -inf): it fails every solution here") if self.reference_nonfinite else ""
        if self.flagged:
            return f"would flag it: {self.status} ({self.detail or errors}){unjudgeable}"
        return f"would pass it ({errors}: within its atol = rtol = 1e-2){unjudgeable}"

    def to_json(self) -> dict[str, object]:
        return {"status": self.status, "flagged": self.flagged, "max_abs": self.max_abs, "max_rel": self.max_rel,
                "detail": self.detail, "reference_nonfinite": self.reference_nonfinite}


def fib_judgement(references: list[list[torch.Tensor]],
                  solutions: list[list[torch.Tensor] | Exception]) -> FibJudgement:
    """The evaluator's verdict on ``solutions`` (per trial: the outputs in the definition's order, or what the
    call raised) against ``references`` (the definition reference's outputs, per trial)."""
    from flashinfer_bench.bench.config import BenchmarkConfig

    cfg = BenchmarkConfig()
    unjudgeable = any(not bool(torch.isfinite(t).all()) for ref in references for t in ref)
    verdict = _judged(references, solutions, cfg)
    return replace(verdict, reference_nonfinite=unjudgeable)


def _judged(references: list[list[torch.Tensor]], solutions: list[list[torch.Tensor] | Exception],
            cfg: Any) -> FibJudgement:
    """check_correctness's verdict (the module docstring), trial by trial."""
    from flashinfer_bench.bench.utils import compute_error_stats

    max_abs = max_rel = 0.0
    incorrect = ""
    for trial, (ref, sol) in enumerate(zip(references, solutions)):
        if isinstance(sol, Exception):
            return FibJudgement("RUNTIME_ERROR", None, None, f"trial {trial} raised {type(sol).__name__}: {sol}")
        for index, (got, want) in enumerate(zip(sol, ref)):
            if tuple(got.shape) != tuple(want.shape):
                return FibJudgement("INCORRECT_SHAPE", None, None, f"output {index}: {tuple(got.shape)}, "
                                    f"the reference's {tuple(want.shape)}")
            if got.dtype != want.dtype:
                return FibJudgement("INCORRECT_DTYPE", None, None, f"output {index}: {got.dtype}, the "
                                    f"reference's {want.dtype}")
            if bool(torch.isinf(got).any()) or bool(torch.isnan(got).any()):
                bad = float("inf") if bool(torch.isinf(got).any()) else float("nan")
                return FibJudgement("INCORRECT_NUMERICAL", bad, bad, f"output {index} holds {bad} values "
                                    "(it fails any non-finite value)")
            abs_err, rel_err, exceeds, _ = compute_error_stats(got, want, cfg)
            max_abs, max_rel = max(max_abs, abs_err), max(max_rel, rel_err)
            if exceeds and not incorrect:
                incorrect = (f"output {index} in trial {trial}: elements past both atol = {cfg.atol:g} and rtol = "
                             f"{cfg.rtol:g}")
    if incorrect:
        return FibJudgement("INCORRECT_NUMERICAL", max_abs, max_rel, f"{incorrect}; max abs error {max_abs:.3g}, "
                            f"max rel error {max_rel:.3g}")
    return FibJudgement(PASSED, max_abs, max_rel, "")
