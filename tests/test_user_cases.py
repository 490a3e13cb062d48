"""A user's own cases (``--cases DIR``, ``--mla-cases DIR``; records/cases.py): a hand-written spec, tensors
saved with ``save_case`` (no spec rebuilds them) and reproducers of earlier runs are judged first, before any
corner or drawn case, and a failing one is reported like any failure; a file that is no case is one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mla_verify.backends.user_kernel import load_kernel
from mla_verify.cli.main import main
from mla_verify.core.errors import MLAVerifyError
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.records.cases import load_case, load_cases, save_case
from mla_verify.records.fixtures import fixture_paths, load_fixture
from mla_verify.run.engine import verify

GOOD, BAD = "cli_kernels:good", "cli_kernels:wrong_scale"  # tests/cli_kernels.py: a tiny envelope
# one token: the softmax of one key is 1 at any scale, so the wrongly scaled kernel's output is right (no LSE)
PASSING_SPEC = {"spec": {"seq_lens": [1], "num_heads": 1, "page_size": 4, "kv_lora_rank": 256},
                "layout": {"return_lse": False}}


def _captured(directory: Path, name: str = "b_captured", seq_lens: tuple[int, ...] = (9, 20)) -> Path:
    """Tensors of a call, as a user captures them: values no spec draws (the query scaled by 3)."""
    p = build_problem(ProblemSpec(seq_lens=seq_lens, num_heads=2, page_size=4, kv_lora_rank=256, seed=5))
    return save_case(directory, name, query=p.query * 3, kv_cache=p.kv_cache, block_tables=p.block_table,
                     seq_lens=p.seq_lens, kv_lora_rank=256, bmm1_scale=p.bmm1_scale, bmm2_scale=0.5,
                     extra={"note": "from my engine's step 1234"})


@pytest.fixture
def case_dir(tmp_path: Path) -> Path:
    """One hand-written spec that the wrongly scaled kernel passes, then one tensors-only case it fails."""
    cases = tmp_path / "cases"
    cases.mkdir()
    (cases / "a_spec.json").write_text(json.dumps(PASSING_SPEC))
    _captured(cases)
    return cases


def test_a_spec_and_a_tensors_only_case_are_loaded_as_written(case_dir):
    spec_case, stored = load_cases(case_dir)
    assert spec_case.problem is None and spec_case.spec == ProblemSpec.from_json(PASSING_SPEC["spec"])
    assert not spec_case.layout.return_lse
    fx = load_fixture(case_dir / "b_captured.json")
    assert fx.spec is None and stored.problem is not None  # tensors only: a spec describes them
    assert stored.spec.values.startswith("stored:") and stored.spec.seq_lens == (9, 20)
    assert stored.spec.bmm2_scale == 0.5 and torch.equal(stored.problem.query, fx.problem.query)


def test_the_users_cases_are_judged_first_and_a_failing_one_is_the_failure(case_dir):
    given = load_cases(case_dir)
    result = verify(load_kernel(BAD), "cpu", "premerge", given_cases=given)
    assert [(c.spec, c.verdict) for c in result.cases[:2]] == [(given[0].spec, "pass"), (given[1].spec, "fail")]
    # a failing case of the user's ends the search, as a failing explicit example ends Hypothesis's
    assert len(result.cases) == 2
    assert result.failure.spec == given[1].spec and result.given_origin == given[1].origin
    assert result.failure.diagnosis and result.failure.problem is not None
    passing = verify(load_kernel(GOOD), "cpu", "dev", given_cases=given)
    assert passing.verdict == "pass" and [c.spec for c in passing.cases[:2]] == [g.spec for g in given]
    assert len(passing.cases) > 2  # then the drawn cases, as without them


def test_check_judges_a_case_directory_first_and_reports_its_failure(case_dir, tmp_path, capsys):
    report = tmp_path / "run.json"
    code = main(["check", "--kernel", BAD, "--device", "cpu", "--cases", str(case_dir), "--report", str(report),
                 "--fixtures-dir", str(tmp_path / "fx")])
    out = capsys.readouterr().out
    assert code == 1
    assert f"your cases: 2 from {case_dir} (2 dense), judged first on each backend of their kind" in out
    assert f"  from your case {case_dir / 'b_captured.json'} (judged before any drawn case)" in out
    cases = json.loads(report.read_text())["cases"]
    assert [c["verdict"] for c in cases] == ["pass", "fail"]
    assert cases[1]["spec"]["values"].startswith("stored:")
    # its reproducer stores the tensors (no spec rebuilds them), and replays as it failed
    reproducer = next(line.split()[-1] for line in out.splitlines() if "re-run: mla-verify replay" in line)
    assert load_fixture(reproducer).problem is not None
    assert main(["replay", reproducer]) == 1
    assert "verdict: FAIL (recorded: FAIL)" in capsys.readouterr().out


def test_a_tensors_only_fixture_replays(case_dir, capsys):
    # it was refused with "records no problem spec": its tensors say everything
    code = main(["replay", str(case_dir / "b_captured.json"), "--kernel", GOOD])
    out = capsys.readouterr().out
    assert code == 0 and "values=stored:" in out and "verdict: PASS" in out


def test_a_reproducer_of_an_earlier_run_is_a_regression_case(tmp_path, capsys):
    fixtures, cases = tmp_path / "fx", tmp_path / "cases"
    assert main(["check", "--kernel", BAD, "--device", "cpu", "--profile", "dev", "--fixtures-dir", str(fixtures)]) == 1
    reproducer = next(fixtures.glob("*.json"))
    cases.mkdir()
    for part in fixture_paths(reproducer):  # its JSON, and the kernel's output beside it
        if part.exists():
            shutil.copy(part, cases)
    capsys.readouterr()
    spec = load_fixture(reproducer).spec
    assert main(["check", "--kernel", BAD, "--device", "cpu", "--profile", "dev", "--cases", str(cases),
                 "--fixtures-dir", str(fixtures)]) == 1
    out = capsys.readouterr().out
    assert f"from your case {cases / reproducer.name}" in out and f"minimal case: {spec.describe()}" in out
    assert main(["check", "--kernel", GOOD, "--device", "cpu", "--profile", "dev", "--cases", str(cases)]) == 0


def test_a_sparse_case_is_judged_first_on_sparse_backends_and_only_there(tmp_path):
    cases = tmp_path / "cases"
    cases.mkdir()
    (cases / "a_dense.json").write_text(json.dumps(PASSING_SPEC))
    (cases / "b_sparse.json").write_text(json.dumps(
        {"problem_kind": "sparse", "spec": {"batch": 1, "num_heads": 2, "topk": 64}, "metamorphic": "pages"}))
    dense_case, sparse_case = load_cases(cases)
    assert sparse_case.layout.pass_out is False  # a sparse kernel allocates its output unless told otherwise
    # the flashmla-sparse convention's mutant that takes V from the wrong dims
    wrong = verify(load_kernel("mla_verify.kernels.mutants:v_rope_dims"), "cpu", "dev", given_cases=[dense_case,
                                                                                                     sparse_case])
    assert wrong.cases[0].spec == sparse_case.spec and wrong.cases[0].verdict == "fail"
    assert wrong.given_origin == sparse_case.origin and wrong.failure.verdict == "fail"
    dense = verify(load_kernel(GOOD), "cpu", "dev", max_examples=2, given_cases=[dense_case, sparse_case])
    assert dense.cases[0].spec == dense_case.spec and sparse_case.spec not in [c.spec for c in dense.cases]


@pytest.mark.parametrize("flag", [None, "--isolate"])
def test_tensors_only_case_that_crashes_the_kernel_is_a_crash_of_that_case(tmp_path, capsys, flag):
    # no spec rebuilds it, so no worker of the fork server can judge it: a copy of this process that holds its
    # tensors does (supervised: the search's copy, then a copy of its own; isolated: a copy of its own)
    cases = tmp_path / "cases"
    _captured(cases, "crashes", (9, 20, 5))  # crashing_kernels.CRASH_BATCH requests
    code = main(["check", "--kernel", "crashing_kernels:segfaults_on_big_batches", "--device", "cpu", "--cases",
                 str(cases), "--fixtures-dir", str(tmp_path / "fx"), *([flag] if flag else [])])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert "FAIL crashing_kernels:segfaults_on_big_batches: the kernel crashed: killed by SIGSEGV" in out
    assert f"from your case {cases / 'crashes.json'}" in out and "Traceback" not in err
    # its reproducer stores the tensors (a crash keeps its problem only where no spec rebuilds it), and crashes
    reproducer = next(line.split()[-1] for line in out.splitlines() if "re-run: mla-verify replay" in line)
    assert load_fixture(reproducer).problem is not None
    assert main(["replay", reproducer]) == 1
    assert "crashed again (same signal/error): killed by SIGSEGV" in capsys.readouterr().out


@pytest.mark.parametrize("content,match", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "neither a case"),
    ('{"specs": {"seq_lens": [4]}}', "neither a case"),
    ('{"spec": {"seq_lens": [4]}, "layuot": {}}', "case: unknown field\\(s\\) \\['layuot'\\]"),
    ('{"spec": {"q_len": 2}}', "spec: 'seq_lens' is required"),
    ('{"spec": {"seq_lens": [1], "q_len": 2}}', "seq_lens\\[0\\] = 1 is shorter than q_len = 2"),
    ('{"spec": {"seq_lens": [4], "heads": 2}}', "unknown field\\(s\\) \\['heads'\\]"),
    ('{"spec": {"seq_lens": [4]}, "layout": {"cache_dims": 5}}', "'cache_dims' = 5 is not one of \\[3, 4\\]"),
    ('{"spec": {"seq_lens": [4]}, "metamorphic": "bogus"}', "metamorphic 'bogus' is not one of"),
    ('{"format": "mla-verify-fixture", "format_version": 2, "spec": {"seq_lens": [4]}}', "safetensors: missing"),
    ('{"problem_kind": "sparse", "spec": {"fmt": "V99"}}', "'fmt' = 'V99' is not one of"),
    ('{"problem_kind": "sparse", "spec": {}, "metamorphic": "batch"}', "'batch' is not one of .* \\(sparse decode\\)"),
    ('{"problem_kind": "dens", "spec": {"seq_lens": [4]}}', "'problem_kind' = 'dens' is not one of"),
])
def test_a_file_that_is_no_case_is_one_line(tmp_path, content, match):
    path = tmp_path / "case.json"
    path.write_text(content)
    with pytest.raises(MLAVerifyError, match=match) as e:
        load_case(path)
    assert str(path.with_suffix("")) in str(e.value) and "\n" not in str(e.value)  # names the file


def test_a_bad_case_directory_is_exit_2_with_one_line(tmp_path, case_dir, capsys):
    for directory, match in ((tmp_path / "nowhere", "does not exist"), (tmp_path / "empty", "holds no case")):
        (tmp_path / "empty").mkdir(exist_ok=True)
        assert main(["check", "--kernel", GOOD, "--device", "cpu", "--cases", str(directory)]) == 2
        err = capsys.readouterr().err
        assert match in err and err.count("\n") == 1
    fixture_paths(case_dir / "b_captured.json")[0].unlink()  # a half-copied fixture: its tensors missing
    assert main(["check", "--kernel", GOOD, "--device", "cpu", "--cases", str(case_dir)]) == 2
    out, err = capsys.readouterr()
    assert "b_captured.safetensors: missing" in err and err.count("\n") == 1 and "reference self-check" not in out
