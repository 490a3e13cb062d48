"""pytest plugin (loaded through the pytest11 entry point): the suite's options, markers, fixtures, the
per-worker device assignment for ``pytest -n auto`` (see workers.py and docs/pytest.md), and the tests
``--mla-kernel`` adds (pytest_helpers.py).

Every option is read from the command line, else ``MLA_VERIFY_<NAME>`` in the environment, else the ini
key ``mla_<name>``, else its default. Shadow mode's options (``--mla-shadow`` ...) live in shadow_pytest.py.

A random profile (fuzz) without ``--mla-seed`` draws from a fresh seed, picked once per run (by xdist's
controller, handed to every worker) and printed in the header. Torch's threads are set as ``mla-verify check``
sets them (docs/pytest.md, "Threads"). When several shards of one backend fail, the summary names their
failures smallest first.
"""
from __future__ import annotations

import os
import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import pytest
import torch

from .backends import Backend, all_backends
from .backends.user_kernel import load_kernel
from .core.errors import MLAVerifyError, UsageError, did_you_mean
from .draw.hypothesis_db import resolve_database
from .draw.profiles import PROFILES, run_seed
from .pytest_helpers import DEFAULT_FIXTURES_DIR, Shard, failure_record, verify_backend, verify_kernel
from .records.cases import load_cases
from .run.supervise import IN_PROCESS, ISOLATED, how_to_run
from .run.warmup import WarmupResult, warm_up
from .run.workers import (
    HUGE_PAGES_ENV,
    THREAD_ENV,
    Assignment,
    DeviceRequest,
    SlotTable,
    assign_worker,
    cpu_run_settings,
    parse_device_request,
    worker_threads,
)

# premerge is derandomized: a plain `pytest` run gives the same cases on any number of workers and GPUs.
DEFAULT_PROFILE = "premerge"
SLOT_INPUT = "mla_verify_slot"  # key in xdist's workerinput: the slot the controller gave this worker
SEED_INPUT = "mla_verify_seed"  # key in xdist's workerinput: the run's seed, the same for every worker
# torch's thread count before any conftest or test ran (pytest imports its plugins first): a count that differs
# when the run configures was set by the user (torch.set_num_threads), and is left as it is
TORCH_THREADS_AT_IMPORT = torch.get_num_threads()

pytest_plugins = ["mla_verify.pytest_shadow"]  # --mla-shadow: checks the MLA decode calls any test makes

_OPTIONS_KEY = pytest.StashKey["MLAOptions"]()
_ASSIGNMENT_KEY = pytest.StashKey[Assignment]()
_SLOTS_KEY = pytest.StashKey[SlotTable]()
_WARMUP_KEY = pytest.StashKey[WarmupResult]()


@dataclass(frozen=True)
class MLAOptions:
    """The suite's options for this run, as given (``profile`` names a profiles.PROFILES entry)."""

    backends: tuple[str, ...]
    kernel: str | None  # MODULE:ATTR, imported by whoever runs it
    device: DeviceRequest
    profile: str
    seed: int | None
    hypothesis_db: str | None  # directory or redis:// URL, resolved by hypothesis_db.resolve_database
    shards: int | None = None  # tests per backend (None: one per xdist worker); pytest_helpers.Shard
    fixtures_dir: str = str(DEFAULT_FIXTURES_DIR)  # where failing tests write their reproducers
    isolate: bool | None = None  # None: supervised where the process can fork, else as the test's kind says
    cases: str | None = None  # a directory of the user's own cases (records/cases.py), judged first
    seed_fresh: bool = False  # ``seed`` was picked for this run (a random profile without --mla-seed)

    def verify_options(self, device: torch.device, shard: Shard) -> dict[str, Any]:
        """The keyword arguments of ``pytest_helpers.verify_backend`` / ``verify_kernel`` for this run."""
        return dict(device=device, profile=self.profile, seed=self.seed, shard=shard,
                    hypothesis_db=self.hypothesis_db, fixtures_dir=self.fixtures_dir, isolate=self.isolate,
                    otherwise=self.otherwise, cases=self.cases)

    @property
    def otherwise(self) -> str:
        """How cases are judged, unsaid, where the process cannot fork a supervised search (a GPU): each in a
        worker for ``--mla-kernel``'s tests, in-process for the others (the fixture's kernel may be a closure,
        which a worker cannot import)."""
        return ISOLATED if self.kernel is not None else IN_PROCESS


# name, metavar, help; "backend" is the one repeatable option (an ini linelist, a comma list in the env)
_OPTION_HELP = (
    ("backend", "NAME", "backend to verify (repeatable; default: every backend available here)"),
    ("kernel", "MODULE:ATTR", "a trtllm-style kernel callable to verify (or path/to/file.py:ATTR); adds its "
                              "tests to the run"),
    ("device", "DEVICE", "cpu, cuda, cuda:N or auto (default auto: each xdist worker takes a visible GPU "
                         "round-robin, cpu when there is none)"),
    ("profile", "NAME", f"Hypothesis profile: {', '.join(PROFILES)} (default {DEFAULT_PROFILE})"),
    ("seed", "N", "Hypothesis seed (default: premerge and dev their fixed one; fuzz a fresh one each run, printed in "
                  "the header)"),
    ("hypothesis_db", "DB", "Hypothesis example database: a directory or redis://host:port/db"),
    ("shards", "N", "split each backend's and kernel's verification into N tests, each judging every N-th case "
                    "(default: the number of xdist workers, 1 without xdist)"),
    ("fixtures_dir", "DIR", f"where failing tests write reproducers (default {DEFAULT_FIXTURES_DIR})"),
    ("isolate", "on|off", "on: judge each case in a worker process; off: in the test's process, which a kernel's "
                          "crash ends (default: on the CPU the search in a copy of the test's process, going on "
                          "with every case isolated if a kernel crashes it; on a GPU on for --mla-kernel, off for "
                          "the mla_verify_kernel fixture)"),
    ("cases", "DIR", "your own cases, judged first in every profile: *.json files, each a spec or a fixture "
                     "(docs/cli.md, \"Your own cases\")"),
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mla-verify")
    for name, metavar, help_text in _OPTION_HELP:
        flag = "--mla-" + name.replace("_", "-")
        action = "append" if name == "backend" else "store"
        group.addoption(flag, dest="mla_" + name, action=action, default=None, metavar=metavar,
                        help=f"{help_text}; env MLA_VERIFY_{name.upper()}, ini mla_{name}")
        kind: Literal["linelist", "string"] = "linelist" if name == "backend" else "string"
        parser.addini("mla_" + name, help_text, type=kind)


def _raw(config: pytest.Config, name: str) -> Any:
    """Command line, else environment, else ini; None when none of them sets it."""
    cli = config.getoption("mla_" + name)
    if cli is not None:
        return cli
    env = os.environ.get("MLA_VERIFY_" + name.upper())
    if env:
        return [part.strip() for part in env.split(",") if part.strip()] if name == "backend" else env
    return config.getini("mla_" + name) or None


def read_options(config: pytest.Config) -> MLAOptions:
    """Resolves and validates every option; raises UsageError (one line)."""
    kernel = _raw(config, "kernel")
    profile = _raw(config, "profile") or DEFAULT_PROFILE
    if profile not in PROFILES:
        raise UsageError(f"--mla-profile: {profile!r} is not one of {', '.join(PROFILES)}")
    seed_text = _raw(config, "seed")
    try:
        seed = None if seed_text is None else int(seed_text)
    except ValueError:
        raise UsageError(f"--mla-seed: {seed_text!r} is not an integer") from None
    if seed is not None and seed < 0:
        raise UsageError(f"--mla-seed: {seed} is negative")
    shards_text = _raw(config, "shards")
    if shards_text is not None and not (shards_text.isdigit() and int(shards_text) >= 1):
        raise UsageError(f"--mla-shards: {shards_text!r} is not a whole number >= 1")
    backends = tuple(_raw(config, "backend") or ())
    known = all_backends()
    unknown = [name for name in backends if name not in known]
    if unknown:  # a typo must not turn the gate into "everything skipped"
        raise UsageError(f"--mla-backend: unknown backend {unknown[0]!r}{did_you_mean(unknown[0], known)}; "
                         f"known: {', '.join(sorted(known))}")
    if kernel is not None:
        load_kernel(kernel, "--mla-kernel")  # the one-line errors of `check --kernel`, before any test runs
    database = _raw(config, "hypothesis_db")
    resolve_database(database)
    fixtures_dir = Path(_raw(config, "fixtures_dir") or DEFAULT_FIXTURES_DIR)
    isolate = _raw(config, "isolate")
    if isolate not in (None, "on", "off"):
        raise UsageError(f"--mla-isolate: {isolate!r} is not on or off")
    cases = _raw(config, "cases")
    if cases is not None:
        cases = str(config.invocation_params.dir / cases)
        load_cases(cases, "--mla-cases")  # a bad case file is one line now, not in every test
    return MLAOptions(backends=backends, kernel=kernel,
                      device=parse_device_request(_raw(config, "device") or "auto"), profile=profile,
                      seed=seed, hypothesis_db=database, shards=None if shards_text is None else int(shards_text),
                      fixtures_dir=str(config.invocation_params.dir / fixtures_dir),
                      isolate=None if isolate is None else isolate == "on", cases=cases)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU that can run the backend under test")
    config.addinivalue_line("markers", "slow: long-running (fuzz sessions, large problems)")
    workerinput = getattr(config, "workerinput", None)
    try:
        options = read_options(config)
        if options.seed is None and not PROFILES[options.profile].deterministic:  # one seed for the whole run
            seed = workerinput[SEED_INPUT] if workerinput else run_seed(PROFILES[options.profile], None)
            options = replace(options, seed=seed, seed_fresh=True)
        config.stash[_OPTIONS_KEY] = options
        if workerinput is None:  # the only process, or xdist's controller: fail here, once
            config.stash[_ASSIGNMENT_KEY] = assign_worker(options.device, None, None)
    except MLAVerifyError as e:
        raise pytest.UsageError(str(e)) from None
    if workerinput is None:
        config.stash[_SLOTS_KEY] = SlotTable()
        config.pluginmanager.register(DeviceTally(), "mla-verify-device-tally")
    _set_threads(config)  # in xdist's controller too: its workers start with its environment


def _set_threads(config: pytest.Config) -> None:
    """Torch's threads for this test process, as `mla-verify check` sets them: on a CPU device one thread
    (workers.cpu_run_settings); an xdist worker on a GPU its share of the cores (workers.worker_threads: with
    one thread per core in each, every op would wait at its barrier for a thread another worker holds).
    Unless the user chose a count: OMP_NUM_THREADS or MKL_NUM_THREADS, or torch.set_num_threads before the run
    (a conftest). The count and the environment are as they were again when the run ends (pytester runs
    pytest in the test's own process)."""
    if any(os.environ.get(name) for name in THREAD_ENV) or torch.get_num_threads() != TORCH_THREADS_AT_IMPORT:
        return
    before, huge_pages = torch.get_num_threads(), os.environ.get(HUGE_PAGES_ENV)
    try:
        on_cpu = _assignment(config).run_device == "cpu"
    except UsageError:  # said by the first test that needs the device
        return
    workerinput = getattr(config, "workerinput", None)
    if on_cpu:
        cpu_run_settings()
    elif workerinput is not None:
        torch.set_num_threads(worker_threads(int(workerinput["workercount"])) or before)

    def restore() -> None:
        torch.set_num_threads(before)
        if huge_pages is None:
            os.environ.pop(HUGE_PAGES_ENV, None)

    config.add_cleanup(restore)


def worker_assignment(config: pytest.Config) -> Assignment:
    """This process's device: decided in pytest_configure outside xdist workers, else on first use."""
    try:
        return _assignment(config)
    except UsageError as e:
        pytest.fail(str(e), pytrace=False)


def _assignment(config: pytest.Config) -> Assignment:
    """``worker_assignment``, its errors UsageError."""
    if _ASSIGNMENT_KEY not in config.stash:
        workerinput = getattr(config, "workerinput", None)
        worker, slot = (workerinput["workerid"], workerinput[SLOT_INPUT]) if workerinput else (None, None)
        config.stash[_ASSIGNMENT_KEY] = assign_worker(config.stash[_OPTIONS_KEY].device, worker, slot)
    return config.stash[_ASSIGNMENT_KEY]


@pytest.fixture(scope="session")
def mla_options(pytestconfig: pytest.Config) -> MLAOptions:
    return pytestconfig.stash[_OPTIONS_KEY]


@pytest.fixture(scope="session")
def mla_device(pytestconfig: pytest.Config) -> torch.device:
    """This worker's device (``pytest_runtest_setup`` has already made it the current CUDA device)."""
    return torch.device(worker_assignment(pytestconfig).run_device)


def shard_count(config: pytest.Config) -> int:
    """``--mla-shards``, else one shard per xdist worker, else 1."""
    shards = config.stash[_OPTIONS_KEY].shards
    workerinput = getattr(config, "workerinput", None)
    return shards or (int(workerinput["workercount"]) if workerinput else 1)


@pytest.fixture
def mla_shard() -> Shard:
    """The whole verification; tests asking for it are parametrized over the shards when there are several."""
    return Shard()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    count = shard_count(metafunc.config)
    if "mla_shard" in metafunc.fixturenames and count > 1:
        shards = [Shard(k, count) for k in range(count)]
        metafunc.parametrize("mla_shard", shards, ids=[s.label for s in shards])


@pytest.fixture
def mla_verify_kernel(mla_options: MLAOptions, mla_device: torch.device, mla_shard: Shard) -> Callable[..., Any]:
    """``pytest_helpers.verify_kernel`` with this run's profile, seed, device, shard and reproducer directory:
    ``def test_decode(mla_verify_kernel): mla_verify_kernel("mykernels:decode")``."""
    return partial(verify_kernel, **mla_options.verify_options(mla_device, mla_shard))


class KernelItem(pytest.Item):
    """One shard of ``--mla-kernel``'s verification, added to the collected tests (pytest_collection_modifyitems).
    ``fixturenames`` makes the plugin treat it as a device test (its GPU made current, counted per worker)."""

    fixturenames = ("mla_device",)

    def __init__(self, *, shard: Shard, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shard = shard

    def runtest(self) -> None:
        options = self.config.stash[_OPTIONS_KEY]
        device = torch.device(worker_assignment(self.config).run_device)
        assert options.kernel is not None  # this item is collected only for --mla-kernel
        verify_backend(load_kernel(options.kernel, "--mla-kernel"), **options.verify_options(device, self.shard))

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return Path(__file__), None, self.name


@pytest.hookimpl(tryfirst=True)  # before -k / -m deselect, so they apply to these tests too
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    kernel = config.stash[_OPTIONS_KEY].kernel
    if kernel is None:
        return
    count = shard_count(config)
    for k in range(count):
        name = f"mla_verify_kernel[{kernel}" + (f"-{Shard(k, count).label}]" if count > 1 else "]")
        items.append(KernelItem.from_parent(session, name=name, nodeid=name, shard=Shard(k, count)))


def pytest_report_header(config: pytest.Config) -> list[str]:
    """The seed a random profile draws from, so that any run can be drawn again."""
    options = config.stash[_OPTIONS_KEY]
    if options.seed is None:
        return []
    fresh = f" (fresh for this run; --mla-seed {options.seed} draws the same cases again)" if options.seed_fresh \
        else ""
    return [f"mla-verify: {options.profile} profile, seed {options.seed}{fresh}"]


def pytest_report_collectionfinish(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    """pytest's "collected N items" counts the files' tests only: say that the kernel's were added to them."""
    added = sum(isinstance(item, KernelItem) for item in items)
    if not added:
        return []
    return [f"mla-verify: --mla-kernel {config.stash[_OPTIONS_KEY].kernel} adds {added} test{'s' * (added != 1)}, "
            f"not counted above: {len(items)} to run"]


def uses_device(item: pytest.Item) -> bool:
    """Tests that run on this worker's device: those asking for ``mla_device`` and those marked ``gpu``."""
    return "mla_device" in getattr(item, "fixturenames", ()) or item.get_closest_marker("gpu") is not None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Makes the worker's GPU current (so a bare ``"cuda"`` lands on it) and tags the test with its worker
    and device; the tags reach xdist's controller (for the summary) and JUnit XML."""
    if not uses_device(item):
        return
    assignment = worker_assignment(item.config)
    if assignment.run_device != "cpu":
        torch.cuda.set_device(assignment.run_device)
    item.user_properties += [("mla_worker", assignment.worker), ("mla_device", assignment.label)]
    if (isinstance(item, KernelItem) or "mla_shard" in getattr(item, "fixturenames", ())) \
            and _WARMUP_KEY not in item.config.stash:
        warmed = item.config.stash[_WARMUP_KEY] = _warm_up(item.config, torch.device(assignment.run_device))
        if warmed.modules or warmed.failures:  # to the summary, through the report of this setup
            item.user_properties.append(("mla_warmup", warmed.run_fields()))


def _warm_up(config: pytest.Config, device: torch.device) -> WarmupResult:
    """This process's warm-up (run/warmup.py), before its first verifying test: every module of the backends
    the run verifies, or of ``--mla-kernel``'s. Built here; loaded here too (a supervised search's copy of this
    process has them) unless those tests isolate their cases, whose workers then load them."""
    options = config.stash[_OPTIONS_KEY]
    backends: list[Backend]
    if options.kernel is not None:
        backends = [load_kernel(options.kernel, "--mla-kernel")]
    else:
        backends = [b for name, b in all_backends().items() if not options.backends or name in options.backends]
    return warm_up([b for b in backends if b.unavailable_reason(device) is None], device, sys.__stderr__,
                   load=how_to_run(options.isolate, device, options.otherwise) != ISOLATED)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed verification's record (pytest_helpers.failure_record) rides on its report to the summary, from
    whichever worker ran it."""
    report = yield
    record = None if call.excinfo is None else failure_record(call.excinfo.value)
    if record is not None:
        report.user_properties.append((FAILURE_PROPERTY, record))
    return report


# --- controller side under xdist (optional hooks: xdist may not be installed) ---

@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    node.workerinput[SLOT_INPUT] = node.config.stash[_SLOTS_KEY].claim(node.gateway.id)
    node.workerinput[SEED_INPUT] = node.config.stash[_OPTIONS_KEY].seed


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    # Only a crash frees a slot: xdist starts the replacement right after this hook, so it takes exactly the
    # crashed worker's slot (a finished worker keeps its own, else the replacement would take that one).
    if error is not None:
        node.config.stash[_SLOTS_KEY].release(node.gateway.id)


NEEDS_GPU = "skipped (need a GPU)"  # a DeviceTally outcome: a device test skipped on a CPU worker for want of one
FAILURE_PROPERTY = "mla_failure"  # a report's user property: a failed verification's failure_record


class DeviceTally:
    """Counts the device tests (see ``uses_device``) each worker ran and prints them in the terminal summary.

    Lives in the process that writes the summary (xdist's controller, or the only process); the counts come
    from the tags ``pytest_runtest_setup`` put on each report, so a crashed worker's finished tests count too.
    """

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, str]] = Counter()  # (worker, device label, outcome) -> tests
        self.warmups: dict[tuple[str, str], Any] = {}  # (worker, device label) -> WarmupResult.run_fields()
        self.failures: list[dict[str, Any]] = []  # failure records, as their reports came in

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props = dict(p for p in report.user_properties if len(p) == 2)
        if report.when == "call" and isinstance(failure := props.get(FAILURE_PROPERTY), dict):
            self.failures.append(failure)
        if "mla_device" not in props:
            return
        if "mla_warmup" in props:
            self.warmups[(str(props["mla_worker"]), str(props["mla_device"]))] = props["mla_warmup"]
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome: str = "error" if report.when == "setup" and report.failed else report.outcome
            if outcome == "skipped" and _needs_gpu(report, str(props["mla_device"])):
                outcome = NEEDS_GPU
            self.counts[(str(props["mla_worker"]), str(props["mla_device"]), outcome)] += 1

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.counts:
            terminalreporter.write_sep("-", "mla-verify devices")
            for line in summary_lines(self.counts) + warmup_lines(self.warmups):
                terminalreporter.write_line(line)
        if lines := shard_failure_lines(self.failures):
            terminalreporter.write_sep("-", "mla-verify failures across shards, smallest first")
            for line in lines:
                terminalreporter.write_line(line)


def shard_failure_lines(failures: list[dict[str, Any]]) -> list[str]:
    """For each backend that failed in several shards: its failures, the smallest minimal case first (each
    shard shrank its own; the smallest is the one to read), each with its shard, reason and reproducer."""
    lines = []
    by_backend: dict[str, list[dict[str, Any]]] = {}
    for f in failures:
        by_backend.setdefault(f["backend"], []).append(f)
    for backend, found in by_backend.items():
        if len(found) < 2:
            continue
        found.sort(key=lambda f: (list(f["size"]), f["shard"]))
        lines.append(f"mla-verify: {backend} failed in {len(found)} shards; the smallest failure first:")
        for f in found:
            lines += [f"  {f['shard']}: {f['reason']}", f"    case: {f['case']}",
                      f"    reproducer: {f['reproducer'] or 'none written'}"]
    return lines


def _needs_gpu(report: pytest.TestReport, device: str) -> bool:
    """A test skipped on a CPU worker because it needs a GPU: marked gpu, or its reason asks for CUDA."""
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    return device.startswith("cpu") and ("gpu" in report.keywords or "cuda" in reason.lower())


def warmup_lines(warmups: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """Each worker's warm-up, apart from its tests' time, and each of its failures."""
    lines = []
    for (worker, device), warm in sorted(warmups.items(), key=lambda kv: _natural(kv[0][0])):
        lines.append(f"mla-verify: warm-up on {worker} ({device}): {warm['warmup']}")
        lines += [f"mla-verify:   warm-up failed: {f}" for f in warm["warmup_failures"] or ()]
    return lines


def summary_lines(counts: Counter[tuple[str, str, str]]) -> list[str]:
    """One line per worker (its device and outcomes), then one per device: its device tests (a part of the
    run's tests: those on a worker's device), how many workers, how many ran and how many were skipped (why)."""
    def detail(outcomes: Counter[str]) -> str:
        return ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))

    def ran_and_skipped(outcomes: Counter[str]) -> str:
        ran = Counter({o: n for o, n in outcomes.items() if o not in ("skipped", NEEDS_GPU)})
        parts = [f"{sum(ran.values())} ran" + (f" ({detail(ran)})" if set(ran) - {"passed"} else "")]
        skipped, no_gpu = outcomes["skipped"] + outcomes[NEEDS_GPU], outcomes[NEEDS_GPU]
        if skipped:
            why = "need a GPU" if no_gpu == skipped else f"{no_gpu} need a GPU, {skipped - no_gpu} other" if no_gpu \
                else ""
            parts.append(f"{skipped} skipped" + (f" ({why})" if why else ""))
        return ", ".join(parts)

    per_worker: dict[tuple[str, str], Counter[str]] = {}
    per_device: dict[str, Counter[str]] = {}
    for (worker, device, outcome), n in counts.items():
        per_worker.setdefault((worker, device), Counter())[outcome] += n
        per_device.setdefault(device, Counter())[outcome] += n
    lines = [f"mla-verify: {worker} -> {device}: {detail(outcomes)}"
             for (worker, device), outcomes in sorted(per_worker.items(), key=lambda kv: _natural(kv[0][0]))]
    for device, outcomes in sorted(per_device.items(), key=lambda kv: _natural(kv[0])):
        workers = sum(1 for _, d in per_worker if d == device)
        total = sum(outcomes.values())
        lines.append(f"mla-verify: {device}: {total} device test{'s' * (total != 1)} (using mla_device or marked "
                     f"gpu) on {workers} worker{'s' * (workers != 1)}: {ran_and_skipped(outcomes)}")
    return lines


def _natural(text: str) -> list[Any]:
    """Sort key that puts gw2 before gw10 and cuda:2 before cuda:10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]
