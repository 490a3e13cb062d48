"""benchmarks/ab_summary.py, on synthetic reference_ab.py results: its table backs the host-bound rule in
docs/gpu_results.md, so its filters, its order and its ratio are pinned here."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark_tools import load_benchmark

ab = load_benchmark("ab_summary")


def result(path: Path, fa3_ms: float | None, **variants: tuple[float, float]) -> Path:
    """A reference_ab.json with one B128 and one B512 case; ``variants``: name -> (issue ms, wall ms)."""
    cases = []
    for key in ("B128-H128-S4096-p64-bf16-q1", "B512-H16-S4096-p64-bf16-q1"):
        cases.append({"case": key, "fa3": {"status": "ok", "median_ms": fa3_ms} if fa3_ms else {"status": "skip"},
                      "variants": {name: {"median_issue_ms": i, "median_wall_ms": w}
                                   for name, (i, w) in variants.items()}})
    path.mkdir(parents=True, exist_ok=True)
    (path / "reference_ab.json").write_text(json.dumps({"cases": cases}))
    return path / "reference_ab.json"


def test_rows_are_filtered_and_sorted_by_issue_time(tmp_path: Path) -> None:
    result(tmp_path / "run1" / "refab", 0.2, new=(1.9, 2.0), two=(0.8, 1.9))
    result(tmp_path / "run2" / "refab", 0.2, new=(1.0, 2.05))  # the shorter issue, the longer wall
    rows = ab.collect([tmp_path], ["B128"], ["new"])
    assert [(Path(r.source).relative_to(tmp_path), r.issue_ms) for r in rows] == [
        (Path("run2/refab/reference_ab.json"), 1.0), (Path("run1/refab/reference_ab.json"), 1.9)]
    assert all(r.case.startswith("B128") and r.variant == "new" for r in rows)
    assert len(ab.collect([tmp_path], [], [])) == 6  # no filter: both cases, every version


def test_the_ratio_is_wall_over_fa3_and_marked_over_the_goal(tmp_path: Path) -> None:
    f = result(tmp_path, 0.2, slow=(2.1, 2.2), fast=(1.0, 1.8))
    by_name = {r.variant: r for r in ab.collect([f], ["B128"], [])}
    assert by_name["slow"].ratio == pytest.approx(11.0)
    assert "OVER" in by_name["slow"].line(10.0) and "OVER" not in by_name["fast"].line(10.0)
    assert "+0.100" in by_name["slow"].line(10.0)  # wall - issue: the GPU's time after the host was done


def test_a_case_without_fa3_has_no_ratio(tmp_path: Path) -> None:
    (row,) = ab.collect([result(tmp_path, None, new=(1.0, 1.5))], ["B512"], [])
    assert row.ratio is None and " - " in row.line(10.0)


def not_a_result(directory: Path) -> Path:
    (directory / "x.json").write_text("{}")
    return directory / "x.json"


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing.json", "no such file"),
    (not_a_result, "not a reference_ab.py result"),
    (lambda d: result(d, 0.2, new=(1.0, 1.5)), "no reference_ab.json rows match"),  # no B64 case in it
])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture, make, message) -> None:
    assert ab.main([str(make(tmp_path)), "--case", "B64"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
