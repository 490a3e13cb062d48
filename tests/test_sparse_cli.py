"""``mla-verify check`` / ``replay`` on sparse backends, end to end in-process: a mutant's failure is printed with
its diagnosis and a reproducer that replays to the same verdict; the correct kernel passes; a sparse backend
that cannot run here is a usage error (exit 2) before any case runs."""
from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from test_cli import BAD, FAST, run_main

from mla_verify.core.cli_args import EXIT_INTERRUPTED

MUTANT = "mla_verify.kernels.sparse_mutants:tile_scale_shifted"
DRAWN = ("--max-examples", "5")  # the corner cases catch the mutant; a few draws show the drawn path runs


def test_check_and_replay_a_sparse_mutant(capsys, tmp_path):
    code, out, _ = run_main(capsys, "check", "--kernel", MUTANT, "--device", "cpu", "--fixtures-dir", tmp_path,
                            *DRAWN)
    assert code == 1
    assert "diagnosis: tile_scale_shifted:" in out
    (path,) = tmp_path.glob("sparse-*.json")
    assert json.loads(path.read_text())["backend"] == MUTANT
    code, out, _ = run_main(capsys, "replay", path)
    assert code == 1 and "verdict: FAIL (recorded: FAIL)" in out and "diagnosis: tile_scale_shifted:" in out
    code, out, _ = run_main(capsys, "replay", path.with_suffix(""))  # by its stem, as replay's help allows
    assert code == 1 and "verdict: FAIL (recorded: FAIL)" in out
    # the same case against the correct kernel: the reproducer holds the problem, not the kernel's fault
    code, out, _ = run_main(capsys, "replay", path, "--kernel",
                            "mla_verify.kernels.sparse_mutants:correct_sparse_kernel")
    assert code == 0 and "verdict: PASS" in out


def test_check_passes_the_correct_sparse_kernel(capsys, tmp_path):
    code, out, _ = run_main(capsys, "check", "--kernel", "mla_verify.kernels.sparse_mutants:correct_sparse_kernel",
                            "--device", "cpu", "--fixtures-dir", tmp_path, *DRAWN)
    assert code == 0, out
    assert "correct_sparse_kernel]: PASS" in out and not list(tmp_path.iterdir())


def test_a_sparse_backend_that_cannot_run_is_a_usage_error(capsys):
    code, out, err = run_main(capsys, "check", "--backend", "flashmla-sparse", "--device", "cpu")
    assert code == 2 and "flashmla-sparse cannot run on cpu" in err and "self-check" not in out


def test_two_sparse_kernels_failing_on_one_case_keep_a_reproducer_each(capsys, tmp_path):
    other = "mla_verify.kernels.sparse_mutants:v_rope_dims"
    code, _, _ = run_main(capsys, "check", "--kernel", MUTANT, "--kernel", other, "--device", "cpu",
                          "--fixtures-dir", tmp_path, *DRAWN)
    assert code == 1
    assert sorted(json.loads(p.read_text())["backend"] for p in tmp_path.glob("sparse-*.json")) == \
        sorted([MUTANT, other])


def test_a_damaged_sparse_reproducer_is_one_line_naming_the_field(capsys, tmp_path):
    code, _, _ = run_main(capsys, "check", "--kernel", MUTANT, "--device", "cpu", "--fixtures-dir", tmp_path)
    (path,) = tmp_path.glob("sparse-*.json")
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


def test_a_failing_sparse_backend_is_in_the_report_and_fails_its_junit(capsys, tmp_path):
    report = tmp_path / "r.json"
    code, _, _ = run_main(capsys, "check", "--kernel", MUTANT, "--device", "cpu", "--fixtures-dir", tmp_path / "fx",
                          "--report", report, *DRAWN)
    assert code == 1
    rep = json.loads(report.read_text())
    (backend,) = rep["backends"]
    assert backend["kind"] == "sparse" and backend["verdict"] == "fail" and backend["cases"] >= 1
    assert "tile_scale_shifted:" in " ".join(backend["failure"]["diagnosis"])
    (fixture,) = (tmp_path / "fx").glob("sparse-*.json")
    assert backend["failure"]["fixture"] == str(fixture)
    mine = [c for c in rep["sparse_cases"] if c["backend"] == backend["name"]]
    assert len(mine) == backend["cases"] and any(c["verdict"] == "fail" for c in mine)
    assert all(c["backend"] != backend["name"] for c in rep["cases"])  # dense readers see no sparse spec
    assert "**FAIL** -- 1 of 1 backends failed" in (tmp_path / "r.md").read_text()
    root = ET.parse(tmp_path / "r.xml").getroot()
    (suite,) = root.findall("testsuite")
    assert int(root.get("failures")) >= 1 and int(suite.get("failures")) >= 1
    assert int(suite.get("tests")) == len(suite.findall("testcase")) == len(mine)


def test_ctrl_c_in_the_sparse_phase_keeps_the_dense_failure(capsys, monkeypatch, tmp_path):
    from mla_verify.run import sparse_check

    class Interrupted:  # the sparse phase's first case is where Ctrl-C lands
        def __call__(self, spec, diagnose):
            raise KeyboardInterrupt

        def close(self) -> None:
            pass

    monkeypatch.setattr(sparse_check, "sparse_case_judge", lambda *args, **kwargs: Interrupted())
    report = tmp_path / "r.json"
    code, out, _ = run_main(capsys, "check", "--kernel", BAD, "--kernel", MUTANT, *FAST, "--fixtures-dir",
                            tmp_path / "fx", "--report", report)
    assert code == EXIT_INTERRUPTED, out
    assert "FAIL cli_kernels:wrong_scale" in out
    path = re.search(r"reproducer: (\S+)", out).group(1)
    assert Path(path).is_file() and not Path(path).name.startswith("sparse-")
    rep = json.loads(report.read_text())
    assert rep["run"]["interrupted"] and [b["kind"] for b in rep["backends"]] == ["dense", "sparse"]


def test_a_dense_run_interrupted_skips_the_sparse_phase(capsys, monkeypatch, tmp_path):
    import slow_kernels

    from mla_verify.run import sparse_check

    def never(*args, **kwargs):
        raise AssertionError("the sparse phase ran after Ctrl-C")

    monkeypatch.setattr(sparse_check, "sparse_case_judge", never)
    monkeypatch.setenv("CALLS_BEFORE_CTRL_C", "2")
    monkeypatch.setattr(slow_kernels.interrupted_after_calls, "calls", 0)
    code, out, _ = run_main(capsys, "check", "--kernel", "slow_kernels:interrupted_after_calls", "--kernel", MUTANT,
                            *FAST, "--fixtures-dir", tmp_path)
    assert code == EXIT_INTERRUPTED, out
    assert "1 backend(s) not run" in out and not list(tmp_path.glob("sparse-*.json"))


def test_ctrl_c_while_shrinking_keeps_the_failure_and_the_cases(monkeypatch):
    """As engine.verify: Ctrl-C after a failure was found (here, the call after it) reports it, cases kept."""
    from mla_verify.backends import named_sparse_backend
    from mla_verify.run import sparse_check

    real = sparse_check.sparse_case_judge

    class CtrlCAfterAFailure:
        def __init__(self, *args, **kwargs) -> None:
            self.judge, self.failed = real(*args, **kwargs), False

        def __call__(self, spec, diagnose):
            if self.failed:
                raise KeyboardInterrupt
            case = self.judge(spec, diagnose)
            self.failed = case.verdict == "fail"
            return case

        def close(self) -> None:
            self.judge.close()

    monkeypatch.setattr(sparse_check, "sparse_case_judge", CtrlCAfterAFailure)
    run = sparse_check.verify_sparse(named_sparse_backend(MUTANT), "cpu", "dev", max_examples=20)
    assert run.interrupted and run.verdict == "fail"
    assert run.failure is run.cases[-1] and run.failure.verdict == "fail"
