"""Where a run's time went: judged cases per second, and the mean time of each stage of a judged case.

``draw`` is the strategy's time for the case; ``outside cases`` is the rest of the wall time not spent in
any case (Hypothesis's own bookkeeping, draws that never became a case, shrinking's replays). An isolated
run's warm-up in its workers (``warmup_s``) is in neither: the run's seconds leave it out. Import rule:
harness's stage names only.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .harness import STAGES

if TYPE_CHECKING:
    from .engine import EngineResult


def breakdown(result: EngineResult) -> dict[str, Any]:
    """Throughput and per-stage means (milliseconds per judged case) of one backend's run, JSON-ready."""
    judged = [c for c in result.cases if c.verdict != "skip"]
    distinct = len({c.id for c in judged})
    in_cases = sum(c.seconds + c.stages.get("draw", 0.0) for c in result.cases)
    means = {name: round(1e3 * sum(c.stages.get(name, 0.0) for c in judged) / len(judged), 3)
             for name in STAGES if judged and any(name in c.stages for c in judged)}
    warm = result.warmup
    return {"judged": distinct, "judged_per_s": round(distinct / result.seconds, 2) if result.seconds else 0.0,
            "mean_ms": means, "mean_case_ms": round(1e3 * sum(c.seconds for c in judged) / len(judged), 3)
            if judged else 0.0, "draw_s": round(result.draw_seconds, 2),
            "outside_cases_s": round(max(0.0, result.seconds - in_cases), 2), "seconds": round(result.seconds, 2),
            **({"warmup_s": round(warm.seconds, 2)} if warm is not None and (warm.modules or warm.failures) else {})}


def describe(b: dict[str, Any]) -> str:
    """One line: judged/s, then each stage's mean."""
    stages = ", ".join(f"{name} {ms:.1f}" for name, ms in b["mean_ms"].items())
    return (f"{b['judged']} judged in {b['seconds']:.1f} s ({b['judged_per_s']:.1f}/s); per judged case, ms: "
            f"{stages or 'none'}; total {b['mean_case_ms']:.1f} (+ draw); outside cases {b['outside_cases_s']:.1f} s, "
            f"drawing {b['draw_s']:.1f} s in all")
