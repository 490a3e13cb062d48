"""Where the reference turns host-bound: its host issue time next to its wall time, from reference_ab.py's JSON.

    python3 benchmarks/ab_summary.py results/h200 --case B128 --variant new --variant old

Reads every reference_ab.json under the paths given (files or folders) and prints one row per case and version
that the filters keep, sorted by issue time: the host's time to issue the call, the wall time to its result,
their difference (how long the GPU ran on after the host was done) and the ratio to fa3, marked where it is
over --goal. On a fast host the wall time stays at the GPU's floor while the issue time moves; past some issue
time the two move together, and the table shows where that is.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Row:
    source: str
    case: str
    variant: str
    issue_ms: float
    wall_ms: float
    ratio: float | None  # wall over fa3's median; None where fa3 did not run

    def line(self, goal: float) -> str:
        ratio = "-" if self.ratio is None else f"{self.ratio:5.2f}x" + (" OVER" if self.ratio > goal else "")
        return (f"{self.issue_ms:7.3f} {self.wall_ms:7.3f} {self.wall_ms - self.issue_ms:+7.3f}  {ratio:11s} "
                f"{self.variant:10s} {self.case:30s} {self.source}")


def rows_of(path: Path, cases: list[str], variants: list[str]) -> list[Row]:
    """The rows of one reference_ab.json whose case starts with one of ``cases`` and whose version is in
    ``variants`` (each filter empty: everything)."""
    data = json.loads(path.read_text())
    rows = []
    for case in data["cases"]:
        if cases and not any(case["case"].startswith(c) for c in cases):
            continue
        fa3 = case.get("fa3", {}).get("median_ms")
        for name, v in case["variants"].items():
            if variants and name not in variants:
                continue
            wall = v["median_wall_ms"]
            rows.append(Row(str(path), case["case"], name, v["median_issue_ms"], wall, wall / fa3 if fa3 else None))
    return rows


def collect(paths: list[Path], cases: list[str], variants: list[str]) -> list[Row]:
    rows = []
    for path in paths:
        files = sorted(path.rglob("reference_ab.json")) if path.is_dir() else [path]
        for f in files:
            rows += rows_of(f, cases, variants)
    return sorted(rows, key=lambda r: r.issue_ms)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path, help="reference_ab.json files, or folders to search")
    parser.add_argument("--case", action="append", default=[], help="a case key prefix (e.g. B128); repeatable")
    parser.add_argument("--variant", action="append", default=[], help="a version's name; repeatable")
    parser.add_argument("--goal", type=float, default=10.0, help="ratio to fa3 marked OVER past it (issue 2: 10)")
    ns = parser.parse_args(argv)
    try:
        rows = collect(ns.paths, ns.case, ns.variant)
    except FileNotFoundError as exc:
        print(f"ab_summary: no such file: {exc.filename}", file=sys.stderr)
        return 2
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        print(f"ab_summary: not a reference_ab.py result: {exc!r}", file=sys.stderr)
        return 2
    if not rows:
        print("ab_summary: no reference_ab.json rows match", file=sys.stderr)
        return 2
    print("  issue    wall  wall-issue  x fa3      version    case                           file")
    for row in rows:
        print(row.line(ns.goal))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
