"""The reference's cost next to FlashInfer fa3 on a Hopper GPU: time and peak memory (a benchmark, not a test).

The goals (docs/reference.md, "Its cost"): the reference within 10x fa3's time on three cases, and at most
~4x the bytes of the cache it reads as its peak extra memory. Per case the lengths are drawn uniformly in
[1, max] (``BenchCase``, as ``mla-verify bench`` does), one problem is built, and:
- fa3 is prepared through the suite's own backend and timed as ``mla-verify bench`` times kernels (CUDA graph
  replays between CUDA events, median of ``--samples`` blocks). The caches are 300 MB-1.2 GB, far above the
  H200's 60 MB L2, so one input set cannot hide in L2.
- ``reference_decode`` is timed in each mode (fast, float32, float64) with the same CUDA events (plain launches: the
  reference synchronises with the host), median of ``--samples`` runs after a warm-up; its peak memory is
  ``torch.cuda.max_memory_allocated`` during one call minus what was allocated before it.
- fa3's output is checked against the float64 reference, so a fast wrong call is not recorded as a time.
Writes ``ref_vs_fa3.json`` and ``ref_vs_fa3.md`` under ``--out`` (``--profile`` adds the fast mode's top CUDA
kernels per case, ``profile.txt``); with the package installed:

    python benchmarks/reference_vs_fa3.py --profile --out mla-verify-results/ref_bench
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mla_verify.backends.flashinfer_wrapper import WRAPPER_PATHS, FlashInferWrapperBackend
from mla_verify.bench.grid import BenchCase, pick_layout
from mla_verify.bench.timing import EAGER, ArmedRound, CudaTimer, Timing
from mla_verify.core.platform import platform_info
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.problems.problem import DecodeProblem
from mla_verify.problems.reference import reference_decode

CASES = (BenchCase(128, 128, 4096, 64), BenchCase(512, 16, 4096, 64), BenchCase(64, 16, 16384, 32))
TIME_RATIO_GOAL = 10.0  # the reference within 10x fa3's time
MEMORY_RATIO_GOAL = 4.0  # peak extra memory within ~4x the cache bytes read
# fa3 in bf16 sits near rel L2 error 2e-3 (docs/reference.md); 10x that still separates it from a wrong call (~1).
SANITY_REL_L2 = 2e-2
# name -> (precision, matmul mode): "fast" is what the harness uses on GPUs (exact bf16 products, fp32 sums)
PRECISIONS = {"fast": (torch.float32, "bf16-split"), "fp32": (torch.float32, "exact"),
              "fp64": (torch.float64, "exact")}


def cache_bytes_read(problem: DecodeProblem) -> int:
    """The latent rows the sequences own: what any decode must read once."""
    return int(problem.seq_lens.sum()) * problem.kv_cache.shape[-1] * problem.kv_cache.element_size()


def peak_extra_bytes(fn: Callable[[], Any], device: torch.device) -> tuple[Any, int]:
    """(fn(), the most memory fn held at once beyond what was allocated before it)."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    value = fn()
    torch.cuda.synchronize(device)
    return value, torch.cuda.max_memory_allocated(device) - before


def time_reference(problem: DecodeProblem, mode: tuple[torch.dtype, str], timer: CudaTimer
                   ) -> tuple[Any, Timing, int]:
    """(result, timing, peak extra bytes) of reference_decode; the memory run doubles as the warm-up."""
    precision, matmul = mode
    result, peak = peak_extra_bytes(lambda: reference_decode(problem, precision, matmul=matmul), timer.device)
    armed = ArmedRound(lambda: reference_decode(problem, precision, matmul=matmul), [result], 1, EAGER,
                       note="plain launches: the reference reads the lengths on the host")
    return result, timer.measure(armed), peak


def time_fa3(problem: DecodeProblem, spec: ProblemSpec, timer: CudaTimer, reference_out: torch.Tensor
             ) -> dict[str, Any]:
    backend = FlashInferWrapperBackend("fa3", WRAPPER_PATHS["fa3"])
    layout, reason = pick_layout(backend, spec, timer.device)
    if layout is None:
        return {"status": "skipped", "reason": reason}
    call = backend.prepare(problem, layout)
    armed = timer.arm([call])
    timing = timer.measure(armed)
    out = call.judged(armed.results[0])[0].float()
    rel_l2 = float((out - reference_out).norm() / reference_out.norm())
    status = "ok" if rel_l2 <= SANITY_REL_L2 else "wrong"  # NaN is "wrong" too
    return {"status": status, "median_ms": timing.median_s * 1e3, "method": timing.method, "note": timing.note,
            "spread": timing.spread, "rel_l2_vs_fp64_reference": rel_l2, "layout": layout.describe()}


def run_case(case: BenchCase, timer: CudaTimer, seed: int) -> dict[str, Any]:
    spec = case.spec(seed)
    problem = build_problem(spec, timer.device)
    row: dict[str, Any] = {"case": case.key, "tokens": int(problem.seq_lens.sum()),
                           "cache_bytes_read": cache_bytes_read(problem), "reference": {}}
    results = {}
    for name, mode in PRECISIONS.items():
        result, timing, peak = time_reference(problem, mode, timer)
        results[name] = result
        row["reference"][name] = {"median_ms": timing.median_s * 1e3, "spread": timing.spread,
                                  "peak_extra_bytes": peak, "peak_over_cache": peak / row["cache_bytes_read"]}
    row["fa3"] = time_fa3(problem, spec, timer, results["fp64"].out)
    for name in ("fast", "fp32"):  # each mode's own error against the float64 reference
        ref64 = results["fp64"].out
        row["reference"][name]["rel_l2_vs_fp64"] = float((results[name].out.double() - ref64).norm() / ref64.norm())
    if row["fa3"]["status"] in ("ok", "wrong"):
        for entry in row["reference"].values():
            entry["ratio_vs_fa3"] = entry["median_ms"] / row["fa3"]["median_ms"]
    del problem, results
    torch.cuda.empty_cache()
    return row


def markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    def ratio(x: float | None, goal: float) -> str:
        return "-" if x is None else f"{x:.1f}x {'ok' if x <= goal else 'OVER'}"

    lines = [f"# Reference vs FlashInfer fa3 ({meta['date']})", "",
             f"{meta['gpu']}; torch {meta['torch']} (CUDA {meta['torch_cuda']}); flashinfer {meta['flashinfer']}; "
             f"seed {meta['seed']}, median of {meta['samples']} samples. Goals: time <= {TIME_RATIO_GOAL:g}x fa3, "
             f"peak memory <= {MEMORY_RATIO_GOAL:g}x the cache bytes read.", "",
             "| case | tokens | cache MiB | fa3 ms | mode | ref ms | ref / fa3 | peak MiB | peak / cache "
             "| rel L2 vs fp64 | fa3 rel L2 vs fp64 |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        fa3 = r["fa3"]
        for name, entry in r["reference"].items():
            lines.append(
                f"| {r['case']} | {r['tokens']} | {r['cache_bytes_read'] / 2**20:.0f} | "
                f"{ms(fa3.get('median_ms')) if fa3['status'] == 'ok' else fa3['status']} | {name} | "
                f"{ms(entry['median_ms'])} | {ratio(entry.get('ratio_vs_fa3'), TIME_RATIO_GOAL)} | "
                f"{entry['peak_extra_bytes'] / 2**20:.0f} | {ratio(entry['peak_over_cache'], MEMORY_RATIO_GOAL)} | "
                f"{entry.get('rel_l2_vs_fp64', 0.0):.2g} | {fa3.get('rel_l2_vs_fp64_reference', float('nan')):.2g} |")
    skipped = [f"- {r['case']}: fa3 {r['fa3']['status']}: {r['fa3'].get('reason', '')}" for r in rows
               if r["fa3"]["status"] != "ok"]
    return "\n".join(lines + ([""] + skipped if skipped else [])) + "\n"


def profile_call(fn: Callable[[], Any], device: torch.device, with_cpu: bool = False, rows: int = 15) -> str:
    """The top operations of one call of ``fn`` by CUDA time, after a warm-up call and a sync (without it the
    profiled call's one host read would wait for the warm-up's GPU work)."""
    fn()
    torch.cuda.synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if with_cpu else [])
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize(device)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def profile_fast(spec: ProblemSpec, device: torch.device) -> str:
    """Where the fast reference's time goes: the top CUDA kernels of one call."""
    problem = build_problem(spec, device)
    precision, matmul = PRECISIONS["fast"]
    return profile_call(lambda: reference_decode(problem, precision, matmul=matmul), device)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for ref_vs_fa3.json and .md")
    parser.add_argument("--device", default="cuda", help="a CUDA device (default: cuda)")
    parser.add_argument("--samples", type=int, default=10, help="timed samples per measurement (median reported)")
    parser.add_argument("--seed", type=int, default=0, help="lengths, values and page order")
    parser.add_argument("--profile", action="store_true",
                        help="also write the fast reference's top CUDA kernels per case (profile.txt)")
    ns = parser.parse_args(argv)
    device = torch.device(ns.device)
    if device.type != "cuda" or not torch.cuda.is_available():
        print(f"reference_vs_fa3: needs a CUDA GPU (asked for {ns.device}; CUDA available: "
              f"{torch.cuda.is_available()})", file=sys.stderr)
        return 2
    info = platform_info()
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "gpu": torch.cuda.get_device_name(device), "torch": info.torch, "torch_cuda": info.torch_cuda,
            "flashinfer": info.flashinfer, "python": info.python, "seed": ns.seed, "samples": ns.samples,
            "goals": {"time_ratio": TIME_RATIO_GOAL, "memory_ratio": MEMORY_RATIO_GOAL}}
    timer = CudaTimer(device, samples=ns.samples)
    rows = []
    ns.out.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        rows.append(run_case(case, timer, ns.seed))
        print(json.dumps(rows[-1]), flush=True)
        if ns.profile:
            try:
                table = profile_fast(case.spec(ns.seed), device)
            except Exception as exc:  # noqa: BLE001 - a profiler problem must not cost the timings
                table = f"profiler failed: {exc}"
            with open(ns.out / "profile.txt", "a") as f:
                f.write(f"== {case.key}: fast reference\n{table}\n")
    (ns.out / "ref_vs_fa3.json").write_text(json.dumps({"meta": meta, "cases": rows}, indent=2) + "\n")
    table = markdown(meta, rows)
    (ns.out / "ref_vs_fa3.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
