"""Does `pytest --mla-kernel K` (no -n) run premerge at the speed of `mla-verify check --kernel K`? A benchmark.

Alternates the two commands on the same kernel (default: the CPU peer's function, under trtllm-gen's envelope),
``--pairs`` times, one process at a time, on the CPU with the premerge profile, and records each run's wall and
CPU seconds and the machine's load around it (run_record.measured). Neither command gets OMP_NUM_THREADS (the
case measured: the user set no thread count). ``--source DIR`` runs another checkout's code (e.g. main, to see
what the change fixes). pytest runs in an empty directory, so only the kernel's own tests run; `check` writes its
reproducers (of a failure) to a scratch directory.

    python benchmarks/pytest_vs_cli.py --out mla-verify-results/cpu/pytest_vs_cli.json [--pairs 3] [--source DIR]

Writes the JSON record and a Markdown table next to it (.md). The bound (pytest within 20% of check, the median
pair) is reported, not asserted: timings on a shared machine move with its load, which stands beside each.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from run_record import LOAD_HEADER, load_cells, machine_line, machine_record, measured

KERNEL = "mla_verify.backends.cpu_peer:cpu_peer_decode"
BOUND = 1.2  # pytest's wall time over check's: the goal is within 20%


def command(kind: str, kernel: str, scratch: Path) -> list[str]:
    if kind == "check":
        return [sys.executable, "-m", "mla_verify.cli", "check", "--kernel", kernel, "--device", "cpu",
                "--profile", "premerge", "--fixtures-dir", str(scratch / "fixtures")]
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--mla-kernel", kernel,
            "--mla-device", "cpu", "--mla-profile", "premerge", "--mla-fixtures-dir", str(scratch / "fixtures")]


def run_once(kind: str, kernel: str, source: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(source), env.get("PYTHONPATH", "")])  # before the installed copy
    with tempfile.TemporaryDirectory() as scratch:
        argv = command(kind, kernel, Path(scratch))
        with measured(children=True) as m:
            done = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True)
    tail = (done.stdout.strip().splitlines() or [done.stderr.strip()[-300:]])[-1]
    return {"kind": kind, "command": " ".join(argv[1:]), "exit_code": done.returncode, "last_line": tail, **m}


def markdown(record: dict[str, Any]) -> str:
    lines = ["# pytest --mla-kernel against mla-verify check, premerge on CPU", "",
             f"Machine: {machine_line(record['machine'])}. Kernel `{record['kernel']}`; code from "
             f"`{record['source']}` (commit {record['source_commit']}); no OMP_NUM_THREADS. Runs alternate, one "
             "process at a time.", "",
             f"| pair | command | wall s | CPU s | exit | {LOAD_HEADER} |", "|---|---|---|---|---|---|---|---|"]
    for i, run in enumerate(record["runs"]):
        lines.append(f"| {i // 2 + 1} | {run['kind']} | {run['wall_s']} | {run['cpu_s']} | {run['exit_code']} | "
                     f"{load_cells(run)} |")
    ratio = record["median_ratio"]
    verdict = "within" if ratio <= BOUND else "OVER"
    return "\n".join([*lines, "", f"pytest over check, per pair: {', '.join(map(str, record['ratios']))}; median "
                                  f"{ratio} (bound {BOUND}: **{verdict}**)"]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--source", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the checkout whose code runs")
    parser.add_argument("--kernel", default=KERNEL)
    parser.add_argument("--out", type=Path, required=True, help="JSON path; the Markdown table goes next to it")
    ns = parser.parse_args(argv)
    source = ns.source.resolve()
    runs = []
    for pair in range(ns.pairs):
        for kind in ("check", "pytest") if pair % 2 == 0 else ("pytest", "check"):  # neither always first
            runs.append(run_once(kind, ns.kernel, source))
            print(f"pair {pair + 1} {kind}: {runs[-1]['wall_s']} s, exit {runs[-1]['exit_code']}, "
                  f"others kept {runs[-1]['others_cores']} cores busy", flush=True)
    walls = {kind: [r["wall_s"] for r in runs if r["kind"] == kind] for kind in ("check", "pytest")}
    ratios = [round(p / c, 2) for c, p in zip(walls["check"], walls["pytest"])]
    commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True)
    record = {"machine": machine_record(), "kernel": ns.kernel, "source": str(source),
              "source_commit": commit.stdout.strip() or None, "runs": runs,
              "ratios": ratios, "median_ratio": statistics.median(ratios), "bound": BOUND}
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(record, indent=1) + "\n")
    ns.out.with_suffix(".md").write_text(markdown(record))
    print(markdown(record))
    return 0 if all(r["exit_code"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
