"""Verifying a kernel from pytest, in the kernel engineer's own repository (docs/pytest.md).

Three ways in, all running the engine as ``mla-verify check`` does and failing with its FAIL block (the
minimal case, the diagnosis, the reproducer it wrote and the ``mla-verify replay`` command):

- ``pytest --mla-kernel mykernels:decode`` (or ``path/to/kernels.py:decode``), from any directory: the plugin
  adds the kernel's tests to whatever else was collected (none needed).
- one line in a test: ``verify_kernel("mykernels:decode")`` or ``verify_kernel(decode)``.
- the ``mla_verify_kernel`` fixture: ``verify_kernel`` bound to the run's options, device and shard.

Sharding: with N shards (``--mla-shards N``; by default the number of xdist workers), each kernel's run
becomes N tests, so ``pytest -n N`` spreads one kernel's work over N workers. A seeded profile (premerge,
dev): every shard draws the cases one process would and judges cases k, k + N, ... of them (corner cases
too), so the cases do not depend on N. A random one (fuzz): shard k searches with the seed base + k (the
plugin picks a fresh base for each run and prints it) for ceil(max_examples / N) cases (its judged errors
steer its draws, so shards could not share one sequence). The user's own cases (``--mla-cases``) are split
between the shards as the corner cases are, in every profile.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from .backends.base import Backend
from .backends.user_kernel import kernel_backend, load_kernel
from .core.errors import MLAVerifyError
from .draw.hypothesis_db import resolve_database
from .draw.profiles import Profile, get_profile
from .draw.strategies import Case
from .records.cases import load_cases
from .records.failure import DEFAULT_FIXTURES_DIR, failure_lines, in_flight_path, record_in_flight, save_reproducer
from .run.engine import EngineResult
from .run.simplify import size
from .run.supervise import IN_PROCESS, how_to_run, search


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` of one backend's verification."""

    index: int = 0
    count: int = 1

    def plan(self, profile: Profile, seed: int | None) -> tuple[Profile, int | None, int | None]:
        """This shard's (profile, number of drawn cases, seed); None: the profile's, the engine's default."""
        if self.count == 1:
            return profile, None, seed
        shared = replace(profile, share=(self.index, self.count))  # every count-th given and corner case
        if profile.deterministic:  # and of the whole seeded sequence
            return shared, None, seed
        # a search of its own, from the run's seed + its index (without one, from a fresh seed of its own)
        return shared, math.ceil(profile.max_examples / self.count), None if seed is None else seed + self.index

    @property
    def label(self) -> str:
        return f"shard{self.index + 1}of{self.count}"


FAILURE_RECORD = "mla_failure"  # the attribute of a failed verification's pytest.fail exception: failure_record


def failure_record(exc: BaseException) -> dict[str, Any] | None:
    """What the summary compares across shards of a failed verification (backend, shard, the minimal case's
    size and description, its reproducer), carried by its ``pytest.fail`` exception; None for another."""
    record = getattr(exc, FAILURE_RECORD, None)
    return record if isinstance(record, dict) else None


def verify_backend(backend: Backend, device: torch.device | str = "cpu", profile: str = "premerge",
                   seed: int | None = None, shard: Shard = Shard(), hypothesis_db: str | None = None,
                   fixtures_dir: str | Path = DEFAULT_FIXTURES_DIR, isolate: bool | None = None,
                   otherwise: str = IN_PROCESS, cases: str | Path | None = None) -> EngineResult:
    """Run the engine on ``backend``; skip (pytest) when it cannot run on ``device``, fail with the FAIL block
    when a case fails (its reproducer written to ``fixtures_dir``; failure_record). ``isolate`` as ``check
    --isolate`` (run/supervise.py's how_to_run): None, the search supervised, in a copy of this process, going
    on isolated if a kernel crashes it -- where this process cannot be copied (a GPU), ``otherwise``; True, each
    case in a worker process; both fail the crashing case. False (IN_PROCESS): in this process, the case in
    flight is recorded before its kernel runs (failure.record_in_flight), which a crash of this process (an
    xdist worker's) leaves behind. ``cases``: a directory of the user's own cases (records/cases.py), judged
    first."""
    fixtures_dir = Path(fixtures_dir)
    how = how_to_run(isolate, device, otherwise)

    def starting(case: Any) -> None:
        record_in_flight(fixtures_dir, backend.name, case.spec, case.layout, case.transform, torch.device(device),
                         backend.source)

    try:
        chosen, max_examples, shard_seed = shard.plan(get_profile(profile), seed)
        given = load_cases(cases, "--mla-cases") if cases is not None else []
        result = search(backend, device, chosen, how, seed=shard_seed, max_examples=max_examples,
                        database=resolve_database(hypothesis_db), on_start=starting if how == IN_PROCESS else None,
                        given_cases=given)
    except MLAVerifyError as e:  # a bad profile, database, case file or environment variable: one line
        pytest.fail(str(e), pytrace=False)
    in_flight_path(fixtures_dir).unlink(missing_ok=True)
    if result.interrupted:  # the engine stopped at Ctrl-C with what it had: pytest must stop too
        raise KeyboardInterrupt
    if result.unavailable:
        pytest.skip(result.unavailable)
    if result.failure is not None:
        case = result.failure
        saved = save_reproducer(fixtures_dir, case, source=backend.source, device=device) \
            if case.problem is not None or case.crash else None
        lines = failure_lines(case, None if saved is None else str(saved), fixtures_dir, result.given_origin)
        if not chosen.deterministic:
            lines.append(f"  drawn from seed {result.seed}" + (f" (the run's seed {seed} + shard index {shard.index})"
                                                                if shard.count > 1 and seed is not None else ""))
        failed = pytest.fail.Exception("\n".join(lines), pytrace=False)  # as pytest.fail raises it, and with:
        setattr(failed, FAILURE_RECORD, {  # noqa: B010 - an attribute pytest's exception does not declare
            "backend": backend.name, "shard": shard.label if shard.count > 1 else "",
            "size": list(size(Case(case.spec, case.layout, case.metamorphic))), "reason": case.reason,
            "case": case.spec.describe(), "reproducer": None if saved is None else str(saved)})
        raise failed
    assert result.cases, f"no case was run for {backend.name}"
    return result


def verify_kernel(kernel: str | Callable[..., Any], device: torch.device | str = "cpu", **options: Any) -> EngineResult:
    """``verify_backend`` on a Contract-1 kernel: ``"module:attr"``, ``"path/to/file.py:attr"`` or the callable
    itself (held to its declared ``mla_verify_envelope``, else trtllm-gen's)."""
    try:
        if isinstance(kernel, str):
            backend = load_kernel(kernel, "verify_kernel")
        else:
            backend = kernel_backend(kernel, f"{getattr(kernel, '__module__', '?')}:"
                                             f"{getattr(kernel, '__qualname__', type(kernel).__name__)}")
    except MLAVerifyError as e:
        pytest.fail(str(e), pytrace=False)
    return verify_backend(backend, device, **options)
