"""Shadow mode for any pytest run (loaded by mla_verify.pytest_plugin): ``--mla-shadow strict|record`` checks every
MLA decode call the tests make, e.g. an engine's own attention-backend tests.

Options, each also ``MLA_VERIFY_<NAME>`` in the environment and ``mla_<name>`` in the ini (pytest_plugin's order:
command line, environment, ini): ``shadow`` (strict, record, 1 = strict, 0/off), ``shadow_kernel`` (a Contract-1
kernel to wrap too, MODULE:ATTR, repeatable), ``shadow_every``, ``shadow_budget`` (seconds of checking per
minute), ``shadow_fixtures`` (where reproducers go). The session starts before any test module is imported, so
``from flashinfer.decode import ...`` in the code under test binds the wrapped function; the summary and the first
report of each call site are part of the terminal summary (under xdist, the workers' are merged in the controller).
"""
from __future__ import annotations

from typing import Any, Literal

import pytest

from .core.errors import UsageError
from .pytest_plugin import _raw
from .shadow.session import ShadowSession, parse_mode, session_from_settings
from .shadow.tally import Tally

_SESSION_KEY = pytest.StashKey[ShadowSession]()
_MERGED_KEY = pytest.StashKey[Tally]()
_WORKER_OUTPUT = "mla_verify_shadow"

_OPTIONS = (
    ("shadow", "MODE", "check the MLA decode calls the tests make: strict (raise at a bad call), record, off"),
    ("shadow_kernel", "MODULE:ATTR", "a Contract-1 kernel to check too (repeatable)"),
    ("shadow_every", "N", "check 1 call in N at each call site (default 1)"),
    ("shadow_budget", "SECONDS", "at most this many seconds of checking per minute (default: no limit)"),
    ("shadow_fixtures", "DIR", "where reproducers of mismatching calls go (default fixtures/shadow)"),
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("mla-verify")
    for name, metavar, help_text in _OPTIONS:
        repeatable = name == "shadow_kernel"
        group.addoption("--mla-" + name.replace("_", "-"), dest="mla_" + name, metavar=metavar, default=None,
                        action="append" if repeatable else "store",
                        help=f"{help_text}; env MLA_VERIFY_{name.upper()}, ini mla_{name}")
        kind: Literal["linelist", "string"] = "linelist" if repeatable else "string"
        parser.addini("mla_" + name, help_text, type=kind)


def _kernels(config: pytest.Config) -> list[str]:
    raw = _raw(config, "shadow_kernel") or []
    items = [raw] if isinstance(raw, str) else list(raw)
    return [k.strip() for item in items for k in item.split(",") if k.strip()]


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    try:
        mode = parse_mode(_raw(config, "shadow"), "--mla-shadow")
        if mode is None:
            return
        session = session_from_settings(mode, _raw(config, "shadow_every"), _raw(config, "shadow_budget"),
                                        _kernels(config), _raw(config, "shadow_fixtures"), "--mla-shadow-*",
                                        summary=False)
    except UsageError as e:
        raise pytest.UsageError(str(e)) from None
    config.stash[_SESSION_KEY] = session.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    config = session.config
    shadow = config.stash.get(_SESSION_KEY, None)
    if shadow is not None and hasattr(config, "workeroutput"):
        config.workeroutput[_WORKER_OUTPUT] = shadow.tally.to_json()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    counts = getattr(node, "workeroutput", {}).get(_WORKER_OUTPUT)
    if counts is not None:
        node.config.stash.setdefault(_MERGED_KEY, Tally()).merge(Tally.from_json(counts))


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    shadow = config.stash.get(_SESSION_KEY, None)
    if shadow is None:
        return
    tally = shadow.tally
    merged = config.stash.get(_MERGED_KEY, None)
    if merged is not None:  # xdist's controller: its own calls (none, usually) and every worker's
        tally = Tally()
        tally.merge(shadow.tally)
        tally.merge(merged)
    terminalreporter.write_sep("-", "mla-verify shadow")
    for line in tally.summary_lines(shadow.settings()):
        terminalreporter.write_line(line)
    for report in tally.reports:  # a passing test's captured stderr is never shown (record mode, xdist workers)
        terminalreporter.write_line(report)


def pytest_unconfigure(config: pytest.Config) -> None:
    shadow = config.stash.get(_SESSION_KEY, None)
    if shadow is not None:
        shadow.stop()
