"""Calibrate the tolerance model on real kernels (a measurement, not a test).

For drawn cases on each runnable backend, measures against a float64 reference: the kernel's error, the
fast GPU reference's own error, and the errors of candidate same-precision baselines:
  careful   fp32 scores and softmax, probabilities rounded to the operand dtype, bf16 output (compare.py)
  qscaled   as careful, but the query pre-multiplied by bmm1_scale and rounded to bf16 (a kernel that folds
            the softmax scale into Q, a common design)
Writes JSON + a summary of kernel/baseline ratios to --out.
    python benchmarks/tolerance_probe.py --backend fa3 --backend fa2 --cases 80 --out $OUT/probe
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, seed, settings

from mla_verify.backends import get_backend
from mla_verify.draw.strategies import budget_for, specs
from mla_verify.judge.compare import P_DTYPE
from mla_verify.problems.generate import build_problem
from mla_verify.problems.layouts import LayoutSpec
from mla_verify.problems.reference import fast_matmul_mode, reference_decode


def errors(x: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    e = (x.double() - ref).abs()
    return {"rel_l2": float(e.norm() / ref.norm()), "max_abs": float(e.max())}


def baselines(problem, dtype: str) -> dict[str, torch.Tensor]:
    mode = fast_matmul_mode(problem)
    careful = reference_decode(problem, torch.float32, p_dtype=P_DTYPE[dtype], matmul=mode).out
    folded = replace(problem, query=(problem.query.double() * problem.bmm1_scale).to(torch.bfloat16), bmm1_scale=1.0)
    qscaled = reference_decode(folded, torch.float32, p_dtype=P_DTYPE[dtype], matmul=fast_matmul_mode(folded)).out
    return {"careful": careful.to(torch.bfloat16), "qscaled": qscaled.to(torch.bfloat16)}


def probe(name: str, n: int, device: torch.device) -> list[dict]:
    backend = get_backend(name)
    rows: list[dict] = []

    @seed(1234)
    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(specs(backend.envelope, budget_for("cuda")))
    def run(spec) -> None:
        layout = LayoutSpec(return_lse=False)
        if backend.why_not(spec, layout, device):
            return
        problem = build_problem(spec, device)
        call = backend.prepare(problem, layout)
        out = call.judged(call.invoke())[0]
        if device.type == "cuda":
            torch.cuda.synchronize()
        ref64 = reference_decode(problem, torch.float64).out
        row = {"spec": spec.describe(), "kernel": errors(out, ref64),
               "fast_ref": errors(reference_decode(problem, torch.float32, matmul=fast_matmul_mode(problem)).out,
                                  ref64),
               "fp32_ref": errors(reference_decode(problem, torch.float32).out, ref64)}
        for k, v in baselines(problem, spec.dtype).items():
            row[k] = errors(v, ref64)
        rows.append(row)
        print(f"{name} k={row['kernel']['rel_l2']:.2e}/{row['kernel']['max_abs']:.2e} "
              f"careful={row['careful']['rel_l2']:.2e}/{row['careful']['max_abs']:.2e} "
              f"qscaled={row['qscaled']['rel_l2']:.2e}/{row['qscaled']['max_abs']:.2e} "
              f"fast={row['fast_ref']['rel_l2']:.1e} fp32={row['fp32_ref']['rel_l2']:.1e} | {spec.describe()[:110]}",
              flush=True)
    run()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", action="append", required=True)
    ap.add_argument("--cases", type=int, default=80)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tolerance_probe: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    a.out.mkdir(parents=True, exist_ok=True)
    flags = {"allow_tf32": torch.backends.cuda.matmul.allow_tf32,
             "fp32_precision": str(getattr(torch.backends.cuda.matmul, "fp32_precision", "n/a"))}
    try:
        x = torch.ones(1, 2, 2, dtype=torch.bfloat16, device=device)
        flags["bmm_out_dtype"] = str(torch.bmm(x, x, out_dtype=torch.float32).dtype)
    except Exception as exc:  # noqa: BLE001 - recorded, not fatal
        flags["bmm_out_dtype"] = f"unsupported: {exc}"[:200]
    print(flags)
    summary = {"flags": flags}
    for name in a.backend:
        rows = probe(name, a.cases, device)
        worst = {}
        for base in ("careful", "qscaled"):
            for metric in ("rel_l2", "max_abs"):
                worst[f"{base}.{metric}"] = max(r["kernel"][metric] / max(r[base][metric], 1e-30) for r in rows)
        worst["fast_ref.rel_l2"] = max(r["fast_ref"]["rel_l2"] for r in rows)
        worst["fp32_ref.rel_l2"] = max(r["fp32_ref"]["rel_l2"] for r in rows)
        summary[name] = {"cases": len(rows), "worst_kernel_over_baseline": worst}
        (a.out / f"probe_{name}.json").write_text(json.dumps(rows, indent=1))
        print(name, json.dumps(summary[name]))
    (a.out / "probe_summary.json").write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
