"""Run profiles: how many cases, how random, how long.

premerge  seeded and bounded: the same command gives the same cases and verdicts every time; explicit corner
          cases first (the envelope's extremes), then drawn cases.
fuzz      random, time-bounded, saved to an example database, ``hypothesis.target`` on the error ratio so the
          search climbs toward the worst inputs. Each run draws from a fresh seed (``run_seed``) unless one is
          given, and says which: the same seed draws the same cases again.
dev       a quick look.

A user's own cases (``--cases``) come before everything else in every profile (run/engine.py).
"""
from __future__ import annotations

import secrets
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from random import Random
from typing import Any

import hypothesis.core
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis.configuration import set_hypothesis_home_dir
from hypothesis.database import ExampleDatabase
from hypothesis.internal.conjecture import providers

from ..core.errors import UsageError


@dataclass(frozen=True)
class Profile:
    name: str
    max_examples: int  # drawn cases (corner cases come on top, in premerge)
    deterministic: bool
    corner_cases: bool
    targeted: bool
    minutes: float | None = None  # wall-clock bound (fuzz)
    fp8_probes: bool = False  # half the fp8 cases near-identical keys or one key (strategies.FP8_PROBES)
    # (k, n): judge only cases k, k+n, k+2n, ... of the user's and the corner cases and, in a deterministic
    # profile, of the drawn sequence (pytest shard k of n); every shard draws the whole sequence, so together
    # the shards judge the cases one process would. (A random profile's shards each search from a seed of
    # their own: pytest_helpers.Shard.)
    share: tuple[int, int] = (0, 1)


PROFILES = {
    "premerge": Profile("premerge", max_examples=60, deterministic=True, corner_cases=True, targeted=False),
    "fuzz": Profile("fuzz", max_examples=1_000_000, deterministic=False, corner_cases=False, targeted=True,
                    minutes=5.0, fp8_probes=True),
    "dev": Profile("dev", max_examples=10, deterministic=True, corner_cases=False, targeted=False),
}


DEFAULT_SEED = 20261201  # the deterministic profiles' seed: the same cases on every run
SEED_BITS = 32  # a fresh seed is below 2**32: short enough to read and to type back as --seed


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise UsageError(f"unknown profile {name!r}; choose one of: {', '.join(PROFILES)}")
    return PROFILES[name]


def run_seed(profile: Profile, seed: int | None) -> int:
    """The seed a run draws from: ``seed`` when given, else the profile's fixed one (premerge, dev: the same
    cases every run), else a fresh one (fuzz): a fixed seed would walk every session on every machine down
    the same path, and miss forever what that path misses."""
    if seed is not None:
        return seed
    return DEFAULT_SEED if profile.deterministic else secrets.randbits(SEED_BITS)


def hypothesis_settings(profile: Profile, max_examples: int | None,
                        database: ExampleDatabase | None) -> settings:
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink]
    if profile.targeted:
        phases.insert(3, Phase.target)
    return settings(
        max_examples=max_examples if max_examples is not None else profile.max_examples,
        database=None if profile.deterministic else database,  # a database would make premerge history-dependent
        deadline=None,  # kernel JIT and large cases make per-example time meaningless
        derandomize=False,  # determinism comes from an explicit seed (engine.py), so --seed means something
        phases=phases,
        verbosity=Verbosity.quiet,
        print_blob=False,
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),  # big tensors are drawn from small specs; nothing to flag
    )


class _Shared:
    """A change to Hypothesis's process-wide state held while any search needs it: searches of several backends
    run side by side, in threads (run/side_by_side.py), so the first to enter makes the change and the last to
    leave undoes it."""

    def __init__(self, change: Callable[[], AbstractContextManager[None]]) -> None:
        self._change, self._lock, self._holders = change, threading.Lock(), 0
        self._undo = ExitStack()

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._undo.enter_context(self._change())
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0:
                    self._undo.close()


@contextmanager
def _scratch_storage() -> Iterator[None]:
    with tempfile.TemporaryDirectory(prefix="mla-verify-hypothesis-") as scratch:
        set_hypothesis_home_dir(scratch)
        try:
            yield
        finally:
            set_hypothesis_home_dir(None)


@contextmanager
def _no_local_constants() -> Iterator[None]:
    original = getattr(providers, "_get_local_constants", None)
    cache = getattr(getattr(providers, "CONSTANTS_CACHE", None), "cache", None)  # (built-in, local) per draw kind
    constants = getattr(providers, "Constants", None)
    if original is None or cache is None or constants is None:
        yield
        return
    none_local = constants()
    cache.clear()
    providers._get_local_constants = lambda: none_local
    try:
        yield
    finally:
        providers._get_local_constants = original
        cache.clear()


_storage, _constants = _Shared(_scratch_storage), _Shared(_no_local_constants)


def hypothesis_storage() -> AbstractContextManager[None]:
    """Hypothesis caches the constants in the source of every local module under its storage directory
    (``./.hypothesis`` by default) as it draws. The engine keeps no example database there (it has none or
    the one named), so a run must leave nothing in the user's directory: for the run the cache goes to a
    temporary directory, then Hypothesis's default (``HYPOTHESIS_STORAGE_DIRECTORY``, else ./.hypothesis)
    is back for the user's own Hypothesis tests."""
    return _storage.held()


def draws_free_of_local_source(seeded: bool) -> AbstractContextManager[None]:
    """Hypothesis mixes literals found in the source of local (not installed) modules into what it draws:
    mla-verify's own when it is installed editable, the user's kernel file. A seeded run's cases would then
    depend on how mla-verify was installed and on every literal in the kernel's file, so a seeded run draws
    with no local constants (Hypothesis's built-in constants stay). This reaches into Hypothesis's internals;
    where they have moved nothing changes, and tests/test_engine.py's test of this property fails."""
    return _constants.held() if seeded else nullcontext()


@contextmanager
def seeded_with_database(seed: int) -> Iterator[None]:
    """Hypothesis's ``@seed`` turns its example database off, so a run that uses one is seeded here instead:
    Hypothesis draws each search's random generator from a per-thread one, which starts from ``seed`` for the
    run. Given the database's contents, the run then draws the same cases again. This reaches into
    Hypothesis's internals; where they have moved nothing is seeded, and tests/test_engine.py's test of this
    property fails."""
    local: Any = getattr(hypothesis.core, "threadlocal", None)
    try:
        saved = local._hypothesis_global_random
    except AttributeError:
        yield
        return
    local._hypothesis_global_random = Random(seed)
    try:
        yield
    finally:
        local._hypothesis_global_random = saved
