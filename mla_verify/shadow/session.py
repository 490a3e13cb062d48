"""Shadow mode: verify the MLA decode calls an inference engine really makes, at the call.

    with mla_verify.shadow.shadow():          # or MLA_VERIFY_SHADOW=1 / pytest --mla-shadow strict
        engine.run_decode_step(...)

While a session is on, FlashInfer's ``trtllm_batch_decode_with_kv_cache_mla`` (wherever a module binds it),
``BatchMLAPagedAttentionWrapper.plan``/``run``, FlashMLA's ``flash_mla_with_kvcache`` (when installed; sparse
calls included) and every kernel named in ``kernels=`` (a Contract-1 callable, ``MODULE:ATTR``
or the object) are wrapped. A sampled call's
arguments are checked against the kernel's contract (shadow/contract.py); the kernel runs; the same call is then
recomputed with the reference from the same tensors and judged by the tolerance model (shadow/judge.py). A
mismatch keeps a reproducer (shadow/fixture.py); each kind of finding (a mismatch, with its diagnosis -- the
same lines replay prints -- or an argument's error or warning) is reported once per call site. In
``strict`` mode (the default) an argument error or a mismatch raises ``ShadowError`` after the call -- before it
when the kernel would read outside its tensors; ``record`` only records. Either way the caller gets exactly
what the kernel returned. A summary of what was seen is written when the session ends.
"""
from __future__ import annotations

import functools
import os
import runpy
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any

import torch

from ..core.errors import MLAVerifyError, UsageError
from ..problems.problem import DecodeProblem
from .contract import ERROR, WARNING, Finding, KernelContract, ModelFacts
from .entries import (
    FlashMLASchedules,
    LiveCall,
    bind_arguments,
    read_contract1,
    read_flashinfer_trtllm,
    read_flashmla,
    read_flashmla_sparse,
    signature_of,
)
from .fixture import DEFAULT_CAP_MIB, keep_reproducer
from .judge import Judgement, Precheck, explain, judge, precheck
from .patch import Installed, install_function, install_method, uninstall
from .problem import describe_live
from .tally import Sampler, SiteTally, Tally
from .wrapper import WrapperPlans

MODES = ("strict", "record")
DEFAULT_FIXTURES = Path("fixtures") / "shadow"
_HERE = os.path.dirname(os.path.abspath(__file__))
_OWN_FILES = {os.path.join(_HERE, name) for name in ("session.py", "patch.py")}

Reader = Callable[["ShadowSession", dict], LiveCall]
Kept = tuple["Path | None", str]  # keep_reproducer's (fixture path or None, what the report says of it)


class ShadowError(MLAVerifyError, AssertionError):
    """A live call broke its kernel's contract or its result disagrees with the reference (strict mode)."""


class _Entry:
    """One wrapped entry point: its label in reports, the original callable and how its calls are read."""

    def __init__(self, label: str, original: Callable[..., Any], read: Reader | None,
                 records_plan: bool = False, owner: type | None = None, home: tuple[Any, str] | None = None):
        self.label, self.original, self.read, self.records_plan = label, original, read, records_plan
        self.owner = owner  # the class of a method
        self.home = home  # (module, name) a kernel was named by
        self.signature = signature_of(original)

    def wrapper(self) -> Callable[..., Any]:
        entry = self

        @functools.wraps(self.original)
        def shadowed(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True  # noqa: F841 - pytest hides the shadow's frames
            session = current_session()
            if session is None or _inside.depth:
                return entry.original(*args, **kwargs)
            return session.intercept(entry, args, kwargs)
        return shadowed


class _Inside(threading.local):
    depth = 0  # > 0 while the shadow or a shadowed kernel runs: a wrapped call made then is not intercepted


_inside = _Inside()


class _Stopwatch:
    """Runs the kernel (wrapped calls it makes itself are part of it) and keeps the time it took."""

    seconds = 0.0

    def run(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        __tracebackhide__ = True  # noqa: F841 - pytest hides the shadow's frames
        started = time.perf_counter()
        _inside.depth += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _inside.depth -= 1
            self.seconds += time.perf_counter() - started


MISMATCH = ("mismatch", "out")  # a report kind beside the findings' (severity, argument)
_SESSIONS: list[ShadowSession] = []
_LOCK = threading.RLock()


def current_session() -> ShadowSession | None:
    return _SESSIONS[-1] if _SESSIONS else None


class ShadowSession:
    """One shadow-mode session; a context manager (``start``/``stop`` for the pytest plugin and the runner).

    Sessions nest: the innermost one running sees the calls. ``every``: check the 1st, (N+1)th, ... call at
    each call site. ``budget_s_per_min``: at most this many seconds of checking per minute (None: no cap).
    ``facts``: what is known of the model, to judge the scales. ``fixtures_dir``/``fixture_cap_mib``: where
    reproducers go and their size cap. ``stream``: reports and the summary (default stderr).
    """

    def __init__(self, mode: str = "strict", *, every: int = 1, budget_s_per_min: float | None = None,
                 kernels: Sequence[str | Callable[..., Any]] = (), facts: ModelFacts = ModelFacts(),
                 fixtures_dir: str | os.PathLike = DEFAULT_FIXTURES, fixture_cap_mib: float = DEFAULT_CAP_MIB,
                 stream: IO[str] | None = None, summary: bool = True, clock: Callable[[], float] = time.monotonic):
        if mode not in MODES:
            raise UsageError(f"shadow mode: {mode!r} is not one of {', '.join(MODES)}")
        if not (isinstance(every, int) and every >= 1):
            raise UsageError(f"shadow mode: every must be an integer >= 1, got {every!r}")
        if budget_s_per_min is not None and not budget_s_per_min > 0:
            raise UsageError(f"shadow mode: the overhead budget must be > 0 seconds per minute, got {budget_s_per_min}")
        self.mode, self.facts = mode, facts
        self.sampler = Sampler(every, budget_s_per_min, clock)
        self.kernels = [_kernel_entry(k) for k in kernels]  # resolved now: a bad name fails before anything runs
        self.fixtures_dir, self.cap_bytes = Path(fixtures_dir), int(fixture_cap_mib * 2**20)
        self.stream, self.print_summary = stream, summary
        self.tally = Tally()
        self.plans = WrapperPlans()
        self.workspaces: set[int] = set()
        self.flashmla_schedules = FlashMLASchedules()
        self.reported: dict[tuple[str, str], set[tuple[str, str]]] = {}  # (entry, site): what was reported
        self.installed: list[Installed] = []

    # ---------------------------------------------------------------- lifetime
    def __enter__(self) -> ShadowSession:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> ShadowSession:
        with _LOCK:
            for entry in [*_library_entries(self.tally.notes), *self.kernels]:
                self._install(entry)
            _SESSIONS.append(self)
        return self

    def stop(self) -> None:
        with _LOCK:
            if self in _SESSIONS:
                _SESSIONS.remove(self)
            for installed in reversed(self.installed):
                uninstall(installed)
            self.installed.clear()
        if self.print_summary:
            self._write("\n".join(self.summary_lines()))

    def _install(self, entry: _Entry) -> None:
        if getattr(entry.original, "__wrapped__", None) is not None and _is_ours(entry.original):
            return  # an outer session already wrapped it
        if entry.owner is not None:
            self.installed.append(install_method(entry.owner, entry.label.rsplit(".", 1)[-1], entry.wrapper()))
            return
        installed = install_function(entry.original, entry.wrapper(), entry.home)
        self.installed.append(installed)
        if installed.bindings == 0:
            self.tally.notes.append(f"{entry.label}: no module binds this object; its calls are not seen")

    def settings(self) -> str:
        return f"{self.mode}, {self.sampler.describe()}"

    def summary_lines(self) -> list[str]:
        return self.tally.summary_lines(self.settings())

    # ---------------------------------------------------------------- one call
    def intercept(self, entry: _Entry, args: tuple, kwargs: dict) -> Any:
        __tracebackhide__ = True  # noqa: F841 - pytest hides the shadow's frames
        site = caller_site()
        with _LOCK:
            tally = self.tally.site(entry.label, site)
            tally.calls += 1
            nth = tally.calls
        if entry.records_plan:  # every plan: the runs it serves are read against it
            result = entry.original(*args, **kwargs)
            self._guarded(tally, lambda: self.plans.record(bind_arguments(entry.signature, args, kwargs) or {}))
            tally.checked += 1
            return result
        skip = "inside CUDA graph capture" if _capturing() else self.sampler.skip_reason(nth)
        if skip:
            tally.not_checked[skip] += 1
            return entry.original(*args, **kwargs)
        started = time.perf_counter()
        kernel = _Stopwatch()
        try:
            read = self._guarded(tally, lambda: self._precheck(entry, args, kwargs))
            if read is None:
                return kernel.run(entry.original, args, kwargs)
            call, pre = read
            return self._checked(entry, site, tally, call, pre, kernel, args, kwargs)
        finally:
            overhead = time.perf_counter() - started - kernel.seconds
            tally.overhead_s += overhead
            self.sampler.charge(overhead)

    def _checked(self, entry: _Entry, site: str, tally: SiteTally, call: LiveCall, pre: Precheck,
                 kernel: _Stopwatch, args: tuple, kwargs: dict) -> Any:
        __tracebackhide__ = True  # noqa: F841 - pytest hides the shadow's frames
        tally.checked += 1
        if pre.blocking and self.mode == "strict":
            self._conclude(entry, site, tally, call, pre, Judgement(), stopped=True)  # raises
        try:
            result = kernel.run(entry.original, args, kwargs)
        except BaseException as exc:  # the kernel's own exception stands; what the shadow found goes with it
            report = self._conclude(entry, site, tally, call, pre, Judgement(), raised=True)
            if report:
                _add_note(exc, report)
            raise
        verdict = self._guarded(tally, lambda: judge(call, pre.problem, result))
        self._conclude(entry, site, tally, call, pre, verdict or Judgement(), counted=verdict is None)
        return result

    def _guarded(self, tally: SiteTally, work: Callable[[], Any]) -> Any:
        """Run the shadow's own work (no call it makes is intercepted); a failure of it is counted, never raised
        into the engine: the engine's results stay the kernel's."""
        _inside.depth += 1
        try:
            with torch.no_grad():
                return work()
        except torch.OutOfMemoryError:
            tally.not_checked["out of device memory for the reference"] += 1
        except Exception as exc:  # noqa: BLE001 - a shadow failure must not change what the engine sees
            tally.not_checked[f"shadow failed: {type(exc).__name__}: {exc}"] += 1
        finally:
            _inside.depth -= 1
        return None

    def _precheck(self, entry: _Entry, args: tuple, kwargs: dict) -> tuple[LiveCall, Precheck] | None:
        values = bind_arguments(entry.signature, args, kwargs)
        if values is None or entry.read is None:
            return None  # arguments that do not bind: the kernel raises its own TypeError
        call = entry.read(self, values)
        return call, precheck(call, self.facts)

    def _conclude(self, entry: _Entry, site: str, tally: SiteTally, call: LiveCall, pre: Precheck,
                  verdict: Judgement, stopped: bool = False, raised: bool = False, counted: bool = False) -> str:
        """Count the call, report it (once per site and kind of finding), keep a reproducer of a first
        mismatch, and in strict mode raise -- unless the kernel itself ``raised``. ``counted``: why its
        numbers were not compared is counted already. Returns the report ('' when all is well)."""
        __tracebackhide__ = True  # noqa: F841 - under pytest the report is the message, not the shadow's frames
        findings = pre.findings + verdict.findings
        errors = [f for f in findings if f.severity == ERROR]
        tally.errors += bool(errors)
        tally.warnings += any(f.severity == WARNING for f in findings)
        tally.compared += verdict.compared
        tally.mismatched += bool(verdict.failures)
        if not verdict.compared and not counted:
            reason = ("stopped before the kernel ran" if stopped else "the kernel raised" if raised else
                      call.unchecked or ("the arguments cannot be read as a decode problem" if pre.problem is None
                                         else "no output to compare"))
            tally.not_checked[reason] += 1
        if not findings and not verdict.failures:
            return ""
        # a site is reported again for each finding (argument, severity) or a mismatch not reported there yet
        seen = self.reported.setdefault((entry.label, site), set())
        kinds = {(f.severity, f.field) for f in findings} | ({MISMATCH} if verdict.failures else set())
        diagnosis, kept = (self._explain_and_keep(entry, site, tally, call, pre, verdict, findings)
                           if MISMATCH in kinds - seen else ([], None))
        report = self._report(entry, site, call, pre, verdict, diagnosis, kept, stopped)
        if kinds - seen:
            seen |= kinds
            self.tally.reports.append(report)
            self._write(report)
        if self.mode == "strict" and not raised and (errors or verdict.failures):
            raise ShadowError(report)
        return report

    def _explain_and_keep(self, entry: _Entry, site: str, tally: SiteTally, call: LiveCall, pre: Precheck,
                          verdict: Judgement, findings: list[Finding]) -> tuple[list[str], Kept | None]:
        problem, out, lse, layout = pre.problem, verdict.out, verdict.lse, pre.layout
        assert problem is not None and out is not None
        base = call.contract.lse_base if call.return_lse else None
        diagnosis = self._guarded(tally, lambda: explain(problem, out, lse, base)) or []
        if not isinstance(problem, DecodeProblem) or layout is None:
            return diagnosis, (None, "reproducer not kept: a live sparse call has no spec to rebuild it from, and "
                                     "sparse tensors are not stored yet")
        record = {"entry": entry.label, "call_site": site, "backend": call.replay, "reason": verdict.failures[0],
                  "failures": verdict.failures, "diagnosis": diagnosis, "findings": [str(f) for f in findings],
                  "stats": None if verdict.stats is None else verdict.stats.to_json(), "mode": self.mode}
        worst = verdict.stats.worst[0] if verdict.stats is not None else 0
        kept = self._guarded(tally, lambda: keep_reproducer(self.fixtures_dir, problem, out, lse, layout, worst,
                                                            record, self.cap_bytes))
        return diagnosis, kept

    def _report(self, entry: _Entry, site: str, call: LiveCall, pre: Precheck, verdict: Judgement,
                diagnosis: list[str], kept: Kept | None, stopped: bool = False) -> str:
        findings = pre.findings + verdict.findings
        if verdict.failures:
            headline = "MISMATCH"
        elif any(f.severity == ERROR for f in findings):
            headline = "ARGUMENT ERROR"
        else:
            headline = "ARGUMENT WARNING"
        lines = [f"mla-verify shadow: {headline} at {site} in {call.contract.name}"]
        if pre.problem is not None:
            lines.append(f"  call: {describe_live(pre.problem)}")
        if stopped:
            lines.append("  the kernel was not called: it would read outside its tensors or misread them")
        lines += [f"  {f.severity}: {f}" for f in findings]
        lines += [f"  kernel vs reference: {failure}" for failure in verdict.failures]
        if verdict.failures:
            lines += [f"  diagnosis: {d}" for d in diagnosis] or \
                     ["  diagnosis: none of the known misreadings explains the output"]
        if kept is not None:
            path, note = kept
            lines.append(f"  {note}")
            if path is not None:
                how = "" if call.replay else " --kernel MODULE:ATTR"
                lines.append(f"  re-run: mla-verify replay {path}{how}")
        return "\n".join(lines)

    def _write(self, text: str) -> None:
        stream = self.stream or sys.stderr
        stream.write(text + "\n")
        stream.flush()


def _is_ours(fn: Callable[..., Any]) -> bool:
    return getattr(fn, "__code__", None) is not None and fn.__code__.co_filename in _OWN_FILES


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(note)


def caller_site() -> str:
    """file:line of the first frame outside shadow mode and the libraries it wraps."""
    libraries = _library_dirs()
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename in _OWN_FILES
                                 or frame.f_code.co_filename.startswith(libraries)):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    path = frame.f_code.co_filename
    try:
        shown = os.path.relpath(path)
        path = path if shown.startswith("..") else shown
    except ValueError:  # another drive
        pass
    return f"{path}:{frame.f_lineno}"


def _library_dirs() -> tuple[str, ...]:
    """The package folders of the wrapped libraries that are imported (a call site is never inside them)."""
    dirs = []
    for name in ("flashinfer", "flash_mla"):
        origin = getattr(sys.modules.get(name), "__file__", None)
        if origin:
            dirs.append(os.path.dirname(os.path.abspath(origin)) + os.sep)
    return tuple(dirs)


# ---------------------------------------------------------------- what is wrapped
def _library_entries(notes: list[str]) -> list[_Entry]:
    """FlashInfer's functional entry point and planned wrapper, and FlashMLA, where they import."""
    entries: list[_Entry] = []
    try:
        import flashinfer.decode
        from flashinfer.mla import BatchMLAPagedAttentionWrapper
    except Exception as exc:  # noqa: BLE001 - a missing or broken FlashInfer is reported, not raised
        notes.append(f"FlashInfer's entry points are not wrapped: import failed ({type(exc).__name__}: {exc})")
    else:
        entries.append(_Entry("flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla",
                              flashinfer.decode.trtllm_batch_decode_with_kv_cache_mla,
                              lambda s, v: read_flashinfer_trtllm(v, s.workspaces)))
        for name, read, records in (("plan", None, True), ("run", lambda s, v: s.plans.read_run(v), False)):
            entries.append(_Entry(f"flashinfer.mla.BatchMLAPagedAttentionWrapper.{name}",
                                  BatchMLAPagedAttentionWrapper.__dict__[name], read, records_plan=records,
                                  owner=BatchMLAPagedAttentionWrapper))
    try:
        import flash_mla
    except ModuleNotFoundError:
        notes.append("FlashMLA is not wrapped: the flash_mla package is not installed")
    except Exception as exc:  # noqa: BLE001
        notes.append(f"FlashMLA is not wrapped: import failed ({type(exc).__name__}: {exc})")
    else:
        entries.append(_Entry("flash_mla.flash_mla_with_kvcache", flash_mla.flash_mla_with_kvcache,
                              lambda s, v: read_flashmla_sparse(v, s.facts) or read_flashmla(v, s.flashmla_schedules)))
    return entries


def _kernel_entry(kernel: str | Callable[..., Any]) -> _Entry:
    """A Contract-1 kernel: its declared envelope (``mla_verify_envelope``), if any, is its contract."""
    from ..backends.user_kernel import ENVELOPE_ATTR, envelope_from_overrides, kernel_backend, resolve_kernel

    home = None
    if isinstance(kernel, str):
        module, attr, obj = resolve_kernel(kernel, "shadow kernel")  # a file is imported under a module of its own
        kernel_backend(obj, kernel, "trtllm")  # its one-line errors: not a callable, a bad envelope
        fn, name = obj, kernel
        if "." not in attr:
            home = (module, attr)
    elif callable(kernel):
        fn, name = kernel, _importable_name(kernel)
    else:
        raise UsageError(f"shadow mode: a kernel is MODULE:ATTR or a callable, got {type(kernel).__name__}")
    declared = getattr(fn, ENVELOPE_ATTR, None)
    envelope = None if declared is None else envelope_from_overrides(declared, owner=f"kernel '{name}'")
    contract = KernelContract(name, cache_dims=(3, 4) if envelope is None else envelope.cache_dims, envelope=envelope,
                              lse_base=2.0 if envelope is None else envelope.lse_base,
                              empty_lse=None if envelope is None else envelope.empty_lse)
    replay = name if name and ":" in name else None
    return _Entry(f"kernel {name}", fn, lambda s, v: read_contract1(v, contract, replay), home=home)


def _importable_name(fn: Callable[..., Any]) -> str:
    """MODULE:ATTR that imports to ``fn`` (what replay needs), else its qualified name."""
    module = getattr(fn, "__module__", None) or type(fn).__module__
    for attr in (getattr(fn, "__qualname__", None), getattr(fn, "__name__", None)):
        if attr and module in sys.modules:
            obj: Any = sys.modules[module]
            for part in attr.split("."):
                obj = getattr(obj, part, None)
            if obj is fn:
                return f"{module}:{attr}"
    return getattr(fn, "__qualname__", None) or repr(fn)


# ---------------------------------------------------------------- configuration from the environment
ENV_MODE = "MLA_VERIFY_SHADOW"
ENV_SETTINGS = {"every": "MLA_VERIFY_SHADOW_EVERY", "budget": "MLA_VERIFY_SHADOW_BUDGET",
                "kernel": "MLA_VERIFY_SHADOW_KERNEL", "fixtures": "MLA_VERIFY_SHADOW_FIXTURES"}
ON = {"1": "strict", "strict": "strict", "record": "record"}
OFF = ("", "0", "off")


def parse_mode(text: str | None, where: str) -> str | None:
    """'1'/'strict' -> strict, 'record', '0'/'off'/'' -> None (off); UsageError otherwise."""
    value = (text or "").strip().lower()
    if value in OFF:
        return None
    if value not in ON:
        raise UsageError(f"{where}: {text!r} is not one of 1, strict, record, 0, off")
    return ON[value]


def session_from_settings(mode: str, every: str | None, budget: str | None, kernels: Iterable[str],
                          fixtures: str | None, where: str, **kwargs: Any) -> ShadowSession:
    """A session from textual settings (environment, command line, ini); UsageError names the bad one."""
    try:
        n = 1 if not every else int(every)
        seconds = None if not budget else float(budget)
    except ValueError:
        raise UsageError(f"{where}: every must be an integer and the budget a number of seconds, got "
                         f"{every!r} / {budget!r}") from None
    return ShadowSession(mode, every=n, budget_s_per_min=seconds, kernels=list(kernels),
                         fixtures_dir=fixtures or DEFAULT_FIXTURES, **kwargs)


def session_from_env(environ: dict[str, str] | None = None, **kwargs: Any) -> ShadowSession | None:
    """The session MLA_VERIFY_SHADOW asks for (None when it is unset or off)."""
    env = os.environ if environ is None else environ
    mode = parse_mode(env.get(ENV_MODE), ENV_MODE)
    if mode is None:
        return None
    kernels = [k.strip() for k in env.get(ENV_SETTINGS["kernel"], "").split(",") if k.strip()]
    return session_from_settings(mode, env.get(ENV_SETTINGS["every"]), env.get(ENV_SETTINGS["budget"]), kernels,
                                 env.get(ENV_SETTINGS["fixtures"]), "MLA_VERIFY_SHADOW_*", **kwargs)


def shadow(mode: str = "strict", **kwargs: Any) -> ShadowSession:
    """A shadow-mode session, to use as ``with shadow(): ...`` (see ShadowSession for the options)."""
    return ShadowSession(mode, **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mla_verify.shadow SCRIPT [ARGS...]``: run a script under the session MLA_VERIFY_SHADOW_* asks
    for (strict when MLA_VERIFY_SHADOW is unset); exit status: the script's, 2 for bad usage."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        sys.stderr.write("usage: python -m mla_verify.shadow SCRIPT [ARGS...] (settings: MLA_VERIFY_SHADOW, "
                         "MLA_VERIFY_SHADOW_EVERY, _BUDGET, _KERNEL, _FIXTURES)\n")
        return 2
    if not os.path.isfile(argv[0]):
        sys.stderr.write(f"mla_verify.shadow: {argv[0]}: no such script\n")
        return 2
    try:
        session = session_from_env({**os.environ, ENV_MODE: os.environ.get(ENV_MODE) or "strict"})
    except UsageError as e:
        sys.stderr.write(f"mla_verify.shadow: {e}\n")
        return 2
    sys.argv = argv
    try:
        if session is None:  # MLA_VERIFY_SHADOW=0: the script as it is
            runpy.run_path(argv[0], run_name="__main__")
        else:
            with session:
                runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    return 0

