"""pytest in a kernel engineer's own repository: `pytest --mla-kernel ...` from any directory, the one-line
helper and the fixture, reproducers and the replay command on failure, shards over xdist workers."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from cli_kernels import SMALL_ENVELOPE, WRONG_SCALE

from mla_verify.backends.user_kernel import load_kernel
from mla_verify.cli.main import main
from mla_verify.draw.profiles import Profile, get_profile
from mla_verify.problems.generate import ProblemSpec
from mla_verify.pytest_helpers import Shard, verify_backend
from mla_verify.records.fixtures import load_fixture

pytest_plugins = ["pytester"]
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")  # as in test_pytest_plugin.py

# A user's kernel file, written from the documented calling convention: the CPU peer, right and wrong.
USER_KERNELS = f"""
from mla_verify.backends.cpu_peer import cpu_peer_decode

def good(*args, **kwargs):
    return cpu_peer_decode(*args, **kwargs)

def bad(*args, bmm1_scale=1.0, **kwargs):
    return cpu_peer_decode(*args, bmm1_scale=bmm1_scale * {WRONG_SCALE}, **kwargs)

good.mla_verify_envelope = bad.mla_verify_envelope = {SMALL_ENVELOPE!r}
"""


@pytest.fixture
def user_repo(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A repository of the user's: kernels/mykernels.py and no tests; the suite's options unset."""
    for name in ("BACKEND", "KERNEL", "DEVICE", "PROFILE", "SEED", "HYPOTHESIS_DB", "SHARDS", "FIXTURES_DIR", "CASES"):
        monkeypatch.delenv(f"MLA_VERIFY_{name}", raising=False)
    (pytester.path / "kernels").mkdir()
    (pytester.path / "kernels" / "mykernels.py").write_text(USER_KERNELS)
    return pytester.path


def test_a_kernel_file_fails_from_another_directory_with_reproducer_and_replay(pytester, user_repo, capsys):
    # a real process: sys.path as a user's `pytest` has it, nothing of this test suite's
    result = pytester.runpytest_subprocess(*QUIET, "--mla-kernel", "kernels/mykernels.py:bad", "--mla-profile", "dev")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*FAIL kernels/mykernels.py:bad: *", "*  diagnosis: *",
                                 "*  re-run: mla-verify replay */fixtures/regressions/*.json"])
    fixture = next(line for line in result.stdout.lines if "re-run: mla-verify replay" in line).split()[-1]
    assert Path(fixture).is_file() and Path(fixture).parent == user_repo / "fixtures" / "regressions"
    assert not (user_repo / ".hypothesis").exists()  # Hypothesis's cache went elsewhere
    assert main(["replay", fixture]) == 1  # the printed command reproduces the failure, bit for bit
    assert "bit-identical to the recorded run" in capsys.readouterr().out


def test_a_kernel_module_in_the_current_directory_passes(pytester, user_repo, monkeypatch):
    monkeypatch.chdir(user_repo / "kernels")
    result = pytester.runpytest(*QUIET, "--mla-kernel", "mykernels:good", "--mla-profile", "dev")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([  # pytest counts the files' tests: the kernel's test is said to be added
        "collected 0 items",
        "mla-verify: --mla-kernel mykernels:good adds 1 test, not counted above: 1 to run",
        "*mla-verify: cpu: 1 device test (using mla_device or marked gpu) on 1 worker: 1 ran"])


def test_the_helper_and_the_fixture_in_a_users_test(pytester, user_repo):
    pytester.makepyfile(test_mine="""
        import sys
        sys.path.insert(0, "kernels")
        import mykernels
        from mla_verify.pytest_helpers import verify_kernel

        def test_by_name(): verify_kernel("kernels/mykernels.py:good", profile="dev")
        def test_fixture(mla_verify_kernel): mla_verify_kernel(mykernels.good)
        def test_fixture_bad(mla_verify_kernel): mla_verify_kernel(mykernels.bad)
    """)
    result = pytester.runpytest(*QUIET, "--mla-profile", "dev")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*FAIL mykernels:bad: *", "*re-run: mla-verify replay *"])


def test_shards_spread_one_kernel_over_the_workers_and_their_failures_come_smallest_first(pytester, user_repo):
    result = pytester.runpytest(*QUIET, "-n", "2", "--mla-kernel", "kernels/mykernels.py:bad", "--mla-profile", "dev")
    result.assert_outcomes(failed=2)
    heading = "mla-verify: kernels/mykernels.py:bad failed in 2 shards; the smallest failure first:"
    result.stdout.fnmatch_lines(["mla-verify: gw0 -> cpu: 1 failed", "mla-verify: gw1 -> cpu: 1 failed",
                                 "*mla-verify failures across shards, smallest first*", heading])
    listed = result.stdout.lines[result.stdout.lines.index(heading) + 1:]
    specs = [ProblemSpec.from_json(load_fixture(line.split("reproducer: ")[1]).meta["spec"])
             for line in listed[:6] if line.startswith("    reproducer: ")]
    units = [sum(s.seq_lens) * s.num_heads * s.q_len for s in specs]
    assert len(units) == 2 and units == sorted(units)


def test_one_fresh_seed_for_every_worker_of_a_fuzz_run_and_one_torch_thread_each(pytester, user_repo, monkeypatch):
    """`pytest -n 2` with the fuzz profile: the controller picks the run's seed and prints it, every worker has
    it (shard k then searches from it + k), and each worker runs torch with one thread on the CPU, as
    `mla-verify check` does."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    pytester.makepyfile(test_worker="""
        import os
        from pathlib import Path
        import torch

        def test_worker(mla_options, mla_device):
            Path(os.environ["PYTEST_XDIST_WORKER"] + ".seed").write_text(str(mla_options.seed))
            assert torch.get_num_threads() == 1
    """)
    result = pytester.runpytest_subprocess(*QUIET, "-n", "2", "--dist", "each", "--mla-profile", "fuzz",
                                           "--mla-device", "cpu")
    result.assert_outcomes(passed=2)
    header = next(line for line in result.stdout.lines if line.startswith("mla-verify: fuzz profile, seed "))
    seed = int(header.split()[4])
    assert header.endswith(f"(fresh for this run; --mla-seed {seed} draws the same cases again)")
    assert sorted(p.read_text() for p in user_repo.glob("gw*.seed")) == [str(seed)] * 2


@pytest.mark.parametrize("conftest, threads", [("", 1), ("import torch\ntorch.set_num_threads(3)\n", 3)])
def test_pytest_without_xdist_runs_torch_as_the_cli_does_unless_the_user_set_threads(pytester, user_repo,
                                                                                     monkeypatch, conftest, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    pytester.makeconftest(conftest)
    pytester.makepyfile(test_threads=f"import torch\n\ndef test_threads(mla_device):\n"
                                     f"    assert torch.get_num_threads() == {threads}\n")
    pytester.runpytest_subprocess(*QUIET, "--mla-device", "cpu").assert_outcomes(passed=1)


def test_a_case_directory_is_judged_first_in_pytest_and_its_failure_named(pytester, user_repo):
    cases = user_repo / "cases"
    cases.mkdir()
    (cases / "two_tokens.json").write_text(json.dumps(
        {"spec": {"seq_lens": [5], "q_len": 2, "num_heads": 1, "page_size": 4, "kv_lora_rank": 256}}))
    result = pytester.runpytest(*QUIET, "--mla-kernel", "kernels/mykernels.py:bad", "--mla-profile", "dev",
                                "--mla-cases", "cases")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*FAIL kernels/mykernels.py:bad: *",
                                 f"  from your case {cases / 'two_tokens.json'} (judged before any drawn case)",
                                 "  minimal case: *"])  # made smaller than the case, as a corner case is
    (cases / "broken.json").write_text("{")
    result = pytester.runpytest(*QUIET, "--mla-kernel", "kernels/mykernels.py:good", "--mla-cases", "cases")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {cases / 'broken.json'}: not valid JSON *"])


def test_seeded_shards_judge_the_unsharded_cases_between_them():
    """premerge and dev: every shard draws one process's sequence and judges every N-th case of it, so
    `pytest -n N` judges the cases `pytest` does, whatever N."""
    backend = load_kernel("cli_kernels:good")
    whole = [c.id for c in verify_backend(backend, "cpu", "dev").cases]
    thirds = [[c.id for c in verify_backend(backend, "cpu", "dev", shard=Shard(k, 3)).cases] for k in range(3)]
    assert len(whole) == get_profile("dev").max_examples
    assert thirds == [whole[k::3] for k in range(3)]


def test_random_shards_search_with_their_own_seeds_and_share_of_the_examples():
    fuzz = get_profile("fuzz")
    plans = [Shard(k, 3).plan(fuzz, 5) for k in range(3)]
    assert [seed for _, _, seed in plans] == [5, 6, 7]  # the run's seed + the shard's index
    assert [p.share for p, _, _ in plans] == [(0, 3), (1, 3), (2, 3)]  # the user's cases split between them
    assert all(replace(p, share=(0, 1)) == fuzz and n is not None and n * 3 >= fuzz.max_examples > (n - 1) * 3
               for p, n, _ in plans)
    assert [seed for _, _, seed in (Shard(k, 3).plan(fuzz, None) for k in range(3))] == [None] * 3  # each fresh
    assert Shard().plan(fuzz, 5) == (fuzz, None, 5)


def test_each_shard_runs_its_share_of_the_corner_cases(monkeypatch: pytest.MonkeyPatch) -> None:
    """Corner cases are most of premerge's time on CPU: a shard that ran them all would stall `-n N`."""
    from mla_verify.draw import strategies
    from mla_verify.kinds.dense import DenseKind
    from mla_verify.run import engine

    backend = load_kernel("cli_kernels:good")
    corners = strategies.corner_cases(backend.envelope, strategies.budget_for("cpu"))
    assert len(corners) >= 4
    monkeypatch.setattr(DenseKind, "corner_cases", lambda self, env, budget: corners[:4])
    dev = replace(get_profile("dev"), max_examples=1, corner_cases=True)

    def corner_ids(profile: Profile, corners: int) -> list[str]:  # the corner cases come first
        return [c.id for c in engine.verify(backend, torch.device("cpu"), profile, max_examples=1).cases][:corners]

    whole = corner_ids(dev, 4)
    assert [corner_ids(Shard(k, 2).plan(dev, None)[0], 2) for k in range(2)] == [whole[0::2], whole[1::2]]


def test_a_bad_profile_or_kernel_name_fails_the_test_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from mla_verify.kernels.mutants import correct_kernel
    from mla_verify.pytest_helpers import verify_kernel

    with pytest.raises(pytest.fail.Exception) as bad_profile:
        verify_kernel(correct_kernel, profile="nightly")
    assert "unknown profile 'nightly'" in str(bad_profile.value)
    with pytest.raises(pytest.fail.Exception) as bad_name:
        verify_kernel("no_such_module_here:kernel")
    assert str(bad_name.value).startswith("verify_kernel:")  # names the call the user wrote, not a CLI flag
