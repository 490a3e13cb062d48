"""Backends whose warm-up writes down which process took each step (build, load) and ran each case, and when,
for tests/test_warmup.py. They are plugins (the ``mla_verify.backends`` entry points the test declares) so that
an isolated worker, which finds its backend by name, gets them too. Importable with tests/ on PYTHONPATH; the
journal is the file named by JOURNAL_ENV, one JSON object a line.

- ``warm-journal``: two modules; its kernel segfaults on big batches (crashing_kernels), so that workers die
  and are restarted.
- ``warm-first`` and ``warm-later``, verified in that order: a module each, and a correct kernel. The later
  one's module is built as FlashInfer's are (flashinfer_jit.py): locked before its builder returns, its
  worker's load waiting for the lock (``WarmupModule.ready``); and its build ends only once the first
  backend has judged a case -- which only a run that judges the first backend while later ones still build
  ever does (else it ends after BUILD_TIMEOUT_S)."""
from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch
from cli_kernels import good
from crashing_kernels import segfaults_on_big_batches
from filelock import FileLock

from mla_verify.backends.base import WarmupModule
from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.backends.user_kernel import kernel_backend

JOURNAL_ENV = "MLA_TEST_WARM_JOURNAL"
NAME = "warm-journal"
MODULES = ("journal-a", "journal-b")
LOAD_S = 0.05  # each load takes this long, so that the warm-up's reported time can be told from zero
FIRST, LATER = "warm-first", "warm-later"
BUILD_TIMEOUT_S = 60.0


def _write(step: str, detail: Any = None) -> None:
    with open(os.environ[JOURNAL_ENV], "a") as journal:  # one short append a line: whole across processes
        journal.write(json.dumps({"step": step, "pid": os.getpid(), "detail": detail, "t": time.time()}) + "\n")


def _steps() -> list[str]:
    """The steps written so far (a line another process is still writing may be cut short: it is left out; no
    journal yet, as before any process has written a step, is no steps)."""
    try:
        with open(os.environ[JOURNAL_ENV]) as journal:
            lines = journal.read().split("\n")[:-1]
    except FileNotFoundError:
        return []
    return [json.loads(line)["step"] for line in lines]


def in_background(build: Callable[[Sequence[Any]], None]) -> Callable[[Sequence[Any]], list[Future[None]]]:
    """A builder (``WarmupModule.build``) that runs ``build`` over all its modules in a thread and returns at
    once: one future per module, each ending as ``build`` does."""
    def start(specs: Sequence[Any]) -> list[Future[None]]:
        futures = [Future[None]() for _ in specs]

        def run() -> None:
            try:
                build(specs)
            except Exception as exc:  # noqa: BLE001 - each module's build failed with it
                for f in futures:
                    f.set_exception(exc)
            else:
                for f in futures:
                    f.set_result(None)
        threading.Thread(target=run).start()
        return futures
    return start


@in_background
def _build(specs: Sequence[str]) -> None:
    _write("build", sorted(specs))


def _load(name: str) -> None:
    time.sleep(LOAD_S)
    _write("load", name)


def _kernel(*args: Any, **kwargs: Any) -> Any:
    _write("case")
    return segfaults_on_big_batches(*args, **kwargs)


_kernel.mla_verify_envelope = segfaults_on_big_batches.mla_verify_envelope  # type: ignore[attr-defined]


class Journaled(TrtllmStyleBackend):
    def warmup(self, device: torch.device) -> list[WarmupModule]:
        return [WarmupModule(name, name, _build, partial(_load, name)) for name in MODULES]


def make_backend() -> Journaled:
    return Journaled(NAME, _kernel, kernel_backend(_kernel, NAME).envelope)


def _lock(module: str) -> FileLock:
    return FileLock(f"{os.environ[JOURNAL_ENV]}.{module}.lock", thread_local=False)


def _build_later(specs: Sequence[str]) -> list[Future[None]]:
    locks = [_lock(spec) for spec in specs]
    for lock in locks:  # before returning, as flashinfer_jit.build_all does
        lock.acquire()
    futures = [Future[None]() for _ in specs]

    def run() -> None:
        deadline = time.monotonic() + BUILD_TIMEOUT_S
        try:
            while time.monotonic() < deadline and f"case {FIRST}" not in _steps():
                time.sleep(0.05)
            _write("built", sorted(specs))
        finally:
            for lock, future in zip(locks, futures):
                lock.release()
                future.set_result(None)
    threading.Thread(target=run).start()
    return futures


def _wait_built(module: str) -> None:
    _write("waiting", module)
    with _lock(module):
        pass


def _first_kernel(*args: Any, **kwargs: Any) -> Any:
    _write(f"case {FIRST}")
    return good(*args, **kwargs)


class FirstOrLater(TrtllmStyleBackend):
    def warmup(self, device: torch.device) -> list[WarmupModule]:
        if self.name == FIRST:
            return [WarmupModule("first-module", "first-module", _build, partial(_load, "first-module"))]
        return [WarmupModule("later-module", "later-module", _build_later, partial(_load, "later-module"),
                             partial(_wait_built, "later-module"))]


def make_first() -> FirstOrLater:
    return FirstOrLater(FIRST, _first_kernel, kernel_backend(good, FIRST).envelope)


def make_later() -> FirstOrLater:
    return FirstOrLater(LATER, good, kernel_backend(good, LATER).envelope)
