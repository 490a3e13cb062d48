"""Wall time and repeatability of the premerge gate on this machine (docs/verified.md): a benchmark.

Runs the real command line, ``python -m mla_verify.cli check ... --device cpu --profile premerge --report``,
``--runs`` times (default 2) for each target -- the correct CPU kernel (``--kernel
mla_verify.kernels.mutants:correct_kernel``) and the CPU peer (``--backend cpu-peer``) -- one run at a time, and
records each run's wall and CPU seconds (process start to exit, imports included), its exit code, and the
machine's load around it (run_record.measured). Then it compares the runs' reports: the ordered (case id,
verdict) lists must be equal. The acceptance bound (60 s per run) is reported, not asserted: the time depends
on what else the machine runs, which is why the load stands beside every number.

    python benchmarks/premerge_time.py --out mla-verify-results/cpu/premerge_time.json [--runs 2] [--omp-threads 1]
                                       [--background-load 2] [--baseline DIR]

``--omp-threads`` sets OMP_NUM_THREADS for the runs: on a 2-core machine shared with other work, torch's
intra-op threads wait on each other and the same run takes several times longer (see docs/verified.md).
``--background-load N`` reproduces such a machine: N busy-looping processes run beside every run.

``--baseline DIR`` times another source tree of mla-verify beside this one (e.g. ``git archive main | tar -x -C
DIR``), alternating: each run of a target runs both trees back to back, which goes first alternating, so that
both meet the same load. Both must give the same case ids and verdicts; the table gives each tree's median and
their ratio.

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
from statistics import median
from typing import Any

from run_record import LOAD_HEADER, REPO, load_cells, machine_line, machine_record, measured

TARGETS = {"correct_kernel": ["--kernel", "mla_verify.kernels.mutants:correct_kernel"],
           "cpu-peer": ["--backend", "cpu-peer"]}
BOUND_S = 60.0  # the goal: premerge on the 2-core CPU machine takes <= 60 s


def run_once(target: list[str], report: Path, fixtures: Path, env: dict[str, str], tree: Path = REPO) -> dict[str, Any]:
    """One ``mla-verify check`` process of the mla-verify in ``tree``: its timing and load, exit code, and (case
    id, verdict) list."""
    command = [sys.executable, "-m", "mla_verify.cli", "check", *target, "--device", "cpu",
               "--profile", "premerge", "--report", str(report), "--fixtures-dir", str(fixtures)]
    with measured(children=True) as m:  # `-m` from the tree: its package first on the path
        proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
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
    baseline = record.get("baseline")
    lines = ["# Premerge wall time on CPU", "", f"Machine: {machine_line(record['machine'])}. "
             f"OMP_NUM_THREADS={record['OMP_NUM_THREADS'] or 'unset (the CLI then sets one torch thread)'}; "
             f"busy-looping background processes started by the benchmark: {record['background_load']}. "
             f"Bound: {BOUND_S:.0f} s wall per run. CPU s: the run's own user+system seconds "
             "(spin-waiting threads count too)." + (f" Baseline: the tree in {baseline}, its runs alternating "
                                                      "with this tree's (which went first alternates)."
                                                      if baseline else ""), "",
             f"| target | tree | run | wall s | CPU s | engine s | cases (pass/fail/skip) | exit | {LOAD_HEADER} "
             "| <= 60 s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, t in record["targets"].items():
        for tree in (["this", "baseline"] if baseline else ["this"]):
            for i, r in enumerate(t["runs"] if tree == "this" else t["baseline"]["runs"], 1):
                v = r.get("verdicts")
                counts = f"{len(r['cases'])} ({v['pass']}/{v['fail']}/{v['skip']})" if v else r["error"]
                lines.append(f"| {name} | {tree} | {i} | {r['wall_s']} | {r['cpu_s']} | {r.get('engine_s', '-')} | "
                             f"{counts} | {r['exit_code']} | {load_cells(r)} | "
                             f"{'yes' if r['wall_s'] <= BOUND_S else 'NO'} |")
    lines.append("")
    for name, t in record["targets"].items():
        c = t["comparison"]
        differ = c["runs_differing_from_run1"]
        differ = f"; runs differing from run 1: {differ}" if differ else ""
        lines.append(f"- {name}: same case ids and verdicts, in the same order, in every run: "
                     f"**{'yes' if c['identical'] else 'NO'}** ({c['cases']} cases{differ})")
        if baseline:
            b = t["baseline"]
            lines.append(f"  - as the baseline's runs: **{'yes' if b['same_cases'] else 'NO'}**; median wall "
                         f"{b['median_wall_s']['this']} s here, {b['median_wall_s']['baseline']} s the baseline's "
                         f"(ratio {b['wall_ratio']}); median CPU {b['median_cpu_s']['this']} s, "
                         f"{b['median_cpu_s']['baseline']} s")
    return "\n".join(lines) + "\n"


def run_targets(names: list[str], runs: int, env: dict[str, str], baseline: Path | None = None) -> dict[str, Any]:
    """Each target ``runs`` times, one process at a time, and whether its runs agree; with ``baseline``, each
    run of this tree beside one of that tree, alternating which goes first, and whether the two agree."""
    targets: dict[str, Any] = {}
    trees = {"this": REPO, **({"baseline": baseline} if baseline else {})}
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            records: dict[str, list[dict[str, Any]]] = {tree: [] for tree in trees}
            for i in range(1, runs + 1):
                for tree in (list(trees) if i % 2 else list(reversed(trees))):
                    r = run_once(TARGETS[name], Path(scratch) / f"{name}-{tree}-run{i}.json",
                                 Path(scratch) / "fixtures", env, trees[tree])
                    records[tree].append(r)
                    print(f"{name} ({tree}) run {i}: {r['wall_s']} s wall, exit {r['exit_code']}, "
                          f"{len(r['cases'])} cases, other processes kept {r['others_cores']} cores busy", flush=True)
            targets[name] = {"runs": records["this"], "comparison": compare(records["this"])}
            if baseline:
                targets[name]["baseline"] = against(records["this"], records["baseline"])
    return targets


def against(these: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict[str, Any]:
    """The baseline tree's runs, whether they drew this tree's cases with its verdicts, and the two trees'
    median wall and CPU seconds."""
    walls = {"this": round(median(r["wall_s"] for r in these), 3),
             "baseline": round(median(r["wall_s"] for r in baseline), 3)}
    return {"runs": baseline, "comparison": compare(baseline),
            "same_cases": bool(these[0]["cases"]) and all(r["cases"] == these[0]["cases"] for r in baseline),
            "median_wall_s": walls, "wall_ratio": round(walls["this"] / walls["baseline"], 3),
            "median_cpu_s": {"this": round(median(r["cpu_s"] for r in these), 3),
                             "baseline": round(median(r["cpu_s"] for r in baseline), 3)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="JSON path; the Markdown table goes next to it (.md)")
    ap.add_argument("--runs", type=int, default=2, help="runs per target (default 2)")
    ap.add_argument("--omp-threads", type=int, metavar="N",
                    help="set OMP_NUM_THREADS=N for the runs (torch's intra-op threads; default: inherited)")
    ap.add_argument("--background-load", type=int, default=0, metavar="N",
                    help="keep N busy-looping processes running during the runs (a shared machine, reproducibly)")
    ap.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated, of: {', '.join(TARGETS)}")
    ap.add_argument("--baseline", type=Path, metavar="DIR",
                    help="another source tree of mla-verify, timed beside this one, alternating")
    args = ap.parse_args(argv)
    names = args.targets.split(",")
    unknown = set(names) - set(TARGETS)
    if unknown:
        ap.error(f"unknown target(s) {', '.join(sorted(unknown))}; choose from {', '.join(TARGETS)}")
    env = dict(os.environ)
    if args.omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(args.omp_threads)
    record: dict[str, Any] = {"machine": machine_record(), "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS"),
                              "background_load": args.background_load, "bound_s": BOUND_S,
                              "baseline": None if args.baseline is None else str(args.baseline.resolve())}
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.background_load)]
    try:
        record["targets"] = run_targets(names, args.runs, env, args.baseline)
    finally:
        for burner in burners:
            burner.kill()
            burner.wait()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(record))
    print(markdown(record))
    return 0 if all(t["comparison"]["identical"] and t.get("baseline", {"same_cases": True})["same_cases"]
                    for t in record["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
