"""Reproducers stay small: a failing case's fixture keeps its spec and a summary of the kernel's output, stores
tensors only where the spec cannot rebuild them and only within the cap, and replays to the same verdict."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from mla_verify.backends.cpu_peer import cpu_peer_decode
from mla_verify.cli.main import main
from mla_verify.problems.generate import ProblemSpec, build_problem
from mla_verify.records.fixtures import (
    DEFAULT_MAX_REPRODUCER_MIB,
    fixture_paths,
    kernel_output_records,
    load_fixture,
    tensor_record,
    write_reproducer,
)

TESTS = Path(__file__).resolve().parent
LONG = 100_000  # the kernel below is wrong only past this many tokens; premerge's longest corner case has 131072


# glibc maps each large allocation afresh and unmaps it when freed, so each of the run's ~20 cases past 100000
# tokens (115 MiB of cache each, copied by the reference and the comparison) would fault its pages in again:
# on 2 shared cores that took half the run's time. Taken from the heap, they reuse it; the cases, verdicts and
# fixture are the same. Only this run's process: the priming of poisoned output blocks (harness.py) is tested
# under the default allocator.
HEAP_FOR_LARGE_TENSORS = {"MALLOC_MMAP_THRESHOLD_": str(1 << 32), "MALLOC_TRIM_THRESHOLD_": str(1 << 32)}


def long_sequence_kernel(*args: Any, **kwargs: Any) -> Any:
    """The CPU peer, correct except on a problem with a sequence longer than LONG tokens (its scale is off)."""
    seq_lens = kwargs["seq_lens"] if "seq_lens" in kwargs else args[7]
    if int(seq_lens.max()) > LONG:
        kwargs["bmm1_scale"] = kwargs.get("bmm1_scale", 1.0) * 1.25
    return cpu_peer_decode(*args, **kwargs)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_premerge_failure_on_a_long_sequence_leaves_a_small_reproducer_that_fails_again(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # A real `mla-verify check` process: which cases premerge draws depends on the modules loaded (Hypothesis
    # mixes constants of loaded local modules into its draws), so the command runs as a user runs it. It runs in
    # tmp_path: the default reproducer folder is under the current directory.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           **HEAP_FOR_LARGE_TENSORS}
    check = subprocess.run([sys.executable, "-m", "mla_verify.cli", "check", "--kernel",
                            "test_reproducers:long_sequence_kernel", "--device", "cpu", "--profile", "premerge"],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert check.returncode == 1, check.stdout + check.stderr
    assert "reproducers go to fixtures/regressions (the default, under the current directory" in check.stdout
    folder = tmp_path / "fixtures" / "regressions"
    fixtures = sorted(folder.glob("*.json"))
    assert len(fixtures) == 1
    # the problem alone is >= 115 MiB (> 100000 tokens x 576 bf16); the cap is 16 MiB, the fixture a few kB
    assert _folder_bytes(folder) <= DEFAULT_MAX_REPRODUCER_MIB << 20
    fx = load_fixture(fixtures[0])
    assert fx.problem is None and max(fx.spec.seq_lens) > LONG  # rebuilt from its spec, not stored
    assert set(kernel_output_records(fx)) == ({"out", "lse"} if fx.layout.return_lse else {"out"})

    code = main(["replay", str(fixtures[0])])
    out, err = capsys.readouterr()
    assert code == 1, out + err
    assert "problem: rebuilt from its spec, bit-identical to the recorded one" in out
    assert "bit-identical to the recorded run" in out
    assert "verdict: FAIL (recorded: FAIL)" in out
    assert all(f"  - {f}" in out for f in fx.meta["failures"])  # the very same failures, numbers included


SPEC = ProblemSpec(seq_lens=(40, 3), q_len=2, num_heads=2, page_size=16, kv_lora_rank=256, seed=11)
META = {"kind": "regression", "backend": "cpu-peer", "spec": SPEC.to_json(), "layout": {}, "verdict": "fail"}


def _kernel_output(spec: ProblemSpec) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(spec.batch, spec.q_len, spec.num_heads, spec.kv_lora_rank, generator=g).bfloat16(),
            torch.randn(spec.batch, spec.q_len, spec.num_heads, generator=g))


def test_a_problem_its_spec_rebuilds_is_not_stored(tmp_path: Path) -> None:
    out, lse = _kernel_output(SPEC)
    saved = write_reproducer(tmp_path, "case", build_problem(SPEC), SPEC, META, out, lse, 16 << 20)
    assert not saved.problem_stored and set(saved.stored) == {"kernel_out", "kernel_lse"}
    assert saved.bytes == _folder_bytes(tmp_path)
    fx = load_fixture(saved.path)
    problem, exact = fx.problem_on("cpu")
    assert fx.problem is None and exact is True
    assert tensor_record(problem.kv_cache) == fx.meta["problem_tensors"]["kv_cache"]
    assert kernel_output_records(fx) == {"out": tensor_record(out), "lse": tensor_record(lse)}


def test_the_kernel_output_is_stored_only_within_the_cap(tmp_path: Path) -> None:
    out, lse = _kernel_output(SPEC)  # out: 2 x 2 x 2 x 256 bf16 = 4 kB, LSE 32 bytes
    problem = build_problem(SPEC)
    full = write_reproducer(tmp_path / "full", "case", problem, SPEC, META, out, lse, 16 << 20)
    cap = full.bytes - 1  # one byte short of holding both: the LSE still fits, the output does not
    lse_only = write_reproducer(tmp_path / "lse", "case", problem, SPEC, META, out, lse, cap)
    assert lse_only.stored == ("kernel_lse",) and lse_only.bytes <= cap
    nothing = write_reproducer(tmp_path / "none", "case", problem, SPEC, META, out, lse, 0)
    assert nothing.stored == () and not fixture_paths(nothing.path)[0].exists()  # the JSON alone
    for saved in (lse_only, nothing):
        fx = load_fixture(saved.path)
        assert kernel_output_records(fx) == {"out": tensor_record(out), "lse": tensor_record(lse)}  # summarised
        assert fx.meta["kernel_output"]["out"]["finite"] == out.numel()


def test_a_problem_no_spec_rebuilds_is_stored_within_the_cap_or_not_written(tmp_path: Path) -> None:
    problem = build_problem(SPEC)
    problem.query[0, 0, 0, 0] += 1  # no longer what SPEC draws
    out, lse = _kernel_output(SPEC)
    saved = write_reproducer(tmp_path / "fits", "case", problem, SPEC, META, out, lse, 16 << 20)
    assert saved.problem_stored
    assert torch.equal(load_fixture(saved.path).problem_on("cpu")[0].query, problem.query)
    need = sum(t.nbytes for t in (problem.query, problem.kv_cache, problem.block_table, problem.seq_lens))
    refused = write_reproducer(tmp_path / "over", "case", problem, SPEC, META, out, lse, need // 2)
    assert refused.path is None and "--max-reproducer-mib" in refused.reason
    assert not (tmp_path / "over").exists()  # nothing half-written


def test_a_rebuilt_problem_that_differs_from_the_recorded_one_says_so(tmp_path: Path) -> None:
    saved = write_reproducer(tmp_path, "case", build_problem(SPEC), SPEC, META, None, None, 16 << 20)
    record = json.loads(saved.path.read_text())
    record["spec"] = dataclasses.replace(SPEC, seed=12).to_json()  # as if this torch drew other values
    saved.path.write_text(json.dumps(record))
    assert load_fixture(saved.path).problem_on("cpu")[1] is False


def test_the_cap_is_an_option_of_check(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["check", "--kernel", "cli_kernels:wrong_scale", "--device", "cpu", "--profile", "dev",
                 "--max-examples", "4", "--fixtures-dir", str(tmp_path), "--max-reproducer-mib", "0"])
    out, err = capsys.readouterr()
    assert code == 1 and "reproducer: " in out, out + err
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]  # no tensor is stored under a cap of 0


WRONG_KERNEL = '''from mla_verify.backends.cpu_peer import cpu_peer_decode


def decode(*args, bmm1_scale=1.0, **kwargs):
    return cpu_peer_decode(*args, bmm1_scale=bmm1_scale * 1.25, **kwargs)  # the softmax scale is off


decode.mla_verify_envelope = {"devices": ["cpu"], "page_sizes": [16], "dims": [[256, 64]], "heads": [1, 2],
                              "q_len": [1, 2], "max_batch": 2, "max_seq_len": 40}
'''


@pytest.mark.parametrize("target", ["moved_kernel:decode", "kernels/moved_kernel.py:decode"])
def test_a_user_kernels_reproducer_replays_from_any_directory(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    made, elsewhere = tmp_path / "made", tmp_path / "elsewhere"
    (made / "kernels").mkdir(parents=True)
    elsewhere.mkdir()
    for folder in (made, made / "kernels"):
        (folder / "moved_kernel.py").write_text(WRONG_KERNEL)
    monkeypatch.chdir(made)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))  # the kernel's module is forgotten after the test
    assert main(["check", "--kernel", target, "--device", "cpu", "--profile", "dev", "--max-examples", "5"]) == 1
    fixture = next((made / "fixtures" / "regressions").glob("*.json"))
    # as a new process in another directory: the kernel's module and its folder are unknown there
    for name in [n for n in sys.modules if n == "moved_kernel" or n.startswith("mla_verify_user_kernel_")]:
        del sys.modules[name]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) not in (str(made), str(made / "kernels"))]
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    code = main(["replay", str(fixture)])
    out, err = capsys.readouterr()
    assert code == 1 and "verdict: FAIL (recorded: FAIL)" in out, out + err
