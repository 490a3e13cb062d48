"""Each case judged in a worker process, so that a kernel that kills its process -- a signal (a segfault, an
abort), a CUDA error that leaves the device context unusable, a native hang ended by the watchdog -- costs one
case, which fails as a crash, while the search in the parent goes on and shrinks it like any failure.

The model is AFL's fork server: a forkserver process imports torch and this package once, and each worker
forks from it in milliseconds, loads the backend (``loaded_backend``: by name, a ``--kernel`` from where it
was loaded, or a flashinfer-bench solution from its files), warms up (warmup.py: it loads the backend's
compiled modules, which the parent builds meanwhile, so their load is no case's time) and judges cases until
it dies; a dead worker is replaced, and warms up again, before the next case. A worker can be launched early
(``launch``: check starts every backend's at once, so that they warm up side by side) and is waited for at
its first case (``start``).
Each worker makes its own CUDA context, never an inherited one: forking a process that holds one is not safe,
and torch refuses CUDA in the child. The fork server is a fresh interpreter whatever the parent did to CUDA,
but what runs as Python starts (a sitecustomize, a .pth file) runs there too; a worker forked from a fork
server where CUDA was initialised says so before anything else, and from then on this process starts its
workers by spawn (each a fresh interpreter: slower to start, it never inherits CUDA). A worker that cannot
start -- it cannot load its backend, or cannot start CUDA on its device -- is a UsageError that says why.
Where this process can be copied safely (``forkable``: Linux, the CPU, no CUDA context, one torch thread), a
worker can instead be a copy of it (``fork=True``): no import at all, the backend as it is here (a closure too)
and a problem held here (a stored reproducer's); the supervisor (supervise.py) and replay use those.
Cases of every problem kind (mla_verify/kinds) are judged alike, by harness.run_case.

Only the case and its verdict cross the process boundary, as JSON messages: the worker rebuilds each problem
from its spec (problems regenerate bit for bit), the parent rebuilds a failing case's problem for its
reproducer, and the kernel's output comes back as safetensors bytes.
The stage each case is in is kept in shared memory, so the parent knows it after a death.
"""
from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import functools
import json
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.sharedctypes import RawValue
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..backends import Backend
from ..core.errors import FixtureError, MLAVerifyError, ProblemError, UsageError
from ..core.memory import RELEASE_ABOVE, release_cached
from ..core.tracebacks import exception_line
from ..fib.solution import loaded_backend
from ..judge.compare import ErrorStats
from ..kinds import kind_named
from ..problems.layouts import LayoutSpec
from . import watchdog
from .harness import STAGES, CaseResult, crashed, run_case
from .warmup import WarmupResult, warm_up

EXIT_STUCK = 86  # a worker ended by the watchdog's hard stop (a kernel stuck in native code); any free code
_PLAIN = ("verdict", "failures", "reason", "seconds", "diagnosis", "stages", "skip_kind", "hung",
          "resolved_backend", "invariance", "notes", "crash", "context_lost")  # the CaseResult fields sent as they are


class CaseJudge(Protocol):
    """Judges one case of one backend (``run_case``'s arguments beyond the backend); ``start`` readies it for
    the first case (an isolated worker warms up there), ``launch`` begins that early; ``close`` frees it."""

    def __call__(self, spec: Any, layout: LayoutSpec, transform: str, diagnose: bool) -> CaseResult: ...

    def launch(self) -> None:
        """Starts readying it without waiting (an isolated worker starts and warms up in the background)."""

    def start(self) -> None: ...

    @property
    def warmup(self) -> WarmupResult | None:
        """Its own warm-ups added up; None when it has none (in-process, the caller warms up)."""

    def close(self) -> None: ...


@dataclasses.dataclass
class InProcess:
    """Cases judged in this process (``--no-isolate``): a crash of the kernel is a crash of the run."""

    backend: Backend
    device: torch.device
    kernel_seconds: float | None
    problem: Any = None  # instead of building each case's from its spec (a fixture's replay)

    def __call__(self, spec: Any, layout: LayoutSpec, transform: str, diagnose: bool) -> CaseResult:
        return run_case(self.backend, spec, layout, self.device, transform, problem=self.problem, diagnose=diagnose,
                        kernel_seconds=self.kernel_seconds)

    def launch(self) -> None:
        pass

    def start(self) -> None:
        pass

    @property
    def warmup(self) -> WarmupResult | None:
        return None  # this process's: check and the pytest plugin warm up before the first case

    def close(self) -> None:
        pass


class Isolated:
    """Cases judged in a persistent worker process, replaced after each death. ``keep_output``: the kernel's
    output and LSE come back for every case (replay compares their bits), not only for failures. ``warm``: each
    worker loads the backend's modules before its first case (``warmup`` adds up what that took). ``fork``: each
    worker is a copy of this process (``forkable`` must hold), which judges ``problem`` when one is given (a
    stored reproducer's) instead of building each case's from its spec."""

    def __init__(self, backend: Backend, device: torch.device, kernel_seconds: float | None,
                 keep_output: bool = False, warm: bool = False, fork: bool = False, problem: Any = None) -> None:
        self.backend, self.device, self.kernel_seconds, self.keep_output = backend, device, kernel_seconds, keep_output
        self.problem = problem
        load: Callable[[], Backend] = functools.partial(_as_it_is, backend) if fork \
            else functools.partial(loaded_backend, backend.name, backend.source)
        self._worker = _Worker(backend.name, load, device, kernel_seconds, warm, fork, problem)

    def __call__(self, spec: Any, layout: LayoutSpec, transform: str, diagnose: bool) -> CaseResult:
        reply = self._worker.ask({"spec": spec.to_json(), "layout": layout.to_json(), "transform": transform,
                                  "diagnose": diagnose, "kernel_seconds": self.kernel_seconds,
                                  "keep_output": self.keep_output})
        if isinstance(reply, _Death):
            result = CaseResult(self.backend.name, spec, layout, transform, "pass")
            crashed(result, reply.what, reply.stage)
            return result
        result = decoded(self.backend.name, spec, layout, transform, *reply)
        return with_problem(result, self.backend.kind, self.device, self.problem)

    def launch(self) -> None:
        """A worker starting now, if none is: it loads the backend and warms up while this process goes on."""
        self._worker.launch()

    def start(self) -> None:
        """A worker ready now, if none is running (the first case, or the next after a death, then finds it warm)."""
        self._worker.start()

    @property
    def warmup(self) -> WarmupResult | None:
        return self._worker.warmup

    def close(self) -> None:
        self._worker.stop()


@dataclasses.dataclass(frozen=True)
class _Death:
    """What ended a worker, and the stage its case was in ("" before the first)."""

    what: str
    stage: str


class _Worker:
    """One persistent worker process judging one backend's cases, started on the first case (or launched
    earlier) and again after each death. ``load`` gives the worker its backend (``target``, its name: a
    registered one, or the ``--kernel`` it was given as); ``warm``: each worker loads the backend's compiled
    modules before its first case (warmup.py), and ``warmup`` adds up what that took. ``fork``: a copy of this
    process, judging ``problem`` if one is given; else forked from the fork server."""

    def __init__(self, target: str, load: Callable[[], Backend], device: torch.device,
                 kernel_seconds: float | None, warm: bool = False, fork: bool = False, problem: Any = None) -> None:
        self.target, self.load, self.fork, self.problem = target, load, fork, problem
        self.device, self.kernel_seconds, self.warm = device, kernel_seconds, warm
        self.warmup: WarmupResult | None = None
        # index into STAGES of the running case's stage. RawValue is imported with this module, not on first use:
        # pytester, which takes back the modules a run imported, would then leave two copies of
        # multiprocessing.heap, and a RawValue of one does not pickle for a worker of the next run
        self._stage = RawValue("i", -1)
        self._process: Any = None
        self._conn: Connection | None = None
        self._ready = False  # the running worker said it is ready for cases

    def ask(self, request: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | _Death:
        """The worker's verdict on ``request`` (its header and tensors), or what ended the worker. A worker
        whose device the case left unusable has exited: the next case gets a fresh one, the search goes on."""
        self.start()
        assert self._conn is not None
        self._stage.value = -1
        try:
            self._conn.send_bytes(json.dumps(request).encode())
            reply = self._receive()
        except (BrokenPipeError, ConnectionResetError):
            reply = None
        if reply is None:
            return _Death(self._death(), STAGES[self._stage.value] if self._stage.value >= 0 else "")
        header = reply[0]
        if "malformed" in header:  # raised in the parent as it would have been in-process
            kind, message = header["malformed"]
            raise (ProblemError if kind == "ProblemError" else FixtureError)(message)
        if "internal" in header:  # the suite's own bug, as in-process: not the kernel's verdict
            raise RuntimeError(f"in the isolated worker: {header['internal']}")
        if header["context_lost"]:
            self.stop()
            header["context_lost"] = False
        return reply

    def launch(self) -> None:
        """A worker starting now, if none is running; ``start`` waits for it."""
        with _launching:  # one at a time: a start changes this process's path and environment for a moment
            self._launch()

    def _launch(self) -> None:
        if self._process is None:
            context = multiprocessing.get_context("fork") if self.fork else _start_method.context()
            conn, child = context.Pipe()
            process = context.Process(
                target=_serve, name=f"mla-verify worker ({self.target})", daemon=True,
                args=(child, self.load, str(self.device), torch.get_num_threads(), watchdog.grace_seconds(),
                      self._stage, self.warm, self.problem))
            if self.fork:
                start_copy(process)
            else:
                with _this_package_first():
                    process.start()
            child.close()
            self._process, self._conn, self._ready = process, conn, False

    def start(self) -> None:
        """A worker ready for cases: launched if none is running, then waited for until it has loaded the
        backend and warmed up. Raises UsageError, one line, when it cannot start."""
        self.launch()
        if self._ready:
            return
        reply = self._receive()
        if reply is None:
            raise UsageError(f"{self.target}: the isolated worker died while starting ({self._death()}); "
                             "--no-isolate runs it in this process")
        if reply[0].get("inherited_cuda"):  # its fork server had CUDA initialised: never fork from it again
            self.stop()
            _start_method.refuse_forking()
            return self.start()
        if "error" in reply[0]:
            self.stop()
            raise UsageError(f"{self.target}: the isolated worker {reply[0]['error']} "
                             "(--no-isolate runs it in this process)")
        self._ready = True
        if reply[0]["warmup"] is not None:
            warmed = WarmupResult(**reply[0]["warmup"])
            self.warmup = warmed if self.warmup is None else self.warmup.then(warmed)

    def _receive(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
        """The worker's next message and its tensors; None when it died first."""
        assert self._conn is not None
        wait([self._conn, self._process.sentinel])
        try:
            header = json.loads(self._conn.recv_bytes())
            tensors = st_load(self._conn.recv_bytes()) if header.get("tensors") else {}
        except (EOFError, ConnectionResetError):
            return None
        return header, tensors

    def _death(self) -> str:
        """What ended the worker, and forget it (the next case starts another)."""
        self._process.join()
        code = self._process.exitcode
        self._forget()
        return ended_by(code, self.kernel_seconds, "its worker process")

    def stop(self) -> None:
        if self._process is None:
            return
        assert self._conn is not None
        self._conn.close()  # the worker's next read ends it
        self._process.join(timeout=5)
        if self._process.is_alive():  # stuck in a kernel, or still warming up
            self._process.kill()
            self._process.join()
        self._forget()

    def _forget(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._process = self._conn = None
        self._ready = False


class _StartMethod:
    """How this process starts its workers: forked from the fork server (milliseconds: torch and this package
    are imported there once) until a worker finds CUDA initialised in it, then by spawn."""

    def __init__(self) -> None:
        self._forkserver = "forkserver" in multiprocessing.get_all_start_methods()

    def context(self) -> Any:
        if not self._forkserver:
            return multiprocessing.get_context("spawn")
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(["torch", __name__])  # imported once in the fork server, not in every worker
        return context

    def refuse_forking(self) -> None:
        if self._forkserver:
            self._forkserver = False
            print("mla-verify: isolated workers start by spawn from now on (each a fresh interpreter, slower to "
                  "start): CUDA was initialised in the fork server they were forked from, by something Python runs "
                  "as it starts (a sitecustomize or a .pth file)", file=sys.stderr, flush=True)


_start_method = _StartMethod()
_launching = threading.Lock()  # backends judged side by side start (and restart) their workers from their threads


def start_fork_server() -> None:
    """The fork server started now, where workers fork from one: its imports (torch and this package, seconds
    on a GPU host) then overlap what this process does before its first worker starts (check: choosing the
    backends, declaring and building their modules) instead of delaying that worker."""
    context = _start_method.context()
    if context.get_start_method() == "forkserver":
        with _launching, _this_package_first():
            multiprocessing.forkserver.ensure_running()


@contextlib.contextmanager
def _this_package_first() -> Iterator[None]:
    """The folder holding this mla_verify first on the path while a worker starts, so that it imports this
    installation and not another one: a worker takes the parent's sys.path, where a relative entry (the
    current directory, which may have changed since) could find another first, and the fork server, started
    with the first worker, imports from PYTHONPATH and its own current directory (Python 3.11 ignores the
    sys.path it is given)."""
    root = str(Path(__file__).resolve().parents[2])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([root, saved] if saved else [root])
    sys.path.insert(0, root)
    try:
        yield
    finally:
        sys.path.remove(root)
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def ended_by(code: int | None, kernel_seconds: float | None, process: str) -> str:
    """What ended ``process`` (a worker, the search), by its exit code: a signal, the watchdog's hard stop
    (EXIT_STUCK) or another exit."""
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        return f"killed by {name} ({signal.strsignal(-code) or name})"
    if code == EXIT_STUCK:
        return (f"did not return within {kernel_seconds:g} s and could not be interrupted (stuck in native "
                f"code): {process} was ended")
    return f"{process} exited with code {code}"


def forkable(device: torch.device) -> bool:
    """Whether this process can judge ``device``'s cases in copies of itself (fork): on Linux, on the CPU, with
    no CUDA context (a copy cannot use it) and one torch thread -- a copy of a process whose OpenMP pool has
    run more threads hangs at its first parallel region, and with one thread a copy runs none (``check`` runs one
    on the CPU; more would round CPU sums otherwise than an isolated run does, so the count is not changed)."""
    return (sys.platform.startswith("linux") and device.type == "cpu" and torch.get_num_threads() == 1
            and not torch.cuda.is_initialized())


def start_copy(process: Any) -> None:
    """Start ``process``, of the fork context: a copy of this process. Python 3.12 and later warn that a copy
    of a process with threads may deadlock; the copy runs only this package's code, on streams of its own
    (``fresh_copy``), never the other threads' (a progress heartbeat, pytest-xdist's channel)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r".*use of fork\(\) may lead to deadlocks", DeprecationWarning)
        process.start()


def fresh_copy() -> None:
    """What a copy of this process (``start_copy``) does first: stdout and stderr of its own (another thread
    may have held the inherited ones' lock at the fork, and would never release it here) and no
    faulthandler dump (pytest enables one) on a crash its parent reports."""
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own, never closed
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    faulthandler.disable()


def case_judge(backend: Backend, device: torch.device, kernel_seconds: float | None, isolate: bool) -> CaseJudge:
    """The engine's judge: isolated, its workers warm up (the caller has built: warmup.py)."""
    if isolate:
        return Isolated(backend, device, kernel_seconds, warm=True)
    return InProcess(backend, device, kernel_seconds)


def _inherited_cuda() -> bool:
    """Whether this process was forked from one where CUDA was initialised (torch marks the child then)."""
    return bool(getattr(torch.cuda, "_is_in_bad_fork", lambda: False)())


def result_header(r: CaseResult) -> dict[str, Any]:
    """A case's verdict as JSON (what crosses a process boundary: ``decoded`` makes it a CaseResult again)."""
    header = {k: getattr(r, k) for k in _PLAIN}
    header["stats"] = None if r.stats is None else dataclasses.asdict(r.stats)
    return header


def decoded(name: str, spec: Any, layout: LayoutSpec, transform: str, header: dict[str, Any],
            tensors: dict[str, torch.Tensor]) -> CaseResult:
    """The CaseResult of ``result_header``'s JSON and the kernel's output."""
    stats = header["stats"]
    return CaseResult(name, spec, layout, transform, **{k: header[k] for k in _PLAIN},
                      stats=None if stats is None else ErrorStats(**{**stats, "worst": tuple(stats["worst"])}),
                      out=tensors.get("out"), lse=tensors.get("lse"))


def with_problem(result: CaseResult, kind: str, device: torch.device, problem: Any = None) -> CaseResult:
    """A failure judged in another process, with its problem for its reproducer, as run_case keeps it:
    ``problem``, else the one its spec builds (bit for bit the one judged). A crash keeps none."""
    if result.verdict == "fail" and not result.crash:
        result.problem = problem if problem is not None else kind_named(kind).build(result.spec, device)
    return result


def _send(conn: Connection, message: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None) -> None:
    conn.send_bytes(json.dumps({**message, "tensors": bool(tensors)}).encode())  # NaN/inf stats: JSON's extension
    if tensors:
        conn.send_bytes(st_save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}))


def _as_it_is(backend: Backend) -> Backend:
    return backend


def _serve(conn: Connection, load: Callable[[], Backend], device: str, threads: int, grace: float,
           stage: Any, warm: bool, problem: Any) -> None:
    """The worker: load the backend, start CUDA on ``device`` (``warm``: and load the backend's compiled
    modules), then judge each case sent (on ``problem`` if given) until the parent closes the pipe, or until a
    CUDA error leaves this process's device unusable. ``threads`` and ``grace`` are the parent's now (the
    environment is the fork server's, from when it started)."""
    if _inherited_cuda():  # before anything else: nothing here may use CUDA
        _send(conn, {"inherited_cuda": True})
        return
    fresh_copy()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it then ends this worker
    watchdog.set_stuck_exit(EXIT_STUCK, "its worker process (the run goes on)")
    os.environ[watchdog.GRACE_ENV] = repr(grace)
    torch.set_num_threads(threads)  # CPU sums round by the thread count
    try:
        backend = load()
    except Exception as exc:  # noqa: BLE001 - the parent's one line: a UsageError there
        _send(conn, {"error": f"could not load it: {exc if isinstance(exc, MLAVerifyError) else exception_line(exc)}"})
        return
    if torch.device(device).type == "cuda":
        try:  # its context now, so that a device this process cannot use is a line, not the first case's error
            torch.zeros(1, device=device)
        except Exception as exc:  # noqa: BLE001 - as above
            _send(conn, {"error": f"could not start CUDA on {device}: {exception_line(exc)}"})
            return
    warmed = warm_up([backend], torch.device(device), build=False) if warm else None
    _send(conn, {"ready": True, "warmup": None if warmed is None else dataclasses.asdict(warmed)})

    def entered(name: str) -> None:
        stage.value = STAGES.index(name)

    while True:
        try:
            request = json.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            header, tensors = _judge(backend, request, device, entered, problem)
        except (ProblemError, FixtureError) as exc:  # a malformed case (a damaged reproducer): the user's one line
            _send(conn, {"malformed": [type(exc).__name__, str(exc)]})
            continue
        except Exception as exc:  # noqa: BLE001 - sent to the parent, which raises it as its own
            _send(conn, {"internal": exception_line(exc)})
            return
        if not header["context_lost"]:  # before the verdict: once it is in, another worker may take the memory
            release_cached(torch.device(device), RELEASE_ABOVE)
        _send(conn, header, tensors)
        if header["context_lost"]:
            return


def _judge(backend: Backend, request: dict[str, Any], device: str, on_stage: Callable[[str], None],
           problem: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    spec = kind_named(backend.kind).spec_from_json(request["spec"])
    r = run_case(backend, spec, LayoutSpec(**request["layout"]), device, request["transform"], problem=problem,
                 diagnose=request["diagnose"], kernel_seconds=request["kernel_seconds"], on_stage=on_stage)
    header = result_header(r)
    kept = r.verdict == "fail" or request["keep_output"]
    return header, {k: t for k, t in (("out", r.out), ("lse", r.lse)) if t is not None and kept}
