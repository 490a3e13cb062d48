"""``mla-verify check`` / ``replay`` on sparse backends, end to end in-process, through the one pipeline every
kind shares: a mutant's failure is printed with its diagnosis and a reproducer that replays to the same verdict;
the correct kernel passes; a sparse backend that cannot run here is a usage error (exit 2) before any case runs;
dense and sparse backends are one run, one report."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from test_cli import FAST, run_main

from mla_verify.core.cli_args import EXIT_INTERRUPTED

MUTANT = "mla_verify.kernels.mutants:tile_scale_shifted"
DRAWN = ("--max-examples", "5")  # the corner cases catch the mutant; a few draws show the drawn path runs


def reproducers(out: str) -> list[Path]:
    return [Path(p) for p in re.findall(r"reproducer: (\S+\.json)", out)]


def test_check_and_replay_a_sparse_mutant(capsys, tmp_path):
    code, out, _ = run_main(capsys, "check", "--kernel", MUTANT, "--device", "cpu", "--fixtures-dir", tmp_path,
                            *DRAWN)
    assert code == 1
    assert "[tile_scale_shifted]" in out
    (path,) = reproducers(out)
    meta = json.loads(path.read_text())
    assert (meta["backend"], meta["problem_kind"]) == (MUTANT, "sparse")
    code, out, _ = run_main(capsys, "replay", path)
    assert code == 1 and "verdict: FAIL (recorded: FAIL)" in out and "[tile_scale_shifted]" in out
    assert "kernel output and LSE: bit-identical to the recorded run" in out
    code, out, _ = run_main(capsys, "replay", path.with_suffix(""))  # by its stem, as replay's help allows
    assert code == 1 and "verdict: FAIL (recorded: FAIL)" in out
    # the same case against the correct kernel: the reproducer holds the problem, not the kernel's fault
    code, out, _ = run_main(capsys, "replay", path, "--kernel",
                            "mla_verify.kernels.mutants:correct_sparse_kernel")
    assert code == 0 and "verdict: PASS" in out


def test_replaying_a_sparse_case_on_a_dense_backend_is_a_usage_error(capsys, tmp_path):
    code, out, _ = run_main(capsys, "check", "--kernel", MUTANT, "--device", "cpu", "--fixtures-dir", tmp_path)
    (path,) = reproducers(out)
    code, _, err = run_main(capsys, "replay", path, "--backend", "cpu-peer")
    assert code == 2 and err.endswith(f": cpu-peer judges dense decode problems; {path} is a sparse one\n")


def test_check_passes_the_correct_sparse_kernel(capsys, tmp_path):
    code, out, _ = run_main(capsys, "check", "--kernel", "mla_verify.kernels.mutants:correct_sparse_kernel",
                            "--device", "cpu", "--fixtures-dir", tmp_path, *DRAWN)
    assert code == 0, out
    assert "correct_sparse_kernel: PASS" in out and not list(tmp_path.iterdir())
    # a kernel of one's own claims no bit-level invariance, and a row reordered changes the order of its sum
    assert ("metamorphic relations judged within tolerance (a row's reordered entries, or no bit-level claim) on "
            in out)


def test_a_sparse_backend_that_cannot_run_is_a_usage_error(capsys):
    code, out, err = run_main(capsys, "check", "--backend", "flashmla-sparse", "--device", "cpu")
    assert code == 2 and "flashmla-sparse cannot run on cpu" in err and "self-check" not in out


def test_two_sparse_kernels_failing_on_one_case_keep_a_reproducer_each(capsys, tmp_path):
    other = "mla_verify.kernels.mutants:v_rope_dims"
    code, out, _ = run_main(capsys, "check", "--kernel", MUTANT, "--kernel", other, "--device", "cpu",
                            "--fixtures-dir", tmp_path, *DRAWN)
    assert code == 1
    assert sorted(json.loads(p.read_text())["backend"] for p in reproducers(out)) == sorted([MUTANT, other])


def test_a_damaged_sparse_reproducer_is_one_line_naming_the_field(capsys, tmp_path):
    code, out, _ = run_main(capsys, "check", "--kernel", MUTANT, "--device", "cpu", "--fixtures-dir", tmp_path)
    (path,) = reproducers(out)
    meta = json.loads(path.read_text())
    for edit, words in (({"topk": "64"}, "field 'topk' = '64' is not an integer"),
                        ({"seed": None}, "field 'seed' = None is not an integer"),
                        ({"batch": -1}, "sizes must be >= 1")):  # a range: found where the case is built
        path.write_text(json.dumps({**meta, "spec": {**meta["spec"], **edit}}))
        for isolated in ("--isolate", "--no-isolate"):
            code, out, err = run_main(capsys, "replay", path, isolated)
            assert code == 2 and words in err and err.count("\n") == 1, (edit, isolated, out, err)
    path.write_text(json.dumps({**meta, "spec": {k: v for k, v in meta["spec"].items() if k != "seed"}}))
    code, _, err = run_main(capsys, "replay", path)
    assert code == 2 and "missing field(s) ['seed']" in err


def test_a_sparse_reproducer_of_the_earlier_format_still_replays(capsys, tmp_path):
    """Before one format served every kind a sparse reproducer was ``"kind": "sparse-regression"`` and its spec."""
    path = tmp_path / "sparse-0123456789abcdef.json"
    path.write_text(json.dumps({"kind": "sparse-regression", "backend": MUTANT, "source_device": "cpu",
                                "spec": {"batch": 1, "q_len": 1, "num_heads": 4, "topk": 64, "page_size": 64,
                                         "used_pages": 2, "extra_pages": 0, "fmt": "V32", "scales": "pow2",
                                         "invalid": 0.0, "invalid_front": False, "duplicates": False,
                                         "topk_lengths": None, "sink": "none", "softmax_scale": None,
                                         "values": "extreme", "seed": 3},
                                "verdict": "fail", "failures": ["out: rel L2 0.4 > 0.01"], "diagnosis": []}))
    code, out, _ = run_main(capsys, "replay", path)
    assert code == 1 and "verdict: FAIL (recorded: FAIL)" in out, out


def test_a_failing_sparse_backend_is_in_the_report_and_fails_its_junit(capsys, tmp_path):
    report = tmp_path / "r.json"
    code, out, _ = run_main(capsys, "check", "--kernel", MUTANT, "--device", "cpu", "--fixtures-dir",
                            tmp_path / "fx", "--report", report, *DRAWN)
    assert code == 1
    rep = json.loads(report.read_text())
    (backend,) = rep["backends"]
    assert backend["kind"] == "sparse" and backend["verdict"] == "fail" and backend["cases"] >= 1
    assert "[tile_scale_shifted]" in " ".join(backend["failure"]["diagnosis"])
    (fixture,) = reproducers(out)
    assert backend["failure"]["fixture"] == str(fixture)
    mine = [c for c in rep["cases"] if c["backend"] == backend["name"]]
    assert len(mine) == backend["cases"] and any(c["verdict"] == "fail" for c in mine)
    assert all(c["kind"] == "sparse" and c["description"].startswith("sparse ") and c["stats"] for c in mine
               if c["verdict"] != "skip")  # judged by the tolerance model, as a dense case is
    assert "**FAIL** -- 1 of 1 backends failed" in (tmp_path / "r.md").read_text()
    root = ET.parse(tmp_path / "r.xml").getroot()
    (suite,) = root.findall("testsuite")
    assert int(root.get("failures")) >= 1 and int(suite.get("failures")) >= 1
    assert int(suite.get("tests")) == len(suite.findall("testcase")) == len(mine)


def test_ctrl_c_in_a_dense_run_leaves_the_sparse_backend_unrun(capsys, monkeypatch, tmp_path):
    import slow_kernels

    monkeypatch.setenv("CALLS_BEFORE_CTRL_C", "2")
    monkeypatch.setattr(slow_kernels.interrupted_after_calls, "calls", 0)
    report = tmp_path / "r.json"
    code, out, _ = run_main(capsys, "check", "--kernel", "slow_kernels:interrupted_after_calls", "--kernel", MUTANT,
                            *FAST, "--fixtures-dir", tmp_path / "fx", "--report", report)
    assert code == EXIT_INTERRUPTED, out
    assert "1 backend(s) not run" in out and not reproducers(out)
    rep = json.loads(report.read_text())
    assert rep["run"]["interrupted"] and [b["kind"] for b in rep["backends"]] == ["dense"]
