"""benchmarks/reference_ab.py's version list, on CPU: every A/B in results/ compares the versions it names, so
which file and which constants each name stands for, and its one-line refusals, are pinned here."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmark_tools import load_benchmark

ab = load_benchmark("reference_ab")
TREE = Path(__file__).resolve().parents[1] / "mla_verify" / "reference.py"


def versions(tmp_path: Path, old: bool = False, files: tuple[str, ...] = (), variants: tuple[str, ...] = (),
             profile: tuple[str, ...] = ()) -> list:
    (tmp_path / "cand.py").write_text(TREE.read_text())
    ns = argparse.Namespace(old=TREE if old else None, file=[f.replace("CAND", str(tmp_path / "cand.py"))
                                                              for f in files],
                            variant=list(variants), profile=list(profile))
    return ab.versions(ns)


def test_names_stand_for_their_files_and_constants(tmp_path: Path) -> None:
    listed = versions(tmp_path, old=True, files=("cand=CAND",),
                      variants=("r6:GROUP_LENGTH_RATIO=0.6", "cand.big:CHUNK_OVER_CACHE=3,MIN_GROUP_BYTES=1"))
    by_name = {name: (module, overrides) for name, module, overrides in listed}
    assert list(by_name) == ["new", "old", "cand", "r6", "cand.big"]
    assert by_name["new"][0] is ab.reference and by_name["r6"][0] is ab.reference
    assert by_name["old"][0].__file__ == str(TREE) and by_name["old"][0] is not ab.reference
    assert by_name["cand.big"][0] is by_name["cand"][0]  # a file's variant overrides that file's constants
    assert by_name["r6"][1] == {"GROUP_LENGTH_RATIO": 0.6}
    assert by_name["cand.big"][1] == {"CHUNK_OVER_CACHE": 3, "MIN_GROUP_BYTES": 1}


@pytest.mark.parametrize("kwargs, message", [
    ({"files": ("cand",)}, "want NAME=PATH"),
    ({"files": ("old=CAND",)}, "other than new and old"),
    ({"files": ("cand=CAND", "cand=CAND")}, "want NAME=PATH"),
    ({"variants": ("x.r:GROUP_LENGTH_RATIO=0.6",)}, "no such file was given"),
    ({"variants": ("r:NO_SUCH=1",)}, "has no constant NO_SUCH"),
    ({"variants": ("r:GROUP_LENGTH_RATIO='a'",)}, "GROUP_LENGTH_RATIO is a float"),
    ({"variants": ("new:GROUP_LENGTH_RATIO=0.6",)}, "variant names must differ"),
    ({"profile": ("nobody",)}, "--profile names no variant"),
])
def test_bad_versions_are_refused(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ab.UsageError, match=message):
        versions(tmp_path, **kwargs)


def test_a_bad_option_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert ab.main(["--out", str(tmp_path / "out"), "--file", f"cand={tmp_path / 'missing.py'}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("reference_ab: --file ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()  # refused before anything is written
