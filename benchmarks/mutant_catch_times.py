"""Time-to-catch per mutant: wall seconds from the start of a run until its first failing case.

A benchmark, not a test: nothing is asserted; the numbers go to ``--out`` (JSON, plus a Markdown table next
to it). Each mutant meets the same mutant-agnostic case sequence, so the times compare how quickly a
gate finds each bug class. The correct kernel runs the whole sequence as well (it must never fail).

Cases come from ``CASE_SOURCES``: ``ladder`` is a seeded, derandomized mix of the envelope's axes (a
stand-in for the premerge profile); register the premerge engine's case list there once it exists. Each
case is judged by ``mla_verify.harness.run_case`` (pass ``--runner MODULE:ATTR`` for another one with
the same signature).

    python benchmarks/mutant_catch_times.py --out results/catch_times.json [--mutants a,b] [--cases 40]
"""
from __future__ import annotations

import argparse
import importlib
import json
import random
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.dims import R1_SOFTMAX_SCALE
from mla_verify.generate import ProblemSpec
from mla_verify.layouts import LayoutSpec
from mla_verify.metamorphic import TRANSFORMS
from mla_verify.mutants import MUTANTS, FaultyKernel, correct_kernel

Case = tuple[ProblemSpec, LayoutSpec, str]  # spec, layout, metamorphic transform


def ladder(count: int, seed: int = 0) -> list[Case]:
    """``count`` cases drawn with a fixed seed over trtllm-gen's envelope, small problems first."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        page = rng.choice((32, 64))
        q_len = rng.choice((1, 1, 2, 4))
        dtype = rng.choice(("bf16", "bf16", "fp8"))
        fp8 = dict(q_scale=0.5, k_scale=0.25) if dtype == "fp8" else {}
        longest = 8 + (i + 1) * 300 // count  # grows along the ladder
        # boundary lengths as often as random ones: q_len itself, and whole pages
        lengths = [rng.choice((rng.randint(q_len, longest), q_len, page * rng.randint(1, 1 + longest // page)))
                   for _ in range(rng.randint(1, 4))]
        spec = ProblemSpec(
            seq_lens=tuple(lengths),
            q_len=q_len, num_heads=rng.choice((1, 2, 4, 8, 16)), page_size=page, dtype=dtype,
            softmax_scale=rng.choice((None, R1_SOFTMAX_SCALE)), bmm2_extra=rng.choice((1.0, 0.5)),
            table_pad=rng.choice((0, 1)), pad_fill=rng.choice(("zero", "garbage", "oob")),
            extra_pages=rng.choice((0, 2)), seed=i, **fp8)
        layout = LayoutSpec(cache_dims=rng.choice((3, 4)), page_stride_pad=rng.choice((0, 8)),
                            table_width=rng.choice(("native", "pad128")), pass_out=rng.choice((True, False)))
        cases.append((spec, layout, TRANSFORMS[i % len(TRANSFORMS)]))
    return cases


CASE_SOURCES: dict[str, Callable[[int], Iterable[Case]]] = {"ladder": ladder}


def time_to_catch(fn: FaultyKernel, cases: Iterable[Case], run_case: Callable[..., Any],
                  device: str = "cpu") -> dict[str, Any]:
    """Run ``cases`` in order until one fails; report the wall time to that failure."""
    backend = TrtllmStyleBackend(fn.__name__, fn)
    started = time.perf_counter()
    ran = 0
    for spec, layout, transform in cases:
        result = run_case(backend, spec, layout, device, transform=transform, diagnose=False)
        ran += result.verdict != "skip"
        if result.verdict == "fail":
            return {"caught": True, "seconds": round(time.perf_counter() - started, 3), "cases": ran,
                    "reason": result.reason, "case": result.describe()}
    return {"caught": False, "seconds": round(time.perf_counter() - started, 3), "cases": ran,
            "reason": "", "case": ""}


def markdown(results: dict[str, dict[str, Any]], source: str) -> str:
    lines = [f"# Mutant time-to-catch ({source} cases)", "",
             "| kernel | bug class | caught | seconds | cases run | first failure |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        bug_class = MUTANTS[name].bug_class if name in MUTANTS else "(correct kernel)"
        caught = ("yes" if name in MUTANTS else "FALSE ALARM") if r["caught"] else ("NO" if name in MUTANTS else "no")
        reason = r["reason"].replace("|", "/")[:120]
        lines.append(f"| {name} | {bug_class} | {caught} | {r['seconds']} | "
                     f"{r['cases']} | {reason} |")
    return "\n".join(lines) + "\n"


def _load(target: str) -> Callable[..., Any]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON path; the Markdown table goes next to it (.md)")
    ap.add_argument("--mutants", default="", help="comma-separated names (default: all)")
    ap.add_argument("--source", choices=sorted(CASE_SOURCES), default="ladder")
    ap.add_argument("--cases", type=int, default=40)
    ap.add_argument("--runner", default="mla_verify.harness:run_case")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    run_case = _load(args.runner)
    names = [n for n in args.mutants.split(",") if n] or list(MUTANTS)
    cases = list(CASE_SOURCES[args.source](args.cases))
    results = {}
    for name in names + ["correct_kernel"]:
        fn = correct_kernel if name == "correct_kernel" else MUTANTS[name].fn
        results[name] = time_to_catch(fn, cases, run_case, args.device)
        print(f"{name:24s} {'failed' if results[name]['caught'] else 'passed':6s} "
              f"{results[name]['seconds']:8.2f}s {results[name]['cases']:4d} cases", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"source": args.source, "cases": len(cases), "device": args.device,
                                    "results": results}, indent=2))
    args.out.with_suffix(".md").write_text(markdown(results, args.source))


if __name__ == "__main__":
    main()
