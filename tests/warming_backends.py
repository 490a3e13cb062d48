"""A backend whose warm-up writes down which process took each step (build, load) and ran each case, for
tests/test_warmup.py. It is a plugin (the ``mla_verify.backends`` entry point the test declares) so that an
isolated worker, which finds its backend by name, gets it too. Its kernel segfaults on big batches
(crashing_kernels), so that workers die and are restarted. Importable with tests/ on PYTHONPATH; the journal
is the file named by JOURNAL_ENV, one JSON object a line."""
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
from crashing_kernels import segfaults_on_big_batches

from mla_verify.backends.base import WarmupModule
from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.backends.user_kernel import kernel_backend

JOURNAL_ENV = "MLA_TEST_WARM_JOURNAL"
NAME = "warm-journal"
MODULES = ("journal-a", "journal-b")
LOAD_S = 0.05  # each load takes this long, so that the warm-up's reported time can be told from zero


def _write(step: str, detail: Any = None) -> None:
    with open(os.environ[JOURNAL_ENV], "a") as journal:  # one short append a line: whole across processes
        journal.write(json.dumps({"step": step, "pid": os.getpid(), "detail": detail}) + "\n")


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
