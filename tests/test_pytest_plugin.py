"""The pytest plugin: option resolution, one-line usage errors, per-device counts, and a real `-n 2` run."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from benchmark_tools import load_benchmark
from warming_backends import in_background

from mla_verify import pytest_plugin
from mla_verify.backends.base import WarmupModule
from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.run.workers import FAKE_GPU_ENV, worker_threads

TESTS = Path(__file__).resolve().parent

pytest_plugins = ["pytester"]

# Inner runs need neither the cache nor Hypothesis's plugin. Without the latter, an in-process run does not
# re-import (and assertion-rewrite) Hypothesis after pytester's sys.modules reset: ~3 s per run here.
QUIET = ("-p", "no:cacheprovider", "-p", "no:hypothesispytest")

OPTIONS_CHECK = """
import os
from mla_verify.pytest_plugin import MLAOptions
from mla_verify.run.workers import DeviceRequest

def test_options(mla_options):
    assert mla_options == {expected}
"""


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("BACKEND", "KERNEL", "DEVICE", "PROFILE", "SEED", "HYPOTHESIS_DB", "SHARDS", "FIXTURES_DIR",
                 "ISOLATE", "CASES"):
        monkeypatch.delenv(f"MLA_VERIFY_{name}", raising=False)
    monkeypatch.delenv(FAKE_GPU_ENV, raising=False)
    return monkeypatch


def test_defaults(pytester, clean_env):
    expected = ("MLAOptions(backends=(), kernel=None, device=DeviceRequest('auto'), profile='premerge', "
                "seed=None, hypothesis_db=None, shards=None, "
                "fixtures_dir=os.path.join(os.getcwd(), 'fixtures', 'regressions'), isolate=None, cases=None, "
                "seed_fresh=False)")
    pytester.makepyfile(OPTIONS_CHECK.format(expected=expected))
    pytester.runpytest(*QUIET).assert_outcomes(passed=1)


def test_command_line_beats_environment_beats_ini(pytester, clean_env):
    pytester.makeini("[pytest]\nmla_backend =\n    fa2\n    fa3\nmla_profile = fuzz\nmla_seed = 3\n"
                     "mla_hypothesis_db = /tmp/db-from-ini\nmla_shards = 3\nmla_fixtures_dir = from-ini\n")
    clean_env.setenv("MLA_VERIFY_SEED", "7")  # env beats ini
    clean_env.setenv("MLA_VERIFY_FIXTURES_DIR", "from-env")
    clean_env.setenv("MLA_VERIFY_KERNEL", "pkg.mod:from_env")  # CLI beats env
    expected = ("MLAOptions(backends=('fa2', 'fa3'), kernel='mla_verify.kernels.mutants:correct_kernel', "
                "device=DeviceRequest('cpu'), profile='dev', seed=7, hypothesis_db='/tmp/db-from-ini', shards=3, "
                "fixtures_dir=os.path.join(os.getcwd(), 'from-env'), isolate=None, cases=None, seed_fresh=False)")
    pytester.makepyfile(OPTIONS_CHECK.format(expected=expected))
    # -k: only the options check, not the kernel tests --mla-kernel adds
    pytester.runpytest(*QUIET, "--mla-kernel", "mla_verify.kernels.mutants:correct_kernel", "--mla-device", "cpu",
                       "--mla-profile", "dev", "-k", "test_options").assert_outcomes(passed=1)

    clean_env.setenv("MLA_VERIFY_BACKEND", "trtllm-gen, fa3")  # a comma list in the env beats the ini lines
    for cli_backends, backends in [((), "('trtllm-gen', 'fa3')"),
                                   (("--mla-backend", "cutlass", "--mla-backend", "fa2"), "('cutlass', 'fa2')")]:
        pytester.makepyfile(OPTIONS_CHECK.format(expected=expected.replace("('fa2', 'fa3')", backends)))
        pytester.runpytest(*QUIET, "--mla-kernel", "mla_verify.kernels.mutants:correct_kernel", "--mla-device", "cpu",
                           "--mla-profile", "dev", "-k", "test_options", *cli_backends).assert_outcomes(passed=1)


@pytest.mark.parametrize("args, env, message", [
    (["--mla-device", "gpu"], {}, "ERROR: --mla-device: 'gpu' is not one of cpu, cuda, cuda:N, auto"),
    ([], {"MLA_VERIFY_PROFILE": "nightly"}, "ERROR: --mla-profile: 'nightly' is not one of *"),
    (["--mla-seed", "1.5"], {}, "ERROR: --mla-seed: '1.5' is not an integer"),
    (["--mla-kernel", "no_colon"], {}, "ERROR: --mla-kernel expects MODULE:ATTR or path/to/file.py:ATTR *"),
    (["--mla-kernel", "missing.py:fn"], {}, "ERROR: --mla-kernel: kernel file missing.py does not exist"),
    (["--mla-shards", "0"], {}, "ERROR: --mla-shards: '0' is not a whole number >= 1"),
    (["--mla-seed", "-1"], {}, "ERROR: --mla-seed: -1 is negative"),
    # a typo must not turn the gate into "everything skipped"
    (["--mla-backend", "fa33"], {}, "ERROR: --mla-backend: unknown backend 'fa33' (did you mean 'fa3'?); known: *"),
    ([], {"MLA_VERIFY_BACKEND": "fa3,nope"}, "ERROR: --mla-backend: unknown backend 'nope'; known: *"),
    (["--mla-kernel", "no_such_pkg.mod:fn"], {}, "ERROR: --mla-kernel: kernel module 'no_such_pkg.mod' not found*"),
    (["--mla-hypothesis-db", "http://localhost/db"], {}, "ERROR: *"),
    (["--mla-cases", "nowhere"], {}, "ERROR: --mla-cases: */nowhere does not exist"),
])
def test_bad_option_is_one_usage_line(pytester, clean_env, args, env, message):
    for name, value in env.items():
        clean_env.setenv(name, value)
    pytester.makepyfile("def test_never(): pass")
    result = pytester.runpytest(*QUIET, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert len([line for line in result.stderr.lines if line.strip()]) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for a GPU that a CPU-only host lacks")
def test_cuda_without_gpu_is_one_usage_line(pytester, clean_env):
    pytester.makepyfile("def test_never(): pass")
    result = pytester.runpytest(*QUIET, "--mla-device", "cuda")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --mla-device cuda: no CUDA device is visible"])


def test_summary_counts_each_outcome_of_device_tests_only(pytester, clean_env):
    pytester.makepyfile("""
        import pytest

        @pytest.fixture
        def broken():
            raise RuntimeError("setup fails")

        def test_pass(mla_device): assert mla_device.type == "cpu"
        def test_fail(mla_device): assert False
        def test_skip(mla_device): pytest.skip("not here")
        def test_error(mla_device, broken): pass
        @pytest.mark.gpu
        def test_marked_gpu(): pass  # counted without asking for mla_device
        @pytest.mark.gpu
        def test_gpu_skip(): pytest.skip("no GPU visible")
        def test_backend_skip(mla_device): pytest.skip("fa3: runs on cuda devices, not cpu")
        def test_no_device(): pass
    """)
    result = pytester.runpytest(*QUIET, "--mla-device", "cpu")
    result.assert_outcomes(passed=3, failed=1, skipped=3, errors=1)
    result.stdout.fnmatch_lines([
        "*- mla-verify devices -*",
        "mla-verify: main -> cpu: 1 error, 1 failed, 2 passed, 1 skipped, 2 skipped (need a GPU)",
        # said so that it cannot be read as the run's total: 8 tests, of which 7 are device tests
        "mla-verify: cpu: 7 device tests (using mla_device or marked gpu) on 1 worker: "
        "4 ran (1 error, 1 failed, 2 passed), 3 skipped (2 need a GPU, 1 other)",
    ])


def test_assigned_gpu_is_made_current_before_device_tests(pytester, clean_env):
    """On a (faked) 2-GPU host, ``--mla-device cuda:1`` makes cuda:1 current for device tests, and only them."""
    current = []
    clean_env.setattr(torch.cuda, "is_available", lambda: True)
    clean_env.setattr(torch.cuda, "device_count", lambda: 2)
    clean_env.setattr(torch.cuda, "set_device", current.append)
    pytester.makepyfile("""
        import pytest
        import torch

        def test_fixture(mla_device): assert mla_device == torch.device("cuda:1")
        @pytest.mark.gpu
        def test_marked(): pass
        def test_plain(): pass
    """)
    result = pytester.runpytest(*QUIET, "--mla-device", "cuda:1")
    result.assert_outcomes(passed=3)
    assert current == ["cuda:1", "cuda:1"]
    result.stdout.fnmatch_lines(["mla-verify: main -> cuda:1: 2 passed"])


def test_replacement_takes_the_crashed_workers_slot_even_after_another_finished(pytester):
    """The controller-side hooks, in the order xdist calls them (its dsession: nodedown, then the clone)."""
    config = pytester.parseconfigure(*QUIET)
    nodes = {}

    def start(worker_id):
        nodes[worker_id] = SimpleNamespace(config=config, gateway=SimpleNamespace(id=worker_id), workerinput={})
        pytest_plugin.pytest_configure_node(nodes[worker_id])
        return nodes[worker_id].workerinput[pytest_plugin.SLOT_INPUT]

    assert [start("gw0"), start("gw1"), start("gw2")] == [0, 1, 2]
    pytest_plugin.pytest_testnodedown(nodes["gw0"], error=None)  # gw0 finished its tests
    pytest_plugin.pytest_testnodedown(nodes["gw2"], error="Not properly terminated")  # gw2 crashed
    assert start("gw3") == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="simulates GPUs, which needs a CPU-only host")
def test_two_workers_two_simulated_gpus_and_a_crash(pytester, clean_env):
    """`-n 2` spreads workers over the GPUs; the replacement of a crashed worker keeps its GPU.

    ``--dist each`` runs every test on every worker and hands the rest of a crashed worker's tests to its
    replacement, so the counts below follow from this file alone.
    """
    clean_env.setenv(FAKE_GPU_ENV, "2")
    clean_env.delenv("OMP_NUM_THREADS", raising=False)  # (.ci/run sets it) each worker takes half the cores
    pytester.makepyfile("""
        import os
        import pytest
        import torch

        def test_before(mla_device, mla_options):
            assert mla_device == torch.device("cpu")  # simulated GPUs run on the CPU
            assert mla_options.profile == "dev"  # options reach the workers
            assert torch.get_num_threads() == max(1, len(os.sched_getaffinity(0)) // 2)
        def test_skip(mla_device): pytest.skip("counted as skipped")
        def test_crash(mla_device):
            if os.environ["PYTEST_XDIST_WORKER"] == "gw1":
                os._exit(3)
        def test_after(mla_device): pass
        def test_no_device(): pass
    """)
    result = pytester.runpytest(*QUIET, "-n", "2", "--dist", "each", "--mla-profile", "dev")
    result.stdout.fnmatch_lines(["*worker 'gw1' crashed while running*test_crash*"])
    result.stdout.fnmatch_lines([
        "mla-verify: gw0 -> cuda:0 (simulated): 3 passed, 1 skipped",
        "mla-verify: gw1 -> cuda:1 (simulated): 1 passed, 1 skipped",
        "mla-verify: gw2 -> cuda:1 (simulated): 1 passed",
        "mla-verify: cuda:0 (simulated): 4 device tests (using mla_device or marked gpu) on 1 worker: "
        "3 ran, 1 skipped",
        "mla-verify: cuda:1 (simulated): 3 device tests (using mla_device or marked gpu) on 2 workers: "
        "2 ran, 1 skipped",
    ])


@pytest.mark.parametrize("env, workers, cores, threads", [
    ({}, 2, 2, 1), ({}, 3, 2, 1), ({}, 2, 16, 8), ({}, 1, 4, 4),
    ({"OMP_NUM_THREADS": "3"}, 2, 16, None), ({"MKL_NUM_THREADS": "2"}, 2, 16, None)])
def test_each_worker_gets_its_share_of_the_cores_unless_the_user_chose(env, workers, cores, threads):
    assert worker_threads(workers, env, cores) == threads


@pytest.fixture
def one_torch_thread():
    """The supervised default forks the test's process, which needs one torch thread (isolate.forkable)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_warm_up_runs_once_per_process_before_the_first_kernel_test(pytester, clean_env, monkeypatch,
                                                                         one_torch_thread):
    built: list[list[str]] = []

    @in_background
    def build(specs):
        built.append(list(specs))
        if specs == ["broken"]:
            raise RuntimeError("nvcc: fatal error\nmore")

    loaded: list[str] = []
    declared = [WarmupModule("mod-a", "a", build, lambda: loaded.append("mod-a"))]
    monkeypatch.setattr(TrtllmStyleBackend, "warmup", lambda self, device: declared)
    kernel = f"{TESTS / 'cli_kernels.py'}:good"
    result = pytester.runpytest(*QUIET, "--mla-kernel", kernel, "--mla-shards", "2", "--mla-device", "cpu",
                                "--mla-profile", "dev", "--mla-isolate", "on")
    result.assert_outcomes(passed=2)
    assert built == [["a"]]  # two kernel tests, one warm-up
    assert loaded == []  # isolated: their case workers load, not this process
    result.stdout.fnmatch_lines([f"mla-verify: warm-up on main (cpu): 1 module(s) for {kernel} in * "
                                 "(build *, each case worker loads them)"])
    result = pytester.runpytest(*QUIET, "--mla-kernel", kernel, "--mla-device", "cpu", "--mla-profile", "dev")
    result.assert_outcomes(passed=1)
    assert loaded == ["mod-a"]  # supervised (the default): built and loaded here, and the search's copy has it
    declared[:] = [WarmupModule("mod-b", "broken", build, lambda: None)]
    result = pytester.runpytest(*QUIET, "--mla-kernel", kernel, "--mla-device", "cpu", "--mla-profile", "dev")
    result.assert_outcomes(passed=1)  # a failed warm-up is said; the kernel's tests judge what happens next
    result.stdout.fnmatch_lines(
        ["mla-verify:   warm-up failed: building mod-b raised RuntimeError: nvcc: fatal error*"])


def test_failures_of_several_shards_are_listed_smallest_first():
    def failed(shard: str, size: list[int], backend: str = "k:decode") -> dict:
        return {"backend": backend, "shard": shard, "size": size, "reason": f"wrong in {shard}",
                "case": f"case of {shard}", "reproducer": f"{shard}.json"}

    lines = pytest_plugin.shard_failure_lines([failed("shard1of3", [900, 2]), failed("shard2of3", [40, 3]),
                                               failed("shard3of3", [40, 1]), failed("", [1, 1], "alone:decode")])
    assert lines[0] == "mla-verify: k:decode failed in 3 shards; the smallest failure first:"
    assert [line.split(":")[0].strip() for line in lines[1::3]] == ["shard3of3", "shard2of3", "shard1of3"]
    assert lines[1:4] == ["  shard3of3: wrong in shard3of3", "    case: case of shard3of3",
                          "    reproducer: shard3of3.json"]
    assert not any("alone" in line for line in lines)  # one failing test says it all


def test_summary_orders_workers_and_devices_numerically():
    counts = Counter({("gw10", "cuda:10", "passed"): 1, ("gw2", "cuda:2", "passed"): 2,
                      ("gw1", "cuda:2", "failed"): 1})
    assert pytest_plugin.summary_lines(counts) == [
        "mla-verify: gw1 -> cuda:2: 1 failed",
        "mla-verify: gw2 -> cuda:2: 2 passed",
        "mla-verify: gw10 -> cuda:10: 1 passed",
        "mla-verify: cuda:2: 3 device tests (using mla_device or marked gpu) on 2 workers: "
        "3 ran (1 failed, 2 passed)",
        "mla-verify: cuda:10: 1 device test (using mla_device or marked gpu) on 1 worker: 1 ran",
    ]


def test_junit_carries_devices_and_runs_compare_by_outcome(pytester, clean_env, capsys):
    pytester.makepyfile("""
        import os
        import pytest
        def test_same(mla_device): pass
        def test_flips(mla_device): assert os.environ.get("FLIP") is None
        def test_no_device(): pass
    """)
    pytester.runpytest(*QUIET, "--mla-device", "cpu", "--junitxml=a.xml").assert_outcomes(passed=3)
    clean_env.setenv("FLIP", "1")
    pytester.runpytest(*QUIET, "--mla-device", "cpu", "--junitxml=b.xml").assert_outcomes(passed=2, failed=1)
    tool = load_benchmark("junit_devices")
    a, b = str(pytester.path / "a.xml"), str(pytester.path / "b.xml")
    assert tool.outcomes(a)["test_junit_carries_devices_and_runs_compare_by_outcome::test_same"] == \
        ("passed", "cpu")
    assert tool.main([a, a]) == 0
    assert tool.main([a, b]) == 1
    out = capsys.readouterr().out
    assert "  cpu: 1 failure" in out
    assert "DIFFERS test_junit_carries_devices_and_runs_compare_by_outcome::test_flips: passed vs failure" in out
    assert "1 of 3 tests differ in outcome" in out
