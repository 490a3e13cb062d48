"""pytest plugin (loaded through the pytest11 entry point): the suite's options, markers, fixtures, and the
per-worker device assignment for ``pytest -n auto`` (see workers.py and docs/pytest.md).

Every option is read from the command line, else ``MLA_VERIFY_<NAME>`` in the environment, else the ini
key ``mla_<name>``, else its default. Shadow mode's options (``--mla-shadow`` ...) live in shadow_pytest.py.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from .backends import all_backends
from .backends.user_kernel import load_kernel
from .errors import UsageError
from .hypothesis_db import resolve_database
from .profiles import PROFILES
from .workers import Assignment, DeviceRequest, SlotTable, assign_worker, parse_device_request

# premerge is derandomized: a plain `pytest` run gives the same cases on any number of workers and GPUs.
DEFAULT_PROFILE = "premerge"
SLOT_INPUT = "mla_verify_slot"  # key in xdist's workerinput: the slot the controller gave this worker
_KERNEL_RE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")

pytest_plugins = ["mla_verify.shadow_pytest"]  # --mla-shadow: checks the MLA decode calls any test makes

_OPTIONS_KEY = pytest.StashKey["MLAOptions"]()
_ASSIGNMENT_KEY = pytest.StashKey[Assignment]()
_SLOTS_KEY = pytest.StashKey[SlotTable]()


@dataclass(frozen=True)
class MLAOptions:
    """The suite's options for this run, as given (``profile`` names a profiles.PROFILES entry)."""

    backends: tuple[str, ...]
    kernel: str | None  # MODULE:ATTR, imported by whoever runs it
    device: DeviceRequest
    profile: str
    seed: int | None
    hypothesis_db: str | None  # directory or redis:// URL, resolved by hypothesis_db.resolve_database


# name, metavar, help; "backend" is the one repeatable option (an ini linelist, a comma list in the env)
_OPTION_HELP = (
    ("backend", "NAME", "backend to verify (repeatable; default: every backend available here)"),
    ("kernel", "MODULE:ATTR", "a trtllm-style kernel callable to verify"),
    ("device", "DEVICE", "cpu, cuda, cuda:N or auto (default auto: each xdist worker takes a visible GPU "
                         "round-robin, cpu when there is none)"),
    ("profile", "NAME", f"Hypothesis profile: {', '.join(PROFILES)} (default {DEFAULT_PROFILE})"),
    ("seed", "N", "Hypothesis seed (default: the profile's)"),
    ("hypothesis_db", "DB", "Hypothesis example database: a directory or redis://host:port/db"),
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mla-verify")
    for name, metavar, help_text in _OPTION_HELP:
        flag = "--mla-" + name.replace("_", "-")
        action = "append" if name == "backend" else "store"
        group.addoption(flag, dest="mla_" + name, action=action, default=None, metavar=metavar,
                        help=f"{help_text}; env MLA_VERIFY_{name.upper()}, ini mla_{name}")
        parser.addini("mla_" + name, help_text, type="linelist" if name == "backend" else "string")


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
    if kernel is not None and not _KERNEL_RE.fullmatch(kernel):
        raise UsageError(f"--mla-kernel: {kernel!r} is not MODULE:ATTR")
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
    backends = tuple(_raw(config, "backend") or ())
    known = all_backends()
    unknown = [name for name in backends if name not in known]
    if unknown:  # a typo must not turn the gate into "everything skipped"
        raise UsageError(f"--mla-backend: unknown backend {unknown[0]!r}; known: {', '.join(sorted(known))}")
    if kernel is not None:
        load_kernel(kernel)  # the same one-line errors as `mla-verify check --kernel`, before any test runs
    database = _raw(config, "hypothesis_db")
    resolve_database(database)
    return MLAOptions(backends=backends, kernel=kernel,
                      device=parse_device_request(_raw(config, "device") or "auto"), profile=profile,
                      seed=seed, hypothesis_db=database)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU that can run the backend under test")
    config.addinivalue_line("markers", "slow: long-running (fuzz sessions, large problems)")
    try:
        config.stash[_OPTIONS_KEY] = options = read_options(config)
        if not hasattr(config, "workerinput"):  # the only process, or xdist's controller: fail here, once
            config.stash[_ASSIGNMENT_KEY] = assign_worker(options.device, None, None)
    except UsageError as e:
        raise pytest.UsageError(str(e)) from None
    if not hasattr(config, "workerinput"):
        config.stash[_SLOTS_KEY] = SlotTable()
        config.pluginmanager.register(DeviceTally(), "mla-verify-device-tally")


def worker_assignment(config: pytest.Config) -> Assignment:
    """This process's device: decided in pytest_configure outside xdist workers, else on first use."""
    if _ASSIGNMENT_KEY not in config.stash:
        workerinput = getattr(config, "workerinput", None)
        worker, slot = (workerinput["workerid"], workerinput[SLOT_INPUT]) if workerinput else (None, None)
        try:
            config.stash[_ASSIGNMENT_KEY] = assign_worker(config.stash[_OPTIONS_KEY].device, worker, slot)
        except UsageError as e:
            pytest.fail(str(e), pytrace=False)
    return config.stash[_ASSIGNMENT_KEY]


@pytest.fixture(scope="session")
def mla_options(pytestconfig: pytest.Config) -> MLAOptions:
    return pytestconfig.stash[_OPTIONS_KEY]


@pytest.fixture(scope="session")
def mla_device(pytestconfig: pytest.Config) -> torch.device:
    """This worker's device (``pytest_runtest_setup`` has already made it the current CUDA device)."""
    return torch.device(worker_assignment(pytestconfig).run_device)


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


# --- controller side under xdist (optional hooks: xdist may not be installed) ---

@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    node.workerinput[SLOT_INPUT] = node.config.stash[_SLOTS_KEY].claim(node.gateway.id)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    # Only a crash frees a slot: xdist starts the replacement right after this hook, so it takes exactly the
    # crashed worker's slot (a finished worker keeps its own, else the replacement would take that one).
    if error is not None:
        node.config.stash[_SLOTS_KEY].release(node.gateway.id)


class DeviceTally:
    """Counts the device tests (see ``uses_device``) each worker ran and prints them in the terminal summary.

    Lives in the process that writes the summary (xdist's controller, or the only process); the counts come
    from the tags ``pytest_runtest_setup`` put on each report, so a crashed worker's finished tests count too.
    """

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str, str]] = Counter()  # (worker, device label, outcome) -> tests

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props = dict(p for p in report.user_properties if len(p) == 2)
        if "mla_device" not in props:
            return
        if report.when == "call" or (report.when == "setup" and not report.passed):
            outcome = "error" if report.when == "setup" and report.failed else report.outcome
            self.counts[(props["mla_worker"], props["mla_device"], outcome)] += 1

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.counts:
            terminalreporter.write_sep("-", "mla-verify devices")
            for line in summary_lines(self.counts):
                terminalreporter.write_line(line)


def summary_lines(counts: "Counter[tuple[str, str, str]]") -> list[str]:
    """One line per worker (its device and outcomes), then one per device (its tests and how many workers)."""
    def detail(outcomes: "Counter[str]") -> str:
        return ", ".join(f"{n} {outcome}" for outcome, n in sorted(outcomes.items()))

    per_worker: dict[tuple[str, str], Counter[str]] = {}
    per_device: dict[str, Counter[str]] = {}
    for (worker, device, outcome), n in counts.items():
        per_worker.setdefault((worker, device), Counter())[outcome] += n
        per_device.setdefault(device, Counter())[outcome] += n
    lines = [f"mla-verify: {worker} -> {device}: {detail(outcomes)}"
             for (worker, device), outcomes in sorted(per_worker.items(), key=lambda kv: _natural(kv[0][0]))]
    for device, outcomes in sorted(per_device.items(), key=lambda kv: _natural(kv[0])):
        workers = sum(1 for _, d in per_worker if d == device)
        lines.append(f"mla-verify: {device}: {sum(outcomes.values())} tests ({detail(outcomes)}) "
                     f"on {workers} worker(s)")
    return lines


def _natural(text: str) -> list[Any]:
    """Sort key that puts gw2 before gw10 and cuda:2 before cuda:10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]
