"""The mla-verify command: exit codes 0/1/2, one-line errors with no traceback, reports, reproducers.

Most invocations run in-process (``main(argv)``) -- a subprocess pays ~4 s of torch import on the 2-core
CI machine -- and a few run as real subprocesses to prove the end-to-end exit code and stderr.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mla_verify.backends.user_kernel import load_kernel
from mla_verify.cli.main import main
from mla_verify.core.bits import same_bits
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.records.fixtures import fixture_paths, load_fixture, save_fixture
from mla_verify.run.harness import run_case

TESTS = Path(__file__).resolve().parent
GOOD, BAD = "cli_kernels:good", "cli_kernels:wrong_scale"  # tests/cli_kernels.py: tiny envelope, fast cases
FAST = ["--device", "cpu", "--profile", "dev", "--max-examples", "4"]


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def run_subprocess(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "mla_verify.cli", *argv], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


@pytest.fixture
def fixture_file(tmp_path) -> Path:
    spec = ProblemSpec(seq_lens=(3,), num_heads=1, page_size=4, kv_lora_rank=256)
    return save_fixture(tmp_path / "fx", "case", build_problem(spec), {"spec": spec.to_json(), "backend": "cpu-peer"})


def _damage(path: Path, how: str) -> Path:
    tensors = fixture_paths(path)[0]
    if how == "missing":
        return path.with_name("nothing.json")
    if how == "garbage":
        tensors.write_bytes(b"\x00garbage" * 10)
    elif how == "pickled":
        tensors.write_bytes(pickle.dumps({"query": torch.zeros(1)}))
    elif how == "half-written":
        path.unlink()
    elif how == "truncated":
        tensors.write_bytes(tensors.read_bytes()[:-7])
    elif how == "tampered-json":
        meta = json.loads(path.read_text())
        meta["tensors"]["query"]["sha256"] = "0" * 64
        path.write_text(json.dumps(meta))
    return path


INVALID = {
    "no command": [],
    "unknown subcommand": ["frobnicate"],
    "unknown module": ["check", "--kernel", "no_such_module_xyz:decode"],
    "unknown attribute": ["check", "--kernel", "cli_kernels:no_such_kernel"],
    "not MODULE:ATTR": ["check", "--kernel", "cli_kernels"],
    "not callable": ["check", "--kernel", "cli_kernels:WRONG_SCALE"],
    "kernel and backend": ["check", "--kernel", GOOD, "--backend", "cpu-peer"],
    "unknown backend": ["check", "--backend", "no-such-backend"],
    "bad device": ["check", "--device", "tpu:0"],
    "nonexistent CUDA index": ["check", "--device", "cuda:99"],
    "unknown profile": ["check", "--profile", "nightly"],
    "negative max-examples": ["check", "--max-examples", "-5"],
    "zero max-examples": ["check", "--max-examples", "0"],
    "negative minutes": ["check", "--minutes", "-1"],
    "NaN minutes": ["check", "--minutes", "nan"],
    "non-numeric seed": ["check", "--seed", "twelve"],
    "negative seed": ["check", "--seed", "-3"],
    "bad hypothesis-db URL": ["check", "--hypothesis-db", "ftp://host/0"],
    "report under a file": ["check", "--kernel", GOOD, "--report", "{tmp}/fx/case.json/r.json"],
    "fixtures dir under a file": ["check", "--kernel", GOOD, "--fixtures-dir", "{tmp}/fx/case.json/regressions"],
    "negative reproducer cap": ["check", "--max-reproducer-mib", "-1"],
    "non-numeric reproducer cap": ["check", "--max-reproducer-mib", "lots"],
    "report named .xml": ["check", "--kernel", GOOD, "--report", "{tmp}/r.xml"],
    "missing report to render": ["report", "{tmp}/nope.json"],
    "replay unknown option": ["replay", "--frobnicate", "x.json"],
}
FIXTURE_DAMAGE = ["missing", "garbage", "pickled", "half-written", "truncated", "tampered-json"]


def _check_usage_error(code: int, out: str, err: str) -> None:
    assert code == 2, (out, err)
    assert "Traceback" not in err + out
    assert 1 <= len(err.strip().splitlines()) <= 2, err
    assert "reference self-check" not in out  # refused before anything ran


@pytest.mark.parametrize("argv", INVALID.values(), ids=INVALID.keys())
def test_invalid_invocations_exit_2_in_one_line(capsys, tmp_path, fixture_file, argv):
    _check_usage_error(*run_main(capsys, *[a.format(tmp=tmp_path) for a in argv]))


@pytest.mark.parametrize("how", FIXTURE_DAMAGE)
def test_unreadable_fixture_exits_2(capsys, fixture_file, how):
    _check_usage_error(*run_main(capsys, "replay", _damage(fixture_file, how)))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA; the no-CUDA message cannot show")
def test_cuda_without_cuda_exits_2(capsys):
    code, out, err = run_main(capsys, "check", "--device", "cuda")
    _check_usage_error(code, out, err)
    assert "no CUDA GPU" in err


def test_named_backend_that_cannot_run_here_exits_2(capsys):
    code, out, err = run_main(capsys, "check", "--backend", "fa3", "--device", "cpu")
    _check_usage_error(code, out, err)
    assert "fa3 cannot run on cpu" in err


@pytest.mark.parametrize("argv", [["frobnicate"], ["check", "--kernel", "no_such_module_xyz:f"],
                                  ["check", "--seed", "x"], ["replay", "{fixture}"]],
                         ids=["subcommand", "module", "seed", "pickled fixture"])
def test_usage_errors_end_to_end(fixture_file, argv):
    """A real process: exit status 2, one line on stderr, no traceback."""
    pickled = _damage(fixture_file, "pickled")
    proc = run_subprocess(*[a.format(fixture=pickled) for a in argv])
    _check_usage_error(proc.returncode, proc.stdout, proc.stderr)


def test_passing_kernel_exits_0_with_report(capsys, tmp_path):
    code, out, err = run_main(capsys, "check", "--kernel", GOOD, *FAST, "--report", tmp_path / "r.json")
    assert code == 0, out + err
    assert "reference self-check: ok" in out and "cli_kernels:good: PASS" in out
    assert "\r" not in out + err  # not a terminal: no progress redraws
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["cases"] and all(c["verdict"] == "pass" for c in report["cases"])
    assert (tmp_path / "r.xml").exists() and (tmp_path / "r.html").exists()
    code, out, _ = run_main(capsys, "report", tmp_path / "r.json")
    assert code == 0 and "r.md" in out


def test_premerge_is_reproducible(capsys, tmp_path):
    runs = []
    for i in range(2):
        path = tmp_path / f"run{i}.json"
        code, out, err = run_main(capsys, "check", "--kernel", GOOD, "--device", "cpu", "--profile", "premerge",
                                  "--max-examples", "6", "--report", path)
        assert code == 0, out + err
        runs.append([(c["id"], c["verdict"]) for c in json.loads(path.read_text())["cases"]])
    assert len(runs[0]) >= 6 and runs[0] == runs[1]


def test_different_seeds_draw_different_cases(capsys, tmp_path):
    ids = []
    for seed in (1, 2):
        path = tmp_path / f"s{seed}.json"
        assert run_main(capsys, "check", "--kernel", GOOD, *FAST, "--seed", seed, "--report", path)[0] == 0
        ids.append({c["id"] for c in json.loads(path.read_text())["cases"]})
    assert ids[0] != ids[1]


def test_fuzz_prints_its_fresh_seed_first_and_the_report_records_it(capsys, tmp_path):
    short = ["--kernel", GOOD, "--device", "cpu", "--profile", "fuzz", "--max-examples", "3", "--minutes", "0.02"]
    code, out, err = run_main(capsys, "check", *short, "--report", tmp_path / "fresh.json")
    assert code == 0, out + err
    seed = int(re.match(r"seed: (\d+) \(fresh for this run; --seed (\d+) draws the same cases again\)\n", out)[1])
    run = json.loads((tmp_path / "fresh.json").read_text())["run"]
    assert run["seed"] == seed and run["seed_fresh"] is True
    code, out, err = run_main(capsys, "check", *short, "--seed", seed, "--report", tmp_path / "given.json")
    assert code == 0 and out.startswith(f"seed: {seed}\n")
    assert "seed_fresh" not in json.loads((tmp_path / "given.json").read_text())["run"]
    code, out, err = run_main(capsys, "check", "--kernel", GOOD, *FAST, "--report", tmp_path / "dev.json")
    assert code == 0 and not out.startswith("seed:")  # a seeded profile: its fixed seed, as before
    assert json.loads((tmp_path / "dev.json").read_text())["run"]["seed"] is None


def test_failure_writes_a_fixture_that_replays_bit_identically(capsys, tmp_path):
    fixtures_dir = tmp_path / "regressions"
    code, out, err = run_main(capsys, "check", "--kernel", BAD, *FAST, "--fixtures-dir", fixtures_dir,
                              "--report", tmp_path / "r.json")
    assert code == 1, out + err
    assert "FAIL cli_kernels:wrong_scale" in out and "minimal case: B=" in out and "diagnosis:" in out
    path = re.search(r"reproducer: (\S+)", out).group(1)
    assert f"mla-verify replay {path}" in out
    assert Path(path).parent == fixtures_dir
    assert f"reproducers go to {fixtures_dir}\n" in out  # not the default folder: said without "(the default"
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["backends"][0]["failure"]["fixture"] == path

    fx = load_fixture(path)
    assert fx.meta["backend"] == BAD and fx.meta["verdict"] == "fail"
    assert fx.problem is None  # a drawn problem: rebuilt from its spec
    again = run_case(load_kernel(BAD), fx.spec, fx.layout, "cpu", fx.meta["metamorphic"],
                     problem=fx.problem_on("cpu")[0])
    assert again.verdict == "fail"
    assert same_bits(fx.tensors["kernel_out"], again.out)
    if again.lse is not None:
        assert same_bits(fx.tensors["kernel_lse"], again.lse)

    code, out, err = run_main(capsys, "replay", path)
    assert code == 1 and "bit-identical to the recorded run" in out, out + err
    code, out, err = run_main(capsys, "replay", path, "--kernel", GOOD)  # the fixed kernel passes it
    assert code == 0 and "verdict: PASS" in out, out + err


def test_doctor_and_list_backends(capsys):
    code, out, _ = run_main(capsys, "doctor")
    assert code == 0 and "torch" in out and "flashinfer" in out and "cpu-peer" in out
    code, out, _ = run_main(capsys, "list-backends", "--device", "cpu")
    assert code == 0
    assert re.search(r"cpu-peer\s+runs here", out) and re.search(r"trtllm-gen\s+cannot run: ", out)
    assert "envelope: devices" in out
    sparse = out[out.index("sparse (top-k) backends on cpu:"):]
    assert re.search(r"flashmla-sparse\s+cannot run: ", sparse) and "formats V32" in sparse


def test_no_backend_named_checks_every_runnable_one_and_says_why_others_skip(capsys, tmp_path, monkeypatch):
    """With nothing named, check verifies all backends available here and gives each skipped one's reason."""
    from mla_verify import backends as registry
    good, bad = load_kernel(GOOD), load_kernel(BAD)
    gpu_only = load_kernel("cli_kernels:gpu_only")
    monkeypatch.setattr(registry, "all_backends", lambda: {b.name: b for b in (good, gpu_only)})
    code, out, err = run_main(capsys, "check", *FAST)
    assert code == 0, out + err
    assert "cli_kernels:good: PASS" in out
    assert "skipped cli_kernels:gpu_only: runs on cuda devices, not cpu" in out
    monkeypatch.setattr(registry, "all_backends", lambda: {b.name: b for b in (good, bad)})
    assert run_main(capsys, "check", *FAST, "--fixtures-dir", tmp_path)[0] == 1


def test_fuzz_runs_share_failures_through_the_database(capsys, tmp_path):
    """Run 2 with the same --hypothesis-db replays run 1's shrunk failure before drawing anything new."""
    runs = []
    for i in range(2):
        path = tmp_path / f"fuzz{i}.json"
        code, out, err = run_main(capsys, "check", "--kernel", BAD, "--device", "cpu", "--profile", "fuzz",
                                  "--minutes", "0.1", "--hypothesis-db", tmp_path / "db",
                                  "--fixtures-dir", tmp_path / "fx", "--report", path)
        assert code == 1, out + err
        runs.append(json.loads(path.read_text()))
    # Hypothesis saves its shrunk example (the engine then reports the smallest failure, simplified further)
    failed = {c["id"] for c in runs[0]["cases"] if c["verdict"] == "fail"}
    first = runs[1]["cases"][0]
    assert runs[0]["cases"][0]["id"] not in failed  # run 1 had to search for a failure
    assert first["id"] in failed and first["verdict"] == "fail"  # run 2 starts from one of run 1's


def test_malformed_report_to_render_exits_2(capsys, tmp_path):
    """Ours by its header, but a case lacks its spec: one line, not a KeyError traceback."""
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"format": "mla-verify-report", "cases": [{"id": "x", "verdict": "pass"}]}))
    code, out, err = run_main(capsys, "report", str(path))
    _check_usage_error(code, out, err)
    assert "malformed report" in err


def test_check_says_how_many_cases_a_policy_backend_resolved_to_each_kernel(capsys, tmp_path, monkeypatch):
    """A backend whose calls report the kernel they chose: check's summary counts them, as the report does."""
    from dataclasses import replace

    from mla_verify import backends as registry
    good = load_kernel(GOOD)

    class Policy(type(good)):  # picks "one" for single-token queries, "many" for the others
        def prepare(self, problem, layout):
            return replace(super().prepare(problem, layout), resolved_backend="one" if problem.q_len == 1 else "many")

    policy = Policy(good.name, good.fn, good.envelope)
    monkeypatch.setattr(registry, "all_backends", lambda: {"policy": policy})
    path = tmp_path / "r.json"
    code, out, err = run_main(capsys, "check", *FAST, "--max-examples", "12", "--report", path)
    assert code == 0, out + err
    ran = [c for c in json.loads(path.read_text())["cases"] if c["verdict"] != "skip"]
    counts = {k: sum(c["resolved_backend"] == k for c in ran) for k in ("one", "many")}
    assert all(counts.values()), counts  # the drawn cases had both kinds of query
    line = re.search(rf"^  {re.escape(good.name)} resolved to (\w+) on (\d+) cases, (\w+) on (\d+)$", out, re.M)
    assert line, out
    most, n, least, m = line.groups()
    assert {most: int(n), least: int(m)} == counts and int(n) >= int(m)  # most first


@pytest.mark.parametrize("env_value, huge", [(None, True), ("0", False)])
def test_check_on_cpu_backs_large_tensors_with_huge_pages(env_value, huge):
    """`check --device cpu` turns on torch's huge-page allocation before torch's first allocation, which is
    when torch reads it (workers.cpu_run_settings); a THP_MEM_ALLOC_ENABLE the user set wins. torch then aligns
    a tensor of 2 MiB or more to the page; otherwise glibc puts it 64 bytes into its mapping."""
    probe = ("import sys, torch; from mla_verify.cli.main import main; code = main(sys.argv[1:]); "
             "print(code, torch.empty(4 << 20, dtype=torch.uint8).data_ptr() % 4096)")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    done = subprocess.run([sys.executable, "-c", probe, "check", "--kernel", GOOD, *FAST], capture_output=True,
                          text=True, env=env, timeout=300)
    code, offset = done.stdout.split()[-2:]
    assert code == "0", done.stderr
    assert (offset == "0") == huge, done.stdout


def test_fib_solution_without_flashinfer_bench_says_how_to_install_it(capsys, monkeypatch, tmp_path):
    """Here, not in test_fib.py (which skips without flashinfer-bench): the line a machine without it gets."""
    monkeypatch.setitem(sys.modules, "flashinfer_bench", None)  # import flashinfer_bench now raises ImportError
    code, out, err = run_main(capsys, "check", "--fib-solution", tmp_path / "solution.json", "--fixtures-dir", tmp_path)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "pip install 'mla-verify[fib]'" in err

