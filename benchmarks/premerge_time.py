"""Wall time and repeatability of the premerge gate on this machine (docs/verified.md): a benchmark.

Runs the real command line, ``python -m mla_verify.cli check ... --device cpu --profile premerge --report``,
``--runs`` times (default 2) for each target -- the correct CPU kernel (``--kernel
mla_verify.kernels.mutants:correct_kernel``) and the CPU peer (``--backend cpu-peer``) -- one run at a time, and
records each run's wall and CPU seconds (process start to exit, imports included), its exit code, and the
machine's load around it (run_record.measured). Then it compares the runs' reports: the ordered (case id,
verdict) lists must be equal. The acceptance bound (60 s per run) is reported, not asserted: the time depends
on what else the machine runs, which is why the load stands beside every number.

    python benchmarks/premerge_time.py --out mla-verify-results/cpu/premerge_time.json [--runs 2] [--omp-threads 1]
                                       [--background-load 2]

``--omp-threads`` sets OMP_NUM_THREADS for the runs: on a 2-core machine shared with other work, torch's
intra-op threads wait on each other and the same run takes several times longer (see docs/verified.md).
``--background-load N`` reproduces such a machine: N busy-looping processes run beside every run.

Writes the JSON record to ``--out`` and a Markdown table next to it (``.md``). Reproducer fixtures of any
failure go to a scratch directory, not the repository's fixtures/regressions.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from run_record import LOAD_HEADER, REPO, load_cells, machine_line, machine_record, measured

TARGETS = {"correct_kernel": ["--kernel", "mla_verify.kernels.mutants:correct_kernel"],
           "cpu-peer": ["--backend", "cpu-peer"]}
BOUND_S = 60.0  # the goal: premerge on the 2-core CPU machine takes <= 60 s


def run_once(target: list[str], report: Path, fixtures: Path, env: dict[str, str]) -> dict[str, Any]:
    """One ``mla-verify check`` process: its timing and load, exit code, and (case id, verdict) list."""
    command = [sys.executable, "-m", "mla_verify.cli", "check", *target, "--device", "cpu",
               "--profile", "premerge", "--report", str(report), "--fixtures-dir", str(fixtures)]
    with measured(children=True) as m:
        proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    record: dict[str, Any] = {"command": " ".join(command[1:]), "exit_code": proc.returncode, **m}
    if not report.exists():
        record["error"] = (proc.stderr.strip().splitlines() or ["no report written"])[-1]
        record["cases"] = []
        return record
    data = json.loads(report.read_text())
    record["engine_s"] = data["run"]["seconds"]  # selfcheck + cases; wall_s minus this is imports and reports
    record["cases"] = [[c["id"], c["verdict"]] for c in data["cases"]]
    record["verdicts"] = {v: sum(c["verdict"] == v for c in data["cases"]) for v in ("pass", "fail", "skip")}
    return record


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether every run drew the same cases, in the same order, with the same verdicts."""
    first = runs[0]["cases"]
    differ = [i + 1 for i, r in enumerate(runs[1:], 1) if r["cases"] != first]
    return {"identical": bool(first) and not differ, "runs_differing_from_run1": differ,
            "cases": len(first)}


def markdown(record: dict[str, Any]) -> str:
    lines = ["# Premerge wall time on CPU", "", f"Machine: {machine_line(record['machine'])}. "
             f"OMP_NUM_THREADS={record['OMP_NUM_THREADS'] or 'unset (the CLI then sets one torch thread)'}; "
             f"busy-looping background processes started by the benchmark: {record['background_load']}. "
             f"Bound: {BOUND_S:.0f} s wall per run. CPU s: the run's own user+system seconds "
             "(spin-waiting threads count too).", "",
             f"| target | run | wall s | CPU s | engine s | cases (pass/fail/skip) | exit | {LOAD_HEADER} | <= 60 s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in record["targets"].items():
        for i, r in enumerate(t["runs"], 1):
            v = r.get("verdicts")
            counts = f"{len(r['cases'])} ({v['pass']}/{v['fail']}/{v['skip']})" if v else r["error"]
            lines.append(f"| {name} | {i} | {r['wall_s']} | {r['cpu_s']} | {r.get('engine_s', '-')} | {counts} | "
                         f"{r['exit_code']} | {load_cells(r)} | {'yes' if r['wall_s'] <= BOUND_S else 'NO'} |")
    lines.append("")
    for name, t in record["targets"].items():
        c = t["comparison"]
        differ = c["runs_differing_from_run1"]
        differ = f"; runs differing from run 1: {differ}" if differ else ""
        lines.append(f"- {name}: same case ids and verdicts, in the same order, in every run: "
                     f"**{'yes' if c['identical'] else 'NO'}** ({c['cases']} cases{differ})")
    return "\n".join(lines) + "\n"


def run_targets(names: list[str], runs: int, env: dict[str, str]) -> dict[str, Any]:
    """Each target ``runs`` times, one process at a time, and whether its runs agree."""
    targets: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            records = []
            for i in range(1, runs + 1):
                r = run_once(TARGETS[name], Path(scratch) / f"{name}-run{i}.json", Path(scratch) / "fixtures", env)
                records.append(r)
                print(f"{name} run {i}: {r['wall_s']} s wall, exit {r['exit_code']}, {len(r['cases'])} cases, "
                      f"other processes kept {r['others_cores']} cores busy", flush=True)
            targets[name] = {"runs": records, "comparison": compare(records)}
    return targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON path; the Markdown table goes next to it (.md)")
    ap.add_argument("--runs", type=int, default=2, help="runs per target (default 2)")
    ap.add_argument("--omp-threads", type=int, metavar="N",
                    help="set OMP_NUM_THREADS=N for the runs (torch's intra-op threads; default: inherited)")
    ap.add_argument("--background-load", type=int, default=0, metavar="N",
                    help="keep N busy-looping processes running during the runs (a shared machine, reproducibly)")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of: {', '.join(TARGETS)}")
    args = ap.parse_args(argv)
    names = args.targets.split(",")
    unknown = set(names) - set(TARGETS)
    if unknown:
        ap.error(f"unknown target(s) {', '.join(sorted(unknown))}; choose from {', '.join(TARGETS)}")
    env = dict(os.environ)
    if args.omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(args.omp_threads)
    record: dict[str, Any] = {"machine": machine_record(), "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS"),
                              "background_load": args.background_load, "bound_s": BOUND_S}
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.background_load)]
    try:
        record["targets"] = run_targets(names, args.runs, env)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(record))
    print(markdown(record))
    return 0 if all(t["comparison"]["identical"] for t in record["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
