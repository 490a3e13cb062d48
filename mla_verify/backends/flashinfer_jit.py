"""FlashInfer's JIT modules as backends' warm-up (``Backend.warmup``): built before a run's first case.

Left alone, FlashInfer compiles each module at its first call, one after the other, inside the cases (on a
fresh H200 that was most of a 6-minute run: docs/pytest.md). Here every pending module of a run is built at
once, before its first case, and nothing is rebuilt that a restored cache already holds.

Each module is built by its own ninja in its own directory, which is where FlashInfer's getter runs ninja at
the module's first use (``JitSpecNvcc.build``: ``ninja -C <jit dir>/<module>``). ninja keeps its build log in
the directory it runs in, and it rebuilds an output its log does not list ("command line not found in log").
FlashInfer's own parallel build, ``build_jit_specs``, runs one ninja over every module from the JIT directory
above them: its log is not the one the getter's ninja reads, so every process that loaded a module first
compiled it again, whole and serially (docs/pytest.md, "Warm-up").
"""
from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from functools import partial
from typing import Any

import torch

from .base import WarmupModule


def build_all(specs: Sequence[Any]) -> list[Future[None]]:
    """Starts building every JitSpec of ``specs`` and returns at once, one future per spec, done when that
    module is built (or raising the build's error, the compiler's first error on its first line). Before
    returning, each module is locked with FlashInfer's own per-module lock, which its getter takes to build
    and load: a process that loads the module meanwhile (a case worker) waits for this build instead of
    compiling it too. A module another process is building is waited for, then checked by ninja like the rest.

    The host's jobs (``MAX_JOBS``, FlashInfer's variable, else one per core) are shared out: a module runs
    ninja with a job per source, and starts once that many are free, in the order given -- so the first
    backend's modules first, and its cases can start while the others build -- a later, smaller module going
    ahead wherever it fits. A module another process is building takes no job while this waits for it."""
    modules = [_Module(spec) for spec in specs]
    threading.Thread(target=_schedule, args=(modules, _job_count()), name="mla-verify flashinfer builds").start()
    return [m.future for m in modules]


def wait_built(spec: Any) -> None:
    """Returns once no process is building ``spec`` (it holds FlashInfer's lock on the module meanwhile)."""
    from filelock import FileLock

    with FileLock(spec.lock_path, thread_local=False):
        pass


class _Module:
    """One module's build: its lock, taken now if it is free, and the future its build completes."""

    def __init__(self, spec: Any) -> None:
        from filelock import FileLock, Timeout

        self.spec, self.future = spec, Future[None]()
        self.jobs = max(1, len(spec.sources))
        self.started = False
        self.lock = FileLock(spec.lock_path, thread_local=False)
        try:
            self.lock.acquire(timeout=0)
            self.claimed = True
        except Timeout:  # another process is building it: build() waits for it
            self.claimed = False

    def build(self, jobs: int) -> None:
        from flashinfer.jit import cpp_ext

        try:
            if not self.claimed:
                self.lock.acquire()
            try:
                if not self.spec.aot_path.exists():  # a prebuilt (AOT) module is loaded as it is
                    self.spec.write_ninja()
                    # as the getter runs it: in the module's own directory, hence with its build log
                    cpp_ext.run_ninja(self.spec.build_dir, self.spec.ninja_path, False, max_jobs=jobs)
            finally:
                self.lock.release()
        except Exception as exc:  # noqa: BLE001 - the warm-up reports it; the cases meet it again
            self.future.set_exception(_with_first_error(exc))
        else:
            self.future.set_result(None)


def _schedule(modules: list[_Module], jobs: int) -> None:
    """Starts each module's build once its jobs are free (run/warmup.py waits for their futures)."""
    try:
        _start_in_turn(modules, jobs)
    except BaseException as exc:  # e.g. no thread could start: a future never done would hang the warm-up
        for module in modules:
            if not module.started:
                module.future.set_exception(exc)
                if module.claimed:
                    module.lock.release()
        raise


def _start_in_turn(modules: list[_Module], jobs: int) -> None:
    free = jobs
    changed = threading.Condition()

    def run(module: _Module, taken: int) -> None:
        nonlocal free
        module.build(taken)
        with changed:
            free += taken
            changed.notify()

    # a module another process builds is waited for outside the jobs' count (waiting holds no job: two processes
    # could otherwise each hold jobs waiting for the other's module); its ninja then finds it built
    for module in modules:
        if not module.claimed:
            threading.Thread(target=module.build, args=(module.jobs,), name=f"mla-verify wait {module.spec.name}",
                             ).start()
            module.started = True
    queue = [m for m in modules if m.claimed]
    with changed:
        while queue:
            for module in list(queue):
                taken = min(module.jobs, jobs)
                if taken <= free:
                    free -= taken
                    queue.remove(module)
                    threading.Thread(target=run, args=(module, taken), name=f"mla-verify build {module.spec.name}",
                                     ).start()
                    module.started = True
            if queue:
                changed.wait()


def _job_count() -> int:
    max_jobs = os.environ.get("MAX_JOBS", "")
    if max_jobs.isdigit() and int(max_jobs) > 0:
        return int(max_jobs)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _with_first_error(exc: Exception) -> Exception:
    """A failed ninja run's error with the compiler's first error on its first line (FlashInfer puts ninja's
    whole log after a line that says only that ninja failed)."""
    lines = str(exc).splitlines()
    error = next((ln.strip() for ln in lines[1:] if "error" in ln.lower()), None)
    if not isinstance(exc, RuntimeError) or error is None:
        return exc
    first = f"{lines[0].removesuffix(' Ninja output:')} First error: {error}"
    return RuntimeError("\n".join([first, *lines[1:]]))


def fa_module(fi_backend: str, kv_dtype: torch.dtype, kv_lora_rank: int, rope_dim: int) -> WarmupModule:
    """The fa2/fa3 module the wrapper plans for a bf16 query and output, int32 indices, no profiler."""
    from flashinfer.jit import gen_batch_mla_module
    from flashinfer.mla._batch_mla._backends._fa_common import get_batch_mla_module

    args = (fi_backend, torch.bfloat16, kv_dtype, torch.bfloat16, torch.int32, kv_lora_rank, rope_dim, False)
    spec = gen_batch_mla_module(*args)
    return WarmupModule(spec.name, spec, build_all, partial(get_batch_mla_module, *args), partial(wait_built, spec))


def swa_module() -> WarmupModule:
    """The one SM90 sliding-window MLA module (all its tactics are in it)."""
    from flashinfer.jit.mla import gen_mla_swa_sm90_module
    from flashinfer.mla._swa import _get_module

    spec = gen_mla_swa_sm90_module()
    return WarmupModule(spec.name, spec, build_all, _get_module, partial(wait_built, spec))
