"""The warm-up phase (run/warmup.py) with fake backends: what they declare is built once per builder, the
builders side by side, then loaded; it runs once, before `check`'s first case; its time is reported apart
from the cases'; a failure is a line, not a traceback; with cases isolated, this process builds and each case
worker loads, before its first case and again after a restart. No compiler is involved: the builders are
stubs."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import warming_backends

from mla_verify.backends.base import WarmupModule
from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.backends.user_kernel import load_kernel
from mla_verify.cli.main import main
from mla_verify.run.progress import Progress
from mla_verify.run.warmup import warm_up

CPU = torch.device("cpu")
GOOD = "cli_kernels:good"  # tests/cli_kernels.py: a tiny envelope, cases of milliseconds
FAST = ["--device", "cpu", "--profile", "dev", "--max-examples", "3"]


class Journal:
    """Fake builders and loaders that log what ran, when, and with which modules."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.lock = threading.Lock()

    def log(self, what: str, detail: Any) -> None:
        with self.lock:
            self.events.append((what, detail))

    def builder(self, library: str, barrier: threading.Barrier | None = None,
                error: Exception | None = None) -> Any:
        def build(specs: Sequence[Any]) -> None:
            self.log("build", (library, sorted(specs)))
            if barrier is not None:
                barrier.wait()  # returns only while the other library's builder is running too
            if error is not None:
                raise error
        return warming_backends.in_background(build)

    def module(self, name: str, build: Any, load_error: Exception | None = None) -> WarmupModule:
        def load() -> None:
            self.log("load", name)
            if load_error is not None:
                raise load_error
        return WarmupModule(name, f"spec:{name}", build, load)


class Declaring:
    """A stand-in backend: only a name and the modules it declares."""

    def __init__(self, name: str, modules: list[WarmupModule] | Exception) -> None:
        self.name, self.modules = name, modules

    def warmup(self, device: torch.device) -> list[WarmupModule]:
        if isinstance(self.modules, Exception):
            raise self.modules
        return self.modules


def test_every_module_is_built_once_per_builder_and_then_loaded() -> None:
    j = Journal()
    ninja = j.builder("fi")
    shared = j.module("fa2-bf16", ninja)
    backends = [Declaring("fa2", [shared, j.module("fa2-fp8", ninja)]), Declaring("auto", [shared])]
    result = warm_up(backends, CPU, io.StringIO())  # type: ignore[arg-type]
    assert j.events[0] == ("build", ("fi", ["spec:fa2-bf16", "spec:fa2-fp8"]))  # one call, every module
    assert sorted(e for e in j.events[1:]) == [("load", "fa2-bf16"), ("load", "fa2-fp8")]  # the shared one once
    assert result.modules == 2 and result.failures == [] and result.backends == ["fa2", "auto"]
    assert set(result.load_seconds) == {"fa2-bf16", "fa2-fp8"}


def test_builders_of_different_libraries_run_side_by_side() -> None:
    j = Journal()
    barrier = threading.Barrier(2, timeout=10)  # one at a time, the first builder's wait would time out
    a, b = j.builder("one", barrier), j.builder("two", barrier)
    result = warm_up([Declaring("x", [j.module("m1", a)]), Declaring("y", [j.module("m2", b)])],  # type: ignore[list-item]
                     CPU, io.StringIO())
    assert result.failures == []
    assert [e[0] for e in j.events].count("build") == 2


def test_a_backend_that_declares_nothing_costs_nothing() -> None:
    kernel = load_kernel(GOOD)
    assert kernel.warmup(CPU) == []
    result = warm_up([kernel], CPU, io.StringIO())
    assert (result.modules, result.failures, result.backends) == (0, [], [])
    assert result.describe() == "nothing to build"


def test_failures_are_lines_and_the_rest_still_loads() -> None:
    j = Journal()
    broken = j.builder("broken", error=RuntimeError("ninja: build stopped: subcommand failed.\n[1/3] nvcc ..."))
    fine = j.builder("fine")
    backends = [Declaring("a", [j.module("bad-build", broken)]),
                Declaring("b", [j.module("bad-load", fine, OSError("undefined symbol: _Z3run")),
                                j.module("good", fine)]),
                Declaring("c", ValueError("no such dtype"))]
    result = warm_up(backends, CPU, io.StringIO())  # type: ignore[arg-type]
    assert ("load", "bad-build") not in j.events and ("load", "good") in j.events
    text = "\n".join(result.failures)
    assert "building bad-build raised RuntimeError: ninja: build stopped: subcommand failed." in text
    assert "bad-load: loading raised OSError: undefined symbol: _Z3run" in text
    assert "c: declaring its modules raised ValueError: no such dtype" in text
    assert all("\n" not in line for line in result.failures)
    assert list(result.load_seconds) == ["good"]
    assert result.describe().endswith("3 failed")


@pytest.fixture
def journal(monkeypatch: pytest.MonkeyPatch) -> Journal:
    """``check --kernel`` whose kernel declares two modules; the journal also logs each case as it starts."""
    j = Journal()

    @warming_backends.in_background
    def slow_build(specs: Sequence[Any]) -> None:
        j.builder("fake")(specs)
        time.sleep(0.3)  # long enough to tell the phase's time apart from zero

    modules = [j.module("mod-a", slow_build), j.module("mod-b", slow_build)]
    monkeypatch.setattr(TrtllmStyleBackend, "warmup", lambda self, device: modules)
    start = Progress.start  # check's on_start, in this process however the cases are judged (check's default on
    # CPU judges them in a copy of this process, whose journal calls it)

    def logged(self: Progress, case: Any) -> None:
        j.log("case", None)
        start(self, case)

    monkeypatch.setattr(Progress, "start", logged)
    return j


def test_check_warms_up_once_before_the_first_case_and_reports_it_apart(journal: Journal, tmp_path, capsys) -> None:
    report = tmp_path / "r.json"
    assert main(["check", "--kernel", GOOD, *FAST, "--report", str(report)]) == 0
    out, err = capsys.readouterr()
    kinds = [e[0] for e in journal.events]
    assert kinds[:3] == ["build", "load", "load"] and kinds.count("build") == 1 and "build" not in kinds[3:]
    assert kinds.count("case") >= 3
    line, = [ln for ln in out.splitlines() if ln.startswith("warm-up:")]
    assert "2 module(s) for cli_kernels:good" in line
    assert "warm-up: building 2 module(s)" in err
    run = json.loads(report.read_text())["run"]
    assert run["warmup"] == line.removeprefix("warm-up: ") and run["warmup_failures"] is None
    assert run["warmup_s"] >= 0.3  # the fake build's sleep
    backend, = json.loads(report.read_text())["backends"]
    assert backend["seconds"] < run["seconds"] - run["warmup_s"] + 0.05  # the cases' time excludes it
    page = report.with_suffix(".md").read_text()
    assert "warm-up, before the first case" in page and run["warmup"] in page


def test_a_failed_warm_up_is_a_line_and_the_cases_still_run(monkeypatch, capsys) -> None:
    @warming_backends.in_background
    def broken(specs: Sequence[Any]) -> None:
        raise RuntimeError("ninja: build stopped: subcommand failed.\nFAILED: batch_mla_run.cuda.o")

    module = WarmupModule("mod-a", "spec", broken, lambda: None)
    monkeypatch.setattr(TrtllmStyleBackend, "warmup", lambda self, device: [module])
    assert main(["check", "--kernel", GOOD, *FAST]) == 0
    out, err = capsys.readouterr()
    assert "  warm-up failed: building mod-a raised RuntimeError: ninja: build stopped: subcommand failed." in out
    assert "Traceback" not in out + err and "FAILED: batch_mla_run" not in out
    assert "cli_kernels:good: PASS" in out


def test_check_without_anything_to_warm_prints_no_warm_up_line(capsys) -> None:
    assert main(["check", "--kernel", GOOD, *FAST]) == 0
    assert "warm-up" not in capsys.readouterr().out


@pytest.mark.parametrize("arch", [(9, 0), (8, 0)])
def test_flashinfer_wrappers_declare_a_module_per_kernel_dtype_and_dims_they_can_draw(monkeypatch, arch) -> None:
    from mla_verify.backends import flashinfer_wrapper, get_backend
    from mla_verify.problems.generate import DTYPES

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: arch)
    monkeypatch.setattr(flashinfer_wrapper, "fa_module", lambda *args: args)  # no FlashInfer code generation
    cuda = torch.device("cuda")
    declared = {name: set(get_backend(name).warmup(cuda)) for name in ("fa2", "fa3", "fa-auto")}
    for name, kernels in (("fa2", {"fa2"}), ("fa3", {"fa3"}), ("fa-auto", {"fa2", "fa3"})):
        env = get_backend(name).envelope
        # what FlashInfer's planner takes on this arch: fa3 and an fp8 cache on SM90 only
        drawable = {(k, DTYPES[dtype], *dims) for k in kernels if k == "fa2" or arch == (9, 0)
                    for dtype in env.dtypes if dtype == "bf16" or arch == (9, 0) for dims in env.dims_for(dtype)}
        assert declared[name] == drawable, name
    assert declared["fa-auto"] == declared["fa2"] | declared["fa3"]  # auto runs one of the two: both are warmed


def test_a_failed_flashinfer_build_names_the_compiler_s_first_error(monkeypatch, tmp_path) -> None:
    import flashinfer.jit.cpp_ext

    from mla_verify.backends.flashinfer_jit import build_all

    def ninja_failed(*args: Any, **kwargs: Any) -> None:  # what FlashInfer 0.7.4's run_ninja raises
        raise RuntimeError("Ninja build failed. Ninja output:\n[1/3] nvcc -c batch_mla_run.cu\n"
                           'batch_mla_run.cu(12): error: identifier "x" is undefined\n1 error detected')

    monkeypatch.setattr(flashinfer.jit.cpp_ext, "run_ninja", ninja_failed)
    build, = build_all([fake_spec(tmp_path, "m", 1)])
    assert str(build.exception(timeout=60)).splitlines()[0] == \
        'Ninja build failed. First error: batch_mla_run.cu(12): error: identifier "x" is undefined'


def fake_spec(tmp_path: Path, name: str, sources: int) -> SimpleNamespace:
    """What flashinfer_jit's builder reads of a FlashInfer JitSpec."""
    return SimpleNamespace(name=name, sources=[f"{name}{i}.cu" for i in range(sources)],
                           lock_path=tmp_path / f"{name}.lock", aot_path=tmp_path / "none", write_ninja=lambda: None,
                           build_dir=tmp_path, ninja_path=tmp_path / f"{name}.ninja")


def test_flashinfer_modules_share_the_jobs_in_order_a_smaller_one_going_ahead_where_it_fits(monkeypatch,
                                                                                            tmp_path) -> None:
    import flashinfer.jit.cpp_ext

    from mla_verify.backends.flashinfer_jit import build_all

    started: list[tuple[str, int]] = []
    finish = {name: threading.Event() for name in ("first", "second", "small")}
    lock = threading.Lock()

    def ninja(build_dir: Path, ninja_path: Path, verbose: bool, max_jobs: int) -> None:
        with lock:
            started.append((ninja_path.stem, max_jobs))
        assert finish[ninja_path.stem].wait(30)

    monkeypatch.setattr(flashinfer.jit.cpp_ext, "run_ninja", ninja)
    monkeypatch.setenv("MAX_JOBS", "4")
    specs = [fake_spec(tmp_path, "first", 3), fake_spec(tmp_path, "second", 3), fake_spec(tmp_path, "small", 1)]
    builds = build_all(specs)
    deadline = time.monotonic() + 30
    while len(started) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.2)
    assert sorted(started) == [("first", 3), ("small", 1)]  # 3 of the 4 jobs, and small in the one left
    finish["small"].set()
    builds[2].result(timeout=30)
    time.sleep(0.2)
    assert ("second", 3) not in started  # 3 jobs are not free until first ends
    finish["first"].set()
    builds[0].result(timeout=30)
    finish["second"].set()
    builds[1].result(timeout=30)
    assert started[-1] == ("second", 3)


def test_steps_can_be_taken_apart_built_in_one_process_and_loaded_in_another() -> None:
    j = Journal()
    ninja = j.builder("fi")
    backends = [Declaring("fa2", [j.module("m1", ninja), j.module("m2", ninja)])]
    built = warm_up(backends, CPU, io.StringIO(), load=False)  # type: ignore[arg-type]
    assert [e[0] for e in j.events] == ["build"] and built.load_seconds is None
    assert built.describe().endswith("(build 0.0 s, each case worker loads them)")
    loaded = warm_up(backends, CPU, io.StringIO(), build=False)  # type: ignore[arg-type]
    assert [e[0] for e in j.events] == ["build", "load", "load"] and loaded.build_seconds is None
    again = loaded.then(loaded)  # the same worker's warm-up after a restart
    assert again.seconds == 2 * loaded.seconds and again.starts == 2 and again.modules == 2
    assert again.load_seconds == {name: 2 * s for name, s in (loaded.load_seconds or {}).items()}
    assert "over 2 worker starts" in again.describe()


def check_with_plugins(tmp_path: Path, *argv: str) -> tuple[subprocess.Popen[str], str]:
    """``check --device cpu --isolate ARGV`` with tests/warming_backends.py's backends installed as a plugin
    (pip's way: an entry point), its journal at tmp_path/journal.jsonl; the process and its output."""
    site = tmp_path / "site" / "warm_journal-0.dist-info"
    site.mkdir(parents=True)
    (site / "METADATA").write_text("Metadata-Version: 2.1\nName: warm-journal\nVersion: 0\n")
    (site / "entry_points.txt").write_text(
        "[mla_verify.backends]\n" + "".join(f"{name} = warming_backends:{factory}\n" for name, factory in (
            (warming_backends.NAME, "make_backend"), (warming_backends.FIRST, "make_first"),
            (warming_backends.LATER, "make_later"))))
    tests = Path(__file__).resolve().parent
    env = {**os.environ, warming_backends.JOURNAL_ENV: str(tmp_path / "journal.jsonl"),
           "PYTHONPATH": os.pathsep.join([str(site.parent), str(tests.parent), str(tests)])}
    proc = subprocess.Popen([sys.executable, "-m", "mla_verify.cli", "check", "--device", "cpu", "--isolate",
                             "--fixtures-dir", str(tmp_path / "fx"), *argv],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    out, _ = proc.communicate(timeout=600)
    return proc, out


def test_isolated_cases_are_judged_in_workers_that_load_the_modules_this_process_built(tmp_path: Path) -> None:
    """`check --isolate` with a plugin backend whose steps write down their process: built once in the check
    process, loaded in each worker -- the first and each restarted after a segfault -- before its first case,
    never in the check process; the workers' warm-up reported apart from the cases."""
    journal, report = tmp_path / "journal.jsonl", tmp_path / "r.json"
    proc, out = check_with_plugins(tmp_path, "--backend", warming_backends.NAME, "--profile", "premerge",
                                   "--report", str(report))
    assert proc.returncode == 1 and "the kernel crashed: killed by SIGSEGV" in out, out
    events = [json.loads(line) for line in journal.read_text().splitlines()]
    modules = sorted(warming_backends.MODULES)
    assert [(e["step"], e["pid"], e["detail"]) for e in events if e["step"] == "build"] == \
        [("build", proc.pid, modules)]  # once, every module in one call, in the check process
    assert all(e["pid"] != proc.pid for e in events if e["step"] in ("load", "case"))
    workers = list(dict.fromkeys(e["pid"] for e in events if e["step"] == "case"))
    assert len(workers) >= 2, "the segfaults restart the worker"
    for pid in workers:
        steps = [(e["step"], e["detail"]) for e in events if e["pid"] == pid]
        assert sorted(steps[:2]) == [("load", m) for m in modules], (pid, steps)  # before its first case
        assert [s for s, _ in steps[2:]] == ["case"] * (len(steps) - 2)
    assert {e["pid"] for e in events if e["step"] == "load"} == set(workers)
    assert "(build " in out and "each case worker loads them)" in out
    line, = [ln for ln in out.splitlines() if ln.startswith("  warm-up in its worker: ")]
    assert f"2 module(s) for {warming_backends.NAME}" in line and f"over {len(workers)} worker starts" in line
    throughput = json.loads(report.read_text())["run"]["throughput"][warming_backends.NAME]
    assert throughput["warmup_s"] >= len(workers) * len(modules) * warming_backends.LOAD_S  # each load's sleep


def test_every_backend_s_worker_warms_up_at_once_and_the_first_is_judged_while_later_ones_build(tmp_path) -> None:
    """`check --isolate` over two backends: the later one's worker starts with the first's, and waits for its
    module while this process builds it (its load then waits on the module's lock, as FlashInfer's getter
    does); that build ends only once the first backend has judged a case (warming_backends), which a run
    that warmed backends one after the other, or built everything before the first case, never does."""
    proc, out = check_with_plugins(tmp_path, "--backend", warming_backends.FIRST, "--backend",
                                   warming_backends.LATER, "--profile", "dev", "--max-examples", "3")
    assert proc.returncode == 0, out
    events = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    when = {e["step"]: e["t"] for e in reversed(events)}  # each step's first time
    assert when["waiting"] < when[f"case {warming_backends.FIRST}"] < when["built"], events
    assert [e["pid"] for e in events if e["step"] == "built"] == [proc.pid]  # built in the check process
    later_load, = [e for e in events if e["detail"] == "later-module" and e["step"] == "load"]
    assert later_load["pid"] != proc.pid and later_load["t"] > when["built"]
    line, = [ln for ln in out.splitlines() if ln.startswith("  warm-up in its worker: 1 module(s) for warm-later")]
    assert "waited" in line and "for the build" in line, line
