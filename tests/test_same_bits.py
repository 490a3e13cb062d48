"""benchmarks/same_bits.py: the check that clears a candidate reference as computing the same bits."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmark_tools import load_benchmark

sb = load_benchmark("same_bits")
TREE = Path(__file__).resolve().parents[1] / "mla_verify" / "reference.py"


def test_the_tree_itself_gives_the_same_bits(capsys: pytest.CaptureFixture) -> None:
    assert sb.main([str(TREE), "--problems", "4"]) == 0
    assert "same bits: 4 problems, 24 calls" in capsys.readouterr().out


def test_a_candidate_off_in_the_last_place_is_caught(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # the smallest change a speed-up could make by accident: the output scaled by 1 + 2^-40 (beyond float32,
    # inside float64), so only the float64 mode differs -- the first mode tried
    source = TREE.read_text()
    marker = "    return ReferenceResult(unsorted(out)"
    assert marker in source
    candidate = tmp_path / "reference.py"
    candidate.write_text(source.replace(marker, "    out = out * (1 + 2 ** -40)\n" + marker))
    assert sb.main([str(candidate), "--problems", "2"]) == 1
    assert "DIFFERENT: problem 0" in capsys.readouterr().out


def test_a_missing_file_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert sb.main([str(tmp_path / "nope.py")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("same_bits: file ") and err.count("\n") == 1
