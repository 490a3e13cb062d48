"""Time-to-catch per mutant under a run profile (premerge by default): a benchmark, nothing is asserted.

For each mutant, ``mla_verify.run.engine.verify`` runs the profile exactly as ``mla-verify check --kernel
mla_verify.kernels.mutants:<name>`` would; we record the wall seconds and cases until its first failing case, the
total with shrinking and diagnosis, the shrunk case and its diagnosis. The correct kernel runs the same
profile (it must pass). Beside each kernel's numbers: its CPU seconds and the load average before and after
(timings on a shared machine depend on what else runs). Results go to ``--out`` (JSON, with the machine and
commit) and a Markdown table next to it (``.md``).

    python benchmarks/mutant_catch_times.py --out mla-verify-results/cpu/mutant_catch_times.json [--mutants a,b]
"""
from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path
from typing import Any

from run_record import LOAD_HEADER, load_cells, machine_line, machine_record, measured

from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.kernels.mutants import MUTANTS, FaultyKernel, correct_kernel
from mla_verify.run.engine import verify
from mla_verify.run.harness import CaseResult


def time_to_catch(fn: FaultyKernel, device: str, profile: str) -> dict[str, Any]:
    """Run ``profile`` against ``fn``; time the first failing case and the whole run."""
    started = time.perf_counter()
    first: dict[str, Any] = {"cases": 0, "seconds": None, "reason": ""}

    def on_case(r: CaseResult) -> None:
        if first["seconds"] is None:
            first["cases"] += r.verdict != "skip"
            if r.verdict == "fail":
                first["seconds"], first["reason"] = round(time.perf_counter() - started, 3), r.reason

    with measured() as m:
        result = verify(TrtllmStyleBackend(fn.__name__, fn), device, profile, on_case=on_case)
    failure = result.failure
    return {"caught": result.verdict == "fail", "first_failure_s": first["seconds"],
            "cases_to_first_failure": first["cases"], "first_reason": first["reason"],
            "total_s": round(result.seconds, 3), **m, "cases_total": len(result.cases),
            "shrunk_case": failure.describe() if failure else "", "shrunk_reason": failure.reason if failure else "",
            "diagnosis": failure.diagnosis if failure else []}


def markdown(results: dict[str, dict[str, Any]], profile: str, device: str, machine: dict[str, Any]) -> str:
    lines = [f"# Mutant time-to-catch ({profile} profile, {device})", "", f"Machine: {machine_line(machine)}. "
             "Total s includes shrinking and diagnosis; CPU s is this process's user+system time over the run.", "",
             "| kernel | bug class | verdict | s to 1st failure | cases to 1st failure | total s | CPU s | "
             f"{LOAD_HEADER} | diagnosis (catalog entries) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        mutant = MUTANTS.get(name)
        verdict = ("caught" if mutant else "FALSE ALARM") if r["caught"] else ("SURVIVED" if mutant else "passed")
        diagnosis = ", ".join(n for d in r["diagnosis"] for n in re.findall(r"\[([a-z0-9_]+)\]", d)) or "-"
        lines.append(f"| {name} | {mutant.bug_class if mutant else '(correct kernel)'} | {verdict} | "
                     f"{r['first_failure_s'] if r['caught'] else '-'} | {r['cases_to_first_failure']} | "
                     f"{r['total_s']} | {r['cpu_s']} | {load_cells(r)} | {diagnosis.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON path; the Markdown table goes next to it (.md)")
    ap.add_argument("--mutants", default="", help="comma-separated names (default: all that --device's type can catch)")
    ap.add_argument("--profile", default="premerge")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    device_type = args.device.split(":")[0]
    names = [n for n in args.mutants.split(",") if n] or [n for n, m in MUTANTS.items() if m.device == device_type]
    unknown = sorted(set(names) - set(MUTANTS))
    if unknown:
        ap.error(f"unknown mutant(s) {', '.join(unknown)}; see mla_verify.kernels.mutants.MUTANTS")
    machine, results = machine_record(), {}
    for name in names + ["correct_kernel"]:
        fn = correct_kernel if name == "correct_kernel" else MUTANTS[name].fn
        r = results[name] = time_to_catch(fn, args.device, args.profile)
        print(f"{name:24s} {'failed' if r['caught'] else 'passed':6s} first failure {r['first_failure_s']}s "
              f"after {r['cases_to_first_failure']} cases; total {r['total_s']}s; other processes kept "
              f"{r['others_cores']} cores busy", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {"profile": args.profile, "device": args.device, "machine": machine, "results": results}
    args.out.write_text(json.dumps(record, indent=2))
    args.out.with_suffix(".md").write_text(markdown(results, args.profile, args.device, machine))


if __name__ == "__main__":
    main()
