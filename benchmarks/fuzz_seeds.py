"""Do fuzz sessions explore? Two `check --profile fuzz` runs without --seed, then two with the seed the first one
printed: how many case ids each pair shares. A benchmark of the command line, not a test (each run is minutes).

The runs are time-bounded, so two runs of one seed judge the same sequence of cases up to their deadlines, which
fall at slightly different cases: "shared" is counted against the shorter run, and ``prefix`` says whether it is
the start of the longer one. Unseeded runs should share few cases (the simplest ones Hypothesis tries first).

    python benchmarks/fuzz_seeds.py --out mla-verify-results/cpu/fuzz_seeds.json [--minutes 1] [--kernel K]

Writes the JSON record and a Markdown summary next to it (.md).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from run_record import LOAD_HEADER, REPO, load_cells, machine_line, machine_record, measured

KERNEL = "mla_verify.kernels.mutants:correct_kernel"
SEED_LINE = re.compile(r"^seed: (\d+)", re.MULTILINE)


def fuzz_run(kernel: str, minutes: float, seed: int | None, scratch: Path, name: str) -> dict[str, Any]:
    report = scratch / f"{name}.json"
    argv = [sys.executable, "-m", "mla_verify.cli", "check", "--kernel", kernel, "--device", "cpu", "--profile", "fuzz",
            "--minutes", str(minutes), "--report", str(report), "--fixtures-dir", str(scratch / "fixtures"),
            *(["--seed", str(seed)] if seed is not None else [])]
    with measured(children=True) as m:
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    printed = SEED_LINE.search(done.stdout)
    cases = [c["id"] for c in json.loads(report.read_text())["cases"]] if report.exists() else []
    return {"command": " ".join(argv[1:]), "exit_code": done.returncode, "printed_seed": printed and int(printed[1]),
            "cases": cases, **m}


def shared(a: list[str], b: list[str]) -> dict[str, Any]:
    short, long = sorted((a, b), key=len)
    return {"shared": len(set(short) & set(long)), "of": len(set(short)), "fraction": round(
        len(set(short) & set(long)) / max(1, len(set(short))), 3), "prefix": long[:len(short)] == short}


def markdown(record: dict[str, Any]) -> str:
    lines = ["# Fuzz sessions: fresh seeds, and a printed seed drawn again", "",
             f"Machine: {machine_line(record['machine'])}. `{record['kernel']}`, `--minutes {record['minutes']}`.", "",
             f"| run | --seed | printed seed | distinct cases | wall s | exit | {LOAD_HEADER} |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in record["runs"].items():
        given = r["command"].split("--seed ")[1] if "--seed" in r["command"] else "-"
        lines.append(f"| {name} | {given} | {r['printed_seed']} | {len(set(r['cases']))} | {r['wall_s']} | "
                     f"{r['exit_code']} | {load_cells(r)} |")
    f, s = record["fresh"], record["seeded"]
    lines += ["", f"- two runs without --seed share {f['shared']} of {f['of']} cases ({f['fraction']:.1%}; "
                  f"acceptance: under half: **{'yes' if f['fraction'] < 0.5 else 'NO'}**)",
              f"- two runs with the printed seed share {s['shared']} of {s['of']} ({s['fraction']:.1%}); the shorter "
              f"is the start of the longer: **{'yes' if s['prefix'] else 'NO'}**"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON path; the Markdown summary goes next to it")
    parser.add_argument("--kernel", default=KERNEL)
    parser.add_argument("--minutes", type=float, default=1.0)
    ns = parser.parse_args(argv)
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in ("fresh1", "fresh2"):
            runs[name] = fuzz_run(ns.kernel, ns.minutes, None, Path(scratch), name)
            print(f"{name}: seed {runs[name]['printed_seed']}, {len(runs[name]['cases'])} cases", flush=True)
        seed = runs["fresh1"]["printed_seed"]
        for name in ("seeded1", "seeded2"):
            runs[name] = fuzz_run(ns.kernel, ns.minutes, seed, Path(scratch), name)
            print(f"{name}: seed {runs[name]['printed_seed']}, {len(runs[name]['cases'])} cases", flush=True)
    record = {"machine": machine_record(), "kernel": ns.kernel, "minutes": ns.minutes, "runs": runs,
              "fresh": shared(runs["fresh1"]["cases"], runs["fresh2"]["cases"]),
              "seeded": shared(runs["seeded1"]["cases"], runs["seeded2"]["cases"]),
              "seeded_vs_first": shared(runs["fresh1"]["cases"], runs["seeded1"]["cases"])}
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.write_text(json.dumps(record, indent=1) + "\n")
    ns.out.with_suffix(".md").write_text(markdown(record))
    print(markdown(record))
    ok = record["fresh"]["fraction"] < 0.5 and record["seeded"]["prefix"] and all(
        r["exit_code"] == 0 for r in runs.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
