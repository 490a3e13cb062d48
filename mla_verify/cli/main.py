"""The ``mla-verify`` command (docs/contracts.md, Contract 2).

Exit codes: 0 every case passed; 1 a discrepancy was found (the shrunk case, its diagnosis and a reproducer
fixture are printed); 2 bad usage, bad configuration or an unreadable fixture -- one line on stderr, no
traceback. Everything a run needs is validated before the first case runs.
"""
from __future__ import annotations

import argparse
import shlex
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..core.cli_args import (
    EXIT_DISCREPANCY,
    EXIT_INTERRUPTED,
    EXIT_OK,
    OneLineParser,
    non_negative_int,
    parse_device,
    positive_int,
    positive_minutes,
    positive_seconds,
    run_command,
)
from ..core.errors import UsageError
from ..run.engine import DEFAULT_KERNEL_SECONDS


# ---------------------------------------------------------------- the parser
def build_parser() -> argparse.ArgumentParser:
    from ..bench.measure import add_bench_arguments, bench_command
    from ..draw.profiles import PROFILES
    from ..records.failure import DEFAULT_FIXTURES_DIR
    from ..records.fixtures import DEFAULT_MAX_REPRODUCER_MIB

    parser = OneLineParser(prog="mla-verify", description="Verify MLA decode kernels against a pure-PyTorch reference.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    check = sub.add_parser("check", help="verify kernels on problems drawn by Hypothesis",
                           description="Verify kernels. Exit 0: all passed; 1: a discrepancy; 2: bad usage.")
    which = check.add_mutually_exclusive_group()
    which.add_argument("--kernel", action="append", metavar="MODULE:ATTR",
                       help="a kernel callable (or a Backend instance) to verify, MODULE:ATTR or "
                            "path/to/file.py:ATTR (repeatable)")
    which.add_argument("--backend", action="append", metavar="NAME",
                       help="a registered backend to verify, dense or sparse (repeatable; list-backends names them)")
    which.add_argument("--fib-solution", metavar="SOLUTION.json",
                       help="a flashinfer-bench solution of an mla_paged decode or dsa_paged sparse attention "
                            "definition, built by flashinfer-bench's builder (needs the fib extra; "
                            "docs/flashinfer-bench.md)")
    where = check.add_mutually_exclusive_group()
    where.add_argument("--fib-definition", metavar="DEFINITION.json",
                       help="the --fib-solution's definition (default: found by its name in the dataset the "
                            "solution's file lies in)")
    where.add_argument("--fib-dataset", metavar="DIR",
                       help="a flashinfer-bench dataset whose definitions/ holds the --fib-solution's definition")
    _convention_argument(check)
    _device_argument(check, "cpu")
    check.add_argument("--profile", choices=tuple(PROFILES), default="premerge",
                       help="premerge: derandomized and bounded (default); fuzz: random, time-bounded; dev: quick")
    check.add_argument("--seed", type=non_negative_int,
                       help="Hypothesis seed (default: premerge and dev their fixed one; fuzz a fresh one each run, "
                            "printed at the start and recorded in the report)")
    check.add_argument("--cases", type=Path, metavar="DIR",
                       help="your own cases, judged first in every profile: *.json files in DIR, each a spec "
                            "or a fixture (a reproducer of an earlier run, tensors saved with save_case; "
                            "docs/cli.md, \"Your own cases\")")
    check.add_argument("--max-examples", type=positive_int, metavar="N", help="drawn cases per backend")
    check.add_argument("--minutes", type=positive_minutes, metavar="M",
                       help="end each backend's run after M minutes of cases (plus at most the case in progress; "
                            "warm-up, in this process or in a case worker, is not counted)")
    check.add_argument("--case-timeout", type=positive_seconds, metavar="S", default=DEFAULT_KERNEL_SECONDS,
                       help="a kernel call that runs longer fails its case as hung (default: %(default)g s)")
    check.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                       help="judge each case in a worker process, so that a kernel that crashes (a signal, a CUDA "
                       "error) fails its case and the search goes on; --no-isolate: in this process, where a crash "
                       "ends the run (default: on cpu the search runs in a copy of this process, and if a kernel "
                       "crashes it, goes on with every case isolated; on with --device cuda)")
    check.add_argument("--report", metavar="PATH",
                       help="write a JSON report to PATH and JUnit XML, Markdown, HTML and SVG plots beside it")
    check.add_argument("--hypothesis-db", metavar="DIR|redis://HOST:PORT/DB",
                       help="example database shared between runs (fuzz profile)")
    check.add_argument("--fixtures-dir", type=Path, default=DEFAULT_FIXTURES_DIR, metavar="DIR",
                       help="where reproducers of failures go (default: %(default)s, under the current directory)")
    check.add_argument("--max-reproducer-mib", type=non_negative_int, default=DEFAULT_MAX_REPRODUCER_MIB,
                       metavar="MIB", help="cap on a reproducer's two files, in MiB: the kernel's output, and a "
                       "problem its spec cannot rebuild, are stored only within it (default: %(default)s)")
    check.set_defaults(func=cmd_check)

    replay = sub.add_parser("replay", help="re-run a reproducer fixture against the reference and its backend")
    replay.add_argument("fixture", metavar="FIXTURE", help="the fixture's .json (or .safetensors, or their stem)")
    which = replay.add_mutually_exclusive_group()
    which.add_argument("--kernel", metavar="MODULE:ATTR",
                       help="run this callable (MODULE:ATTR or path/to/file.py:ATTR) instead of the recorded one")
    which.add_argument("--backend", metavar="NAME", help="run this backend instead of the recorded one")
    _convention_argument(replay)
    _device_argument(replay, None, "default: where the fixture was recorded if available here, else cpu")
    replay.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="run the case in a worker process, so that a crash is a verdict (default: on, on cpu "
                        "in a copy of this process, elsewhere when its spec rebuilds the problem; --no-isolate to "
                        "run it under a debugger)")
    replay.add_argument("--case-timeout", type=positive_seconds, metavar="S", default=DEFAULT_KERNEL_SECONDS,
                        help="a kernel call that runs longer fails the case as hung (default: %(default)g s)")
    replay.set_defaults(func=cmd_replay)

    report = sub.add_parser("report", help="re-render the Markdown/HTML/JUnit/SVG of a JSON report")
    report.add_argument("json", metavar="JSON", help="a report written by check --report")
    report.set_defaults(func=cmd_report)

    doctor = sub.add_parser("doctor", help="GPUs, library versions, and which backends can run here")
    doctor.set_defaults(func=cmd_doctor)

    listing = sub.add_parser("list-backends", help="every backend, its envelope, and whether it can run here")
    _device_argument(listing, None, "default: cuda if available, else cpu")
    listing.set_defaults(func=cmd_list_backends)

    bench = sub.add_parser("bench", help="latency, bandwidth and roofline of every runnable backend")
    add_bench_arguments(bench)
    bench.set_defaults(func=bench_command)
    return parser


def _convention_argument(parser: argparse.ArgumentParser) -> None:
    from ..backends.user_kernel import CONVENTIONS

    parser.add_argument("--convention", choices=CONVENTIONS, metavar="NAME",
                        help="the calling convention of --kernel callables: " + ", ".join(CONVENTIONS) +
                        " (default: read from each one's signature; docs/contracts.md)")


def _device_argument(parser: argparse.ArgumentParser, default: str | None, extra: str = "") -> None:
    parser.add_argument("--device", type=parse_device, default=default, metavar="cpu|cuda|cuda:N",
                        help=f"where kernels run ({extra or 'default: %(default)s'})")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help / --version (0) or a usage error (2), already printed
        return int(e.code or 0)
    ns.command_line = shlex.join(["mla-verify", *(sys.argv[1:] if argv is None else argv)])
    return run_command(ns)


def _version() -> str:
    from ..core.platform import VERSION

    return VERSION


# ---------------------------------------------------------------- check
def cmd_check(ns: argparse.Namespace) -> int:
    from ..draw.hypothesis_db import resolve_database
    from ..draw.profiles import get_profile, run_seed
    from ..judge.selfcheck import reference_selfcheck
    from ..kinds import kind_of
    from ..records.cases import load_cases
    from ..records.failure import failure_lines, in_flight_note, in_flight_path, record_in_flight, save_reproducer
    from ..records.fixtures import check_writable_dir
    from ..records.report import build_report, check_report_path, write_report
    from ..run import stage_times, watchdog
    from ..run.engine import verify
    from ..run.isolate import case_judge, start_fork_server
    from ..run.progress import Progress
    from ..run.supervise import IN_PROCESS, ISOLATED, how_to_run, search
    from ..run.warmup import start_warm_up
    from ..run.workers import cpu_run_settings
    from .fib import check_fib_arguments, fib_solution_backend, hand_back

    # Everything that can be wrong with the command is found here, before the first case.
    device: torch.device = ns.device
    if device.type == "cpu":
        cpu_run_settings()
    profile = get_profile(ns.profile)
    # a random profile without --seed draws from a fresh seed, said here and in the report: --seed repeats it
    seed = ns.seed if ns.seed is not None or profile.deterministic else run_seed(profile, None)
    given = load_cases(ns.cases) if ns.cases is not None else []
    report_path = check_report_path(ns.report) if ns.report else None
    database = resolve_database(ns.hypothesis_db)
    if database is not None and profile.deterministic:
        print(f"note: --hypothesis-db is not used by the {profile.name} profile (it must not depend on what "
              "earlier runs found); the fuzz profile uses it", file=sys.stderr)
    check_writable_dir(ns.fixtures_dir, "--fixtures-dir")
    watchdog.grace_seconds()  # a malformed grace is a usage error now, not a surprise when a kernel hangs
    if ns.convention and not ns.kernel:
        raise UsageError("--convention names the calling convention of --kernel callables: give one with --kernel")
    check_fib_arguments(ns)
    how = how_to_run(ns.isolate, device)
    if how == ISOLATED:  # its imports run while the backends are chosen and their modules declared
        start_fork_server()
    backends: list[tuple[Any, str | None]]
    if ns.fib_solution is not None:
        backends = [(fib_solution_backend(ns, device), None)]
    else:
        backends = _select_backends(ns.kernel, ns.backend, device, ns.convention)
    in_flight = in_flight_path(ns.fixtures_dir)

    started = time.monotonic()
    runnable = [b for b, reason in backends if reason is None]
    # built here once, in the background; loaded here (a supervised search's copy of this process has them
    # too), or in each case worker where cases are isolated (warmup.py). Every backend's worker starts now and
    # warms up while the others do, so that the first backend's cases are judged while later ones still warm up
    warming = start_warm_up(runnable, device, load=how != ISOLATED)
    judges = {b.name: case_judge(b, device, ns.case_timeout, True) for b in runnable} if how == ISOLATED else {}
    for judge in judges.values():
        judge.launch()
    warmup = None

    def tell_warmup(now: bool = False) -> None:
        """The warm-up's line, once: when it is over (``now``: waited for)."""
        nonlocal warmup
        if warmup is None and (now or warming.done()):
            warmup = warming.wait()
            _print_warmup("warm-up", warmup)

    if seed is not None:
        print(f"seed: {seed}" + ("" if ns.seed is not None else f" (fresh for this run; --seed {seed} draws the same "
                                                                 "cases again)"), flush=True)
    if given:
        kinds = Counter(kind_of(c.spec).name for c in given)
        print(f"your cases: {len(given)} from {ns.cases} ({', '.join(f'{n} {k}' for k, n in kinds.items())}), judged "
              "first on each backend of their kind", flush=True)
    try:
        selfcheck = reference_selfcheck(device, seed=seed or 0)
        print(f"reference self-check: {selfcheck.describe()}", flush=True)
        for backend, reason in backends:
            if reason is not None:
                print(f"skipped {backend.name}: {reason}", flush=True)
        options = dict(seed=seed, max_examples=ns.max_examples, minutes=ns.minutes, database=database,
                       kernel_seconds=ns.case_timeout, given_cases=given)
        planned = {b.name: _planned_cases(b, device, profile, ns.max_examples, len(given)) for b in runnable}
        minutes = ns.minutes or profile.minutes
        if how == ISOLATED and len(runnable) > 1 and all(g.problem is None for g in given):
            # each backend's worker is warm or warming: judged side by side, the run ends near its slowest
            # backend's time (a user's case that stores its tensors is judged in this process: one at a time)
            print(f"judging {len(runnable)} backends side by side: {', '.join(b.name for b in runnable)}", flush=True)
            judged = _judged_side_by_side(runnable, device, profile, planned, minutes, judges, options, tell_warmup)
        else:
            judged = {}
            for backend in runnable:
                tell_warmup(now=how != ISOLATED)  # loaded here before the first case
                if how == IN_PROCESS:
                    print(in_flight_note(in_flight), flush=True)
                with Progress(backend.name, minutes, planned[backend.name]) as progress:
                    def starting(case: Any, backend: Any = backend, progress: Any = progress) -> None:
                        if how == IN_PROCESS:  # write-ahead: a crash that takes this process leaves the case behind
                            record_in_flight(ns.fixtures_dir, backend.name, case.spec, case.layout, case.transform,
                                             device, backend.source)
                        progress.start(case)

                    result = search(backend, device, profile, how, on_case=progress.update, on_start=starting,
                                    judge=judges.get(backend.name), **options)
                in_flight.unlink(missing_ok=True)
                _print_backend_result(result)
                judged[backend.name] = result
                if result.interrupted:
                    break
        # in the order given; a backend that cannot run here is recorded as unavailable
        results = [verify(b, device, profile) if reason is not None else judged[b.name] for b, reason in backends
                   if reason is not None or b.name in judged]
        if any(r.interrupted for r in results):
            print(f"interrupted: the report holds the cases judged until then; "
                  f"{len(runnable) - len(judged)} backend(s) not run", flush=True)
    finally:
        for judge in judges.values():  # those of backends not run (an interruption, an error)
            judge.close()
    tell_warmup(now=True)
    assert warmup is not None  # waited for, just above

    fixtures = {}
    sources = {b.name: b.source for b, _ in backends}
    for r in results:
        if r.failure is not None and (r.failure.problem is not None or r.failure.crash):
            saved = save_reproducer(ns.fixtures_dir, r.failure, ns.max_reproducer_mib, sources.get(r.backend),
                                    device)
            if saved is not None:
                fixtures[r.backend] = str(saved)
    by_name = {b.name: b for b, _ in backends}
    for r in results:
        if r.failure is not None:
            print("\n" + "\n".join(failure_lines(r.failure, fixtures.get(r.backend), ns.fixtures_dir, r.given_origin)
                                    + hand_back(by_name.get(r.backend), r.failure, ns.fixtures_dir, device)))
    interrupted = any(r.interrupted for r in results)
    if report_path is not None:
        run = {"command": ns.command_line,
               "device": str(device), "profile": profile.name, "seed": seed,
               **({"seed_fresh": True} if seed is not None and ns.seed is None else {}),
               "cases": None if ns.cases is None else f"{len(given)} from {ns.cases}", "max_examples": ns.max_examples,
               "minutes": ns.minutes, "seconds": round(time.monotonic() - started, 2),
               "interrupted": interrupted,
               **warmup.run_fields(),
               "throughput": {r.backend: stage_times.breakdown(r) for r in results if r.unavailable is None}}
        report = build_report(run, results, fixtures, platform=_platform_line(), selfcheck=selfcheck.describe())
        print(f"report: {', '.join(str(p) for p in write_report(report_path, report))}")
    failed = not selfcheck.ok or any(r.failure is not None for r in results)
    ran = sum(r.unavailable is None for r in results)
    if not ran and not failed:
        print("no backend could run here: only the reference self-check ran")
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_DISCREPANCY if failed else EXIT_OK


def _judged_side_by_side(runnable: list[Any], device: torch.device, profile: Any, planned: dict[str, int | None],
                         minutes: float | None, judges: dict[str, Any], options: dict[str, Any],
                         idle: Callable[[], None]) -> dict[str, Any]:
    """Every backend of ``runnable`` judged at once, each in its isolated worker (run/side_by_side.py), its
    summary printed as it ends; the results of those that ran, by name."""
    from ..draw.strategies import budget_for
    from ..kinds import kind_named
    from ..run.progress import Progress
    from ..run.side_by_side import Ledgered, lanes_for, ledger_for, side_by_side
    from ..run.supervise import ISOLATED, search

    ledger = ledger_for(device)
    budgets = {b.name: budget_for(device) for b in runnable}  # before any case: as the first one's alone

    def searching(backend: Any) -> Callable[[threading.Event], Any]:
        judge = judges[backend.name]
        if ledger is not None:
            judge = Ledgered(judge, kind_named(backend.kind), ledger)

        def run(stop: threading.Event) -> Any:
            with Progress(backend.name, minutes, planned[backend.name], redraw=False) as progress:
                return search(backend, device, profile, ISOLATED, on_case=progress.update, on_start=progress.start,
                              judge=judge, budget=budgets[backend.name], stop=stop, **options)
        return run

    results = side_by_side([searching(b) for b in runnable], lanes_for(device, len(runnable)),
                           _print_backend_result, idle)
    return {b.name: r for b, r in zip(runnable, results, strict=True) if r is not None}


def _print_backend_result(result: Any) -> None:
    """A backend's summary: verdict and counts, its worker's warm-up, what it resolved to, its claims, the
    emulation that judged it, its time."""
    from ..records.report import (
        distinct_cases,
        emulation_line,
        emulations,
        invariance_counts,
        invariance_line,
        resolution_line,
        resolutions,
    )
    from ..run import stage_times

    print(_summary_line(result), flush=True)
    _print_warmup("  warm-up in its worker", result.warmup)
    if resolved := resolutions(c.resolved_backend for c in distinct_cases(result)):
        print(f"  {resolution_line(result.backend, resolved)}", flush=True)
    if claimed := invariance_line(result.backend, invariance_counts(distinct_cases(result)), result.kind):
        print(f"  {claimed}", flush=True)
    if emulated := emulation_line(result.backend, emulations(distinct_cases(result))):
        print(f"  {emulated}", flush=True)
    print(f"  {stage_times.describe(stage_times.breakdown(result))}", flush=True)


def _print_warmup(title: str, warmup: Any) -> None:
    """A warm-up's line and its failures' (none when nothing was declared)."""
    if warmup is not None and (warmup.modules or warmup.failures):
        print(f"{title}: {warmup.describe()}", flush=True)
        for line in warmup.failures:
            print(f"  warm-up failed: {line}", flush=True)


def _planned_cases(backend: Any, device: torch.device, profile: Any, max_examples: int | None,
                   given: int = 0) -> int | None:
    """How many cases a bounded profile runs at most (the user's, corner cases and drawn ones); None for
    fuzzing."""
    from ..draw.strategies import budget_for
    from ..kinds import kind_named

    if profile.minutes is not None:
        return None
    corners = len(kind_named(backend.kind).corner_cases(backend.envelope, budget_for(device))) \
        if profile.corner_cases else 0
    return given + corners + (max_examples or profile.max_examples)


def _select_backends(kernels: list[str] | None, names: list[str] | None, device: torch.device,
                     convention: str | None = None) -> list[tuple[Any, str | None]]:
    """(backend, why it cannot run here or None). A backend the user named must be able to run."""
    from ..backends import requested_backends

    chosen = [(b, b.unavailable_reason(device)) for b in requested_backends(names, kernels, convention)]
    for b, reason in chosen:
        if reason is not None and (kernels or names):
            raise UsageError(f"{b.name} cannot run on {device}: {reason}")
    return chosen


def _summary_line(result: Any) -> str:
    from ..records.report import count_verdicts, distinct_cases
    from ..run.harness import SKIP_DEVICE, SKIP_ENVELOPE, SKIP_LIBRARY, SKIP_MEMORY

    distinct = distinct_cases(result)
    counts = count_verdicts(c.verdict for c in distinct)
    kinds = Counter(c.skip_kind for c in distinct if c.verdict == "skip")
    skipped = ", ".join(f"{kinds.get(kind, 0)} {what}" for kind, what in (
        (SKIP_ENVELOPE, "outside the envelope"), (SKIP_LIBRARY, "refused by the library for their data"),
        (SKIP_MEMORY, "out of device memory"), (SKIP_DEVICE, "too large for this device")) if kinds.get(kind))
    extra = " (time limit reached)" if result.timed_out else " (interrupted)" if result.interrupted else ""
    return (f"{result.backend}: {result.verdict.upper()} -- {len(distinct)} distinct cases "
            f"({counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped"
            f"{': ' + skipped if skipped else ''}) in {result.seconds:.1f} s{extra}")


def _platform_line() -> str:
    from ..core.platform import platform_info

    return platform_info().describe()


# ---------------------------------------------------------------- replay
def cmd_replay(ns: argparse.Namespace) -> int:
    from ..backends import Backend
    from ..backends.user_kernel import load_kernel
    from ..core.errors import FixtureError
    from ..fib.solution import loaded_backend
    from ..records.cases import fixture_spec
    from ..records.failure import crash_line
    from ..records.fixtures import load_fixture
    from ..run import watchdog
    from ..run.isolate import InProcess, Isolated, forkable
    from ..run.workers import cpu_run_settings

    watchdog.grace_seconds()  # a malformed grace is a usage error now, not when the kernel hangs
    fx = load_fixture(ns.fixture)
    spec = fixture_spec(fx)  # a fixture whose stored tensors say everything needs no spec: one describes them
    recorded = fx.meta.get("backend")
    name = ns.backend or recorded
    backend: Backend
    if ns.convention and not ns.kernel:
        raise UsageError("--convention names the calling convention of --kernel callables: give one with --kernel")
    if ns.kernel:
        backend = load_kernel(ns.kernel, convention=ns.convention)
    elif name:
        # a --kernel run records MODULE:ATTR, and where it was loaded from
        backend = loaded_backend(name, fx.meta.get("kernel_source"))
    else:
        raise FixtureError(f"{fx.json_path}: records no backend; name one with --backend or --kernel")
    device = ns.device or _replay_device(fx.meta.get("source_device"))
    if backend.kind != fx.kind.name:
        raise UsageError(f"{backend.name} judges {backend.kind} decode problems; {fx.json_path} is a "
                         f"{fx.kind.name} one")
    reason = backend.why_not(spec, fx.layout, device)
    if reason is not None:
        raise UsageError(f"{backend.name} cannot replay this case on {device}: {reason}")
    print(f"replaying {fx.json_path} on {device}: {backend.name}")
    if device.type == "cpu":
        # as the recorded run did (`check`: one thread; a shadow call: its process's count); with another
        # thread count CPU sums round differently
        cpu_run_settings(fx.meta.get("torch_threads", 1))
    print(f"  case: {spec.describe()}")
    print(f"  layout: {fx.kind.describe_layout(fx.layout)}")
    transform = fx.meta.get("metamorphic", "none")
    # isolated, a copy of this process judges the problem as it is here; a worker of the fork server rebuilds it
    # from its spec, and a stored problem, which no spec rebuilds, then runs here
    fork = forkable(device)
    isolate = (fork or fx.problem is None) if ns.isolate is None else ns.isolate
    if isolate and not fork and fx.problem is not None:
        raise UsageError(f"{fx.json_path}: stores its problem (its spec does not rebuild it): only a copy of this "
                         "process (on Linux, on the CPU, with one torch thread) can replay it isolated; --no-isolate")
    problem, exact = fx.problem_on(device)
    if fx.problem is None:
        print(f"  problem: {_rebuilt(exact, fx.meta)}")
    judge = Isolated(backend, device, ns.case_timeout, keep_output=True, fork=fork, problem=problem if fork else None) \
        if isolate else InProcess(backend, device, ns.case_timeout, problem)
    try:
        result = judge(spec, fx.layout, transform, True)
    finally:
        judge.close()
    if result.crash or fx.meta.get("crash"):
        print(f"  {crash_line(result.crash, fx.meta.get('crash'))}")
    for f in result.failures:
        print(f"  - {f}")
    for d in result.diagnosis:
        print(f"  diagnosis: {d}")
    _print_bit_comparison(fx, result, backend.name, recorded, device)
    print(f"verdict: {result.verdict.upper()}" + (f" (recorded: {str(fx.meta['verdict']).upper()})"
                                                  if fx.meta.get("verdict") else ""))
    return EXIT_DISCREPANCY if result.verdict == "fail" else EXIT_OK


def _replay_device(recorded: str | None) -> torch.device:
    if recorded:
        try:
            return parse_device(recorded)
        except argparse.ArgumentTypeError:
            pass  # recorded on a device this machine lacks: CPU is where every fixture can be replayed
    return torch.device("cpu")


def _rebuilt(exact: bool | None, meta: dict[str, Any]) -> str:
    """How a problem rebuilt from its spec compares with the recorded one."""
    if exact:
        return "rebuilt from its spec, bit-identical to the recorded one"
    if exact is None and meta.get("problem_tensors") is None:
        return "rebuilt from its spec (a case record keeps no hashes of the problem to check it against)"
    if exact is None:
        return (f"rebuilt from its spec on another device type than the recorded {meta.get('source_device')}: "
                "the same shapes and lengths, other values")
    recorded = (meta.get("versions") or {}).get("torch")
    return (f"rebuilt from its spec, but not bit-identical to the recorded one (recorded with torch {recorded}, "
            f"this is {torch.__version__}): the verdict is on another draw of the same case")


def _print_bit_comparison(fx: Any, result: Any, backend: str, recorded: str | None, device: torch.device) -> None:
    """Whether the kernel reproduced its recorded output (and LSE) bit for bit."""
    from ..records.fixtures import kernel_output_records, tensor_record

    records = kernel_output_records(fx)
    if backend != recorded or "out" not in records or result.out is None:
        return
    pairs = [(records["out"], result.out)]
    if "lse" in records and result.lse is not None:
        pairs.append((records["lse"], result.lse))
    same = all(tensor_record(got) == want for want, got in pairs)
    source = fx.meta.get("source_device", "cpu")
    threads = fx.meta.get("torch_threads")
    if str(source).split(":")[0] != device.type:
        where = f" (recorded on {source}: bit identity is not expected across device types)"
    elif device.type == "cpu" and threads is not None and threads != torch.get_num_threads():
        where = (f" (recorded with {threads} torch threads, replayed with {torch.get_num_threads()}: CPU sums "
                 "round differently; unset OMP_NUM_THREADS to replay with the recorded count)")
    else:
        where = ""
    what = "output and LSE" if len(pairs) == 2 else "output"
    print(f"  kernel {what}: {'bit-identical to' if same else 'differ from'} the recorded run{where}")


# ---------------------------------------------------------------- report, doctor, list-backends, bench
def cmd_report(ns: argparse.Namespace) -> int:
    from ..records.report import load_report, render

    path = Path(ns.json)
    try:
        written = render(load_report(path), path)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:  # a field missing or mistyped
        raise UsageError(f"{path}: malformed report ({type(e).__name__}: {e})") from None
    for p in written:
        print(p)
    return EXIT_OK


def cmd_doctor(ns: argparse.Namespace) -> int:
    from ..backends.flashmla_api import installed_build
    from ..core.platform import platform_info

    info = platform_info()
    print(f"mla-verify {_version()}")
    print(f"python {info.python}; torch {info.torch}; CUDA (torch build) {info.torch_cuda or 'none'}")
    print(f"flashinfer {info.flashinfer_text()}")
    print(f"flashmla {installed_build().describe()}")
    if not info.gpus:
        print("GPUs: none visible")
    for g in info.gpus:
        print(f"GPU cuda:{g.index}: {g.name}, {g.sm}, {g.memory_gib} GiB")
    devices = [torch.device("cpu")] + [torch.device("cuda", g.index) for g in info.gpus[:1]]
    _print_backend_table(devices, with_envelope=False)
    return EXIT_OK


def cmd_list_backends(ns: argparse.Namespace) -> int:
    device = ns.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _print_backend_table([device], with_envelope=True)
    return EXIT_OK


def _print_backend_table(devices: list[torch.device], with_envelope: bool) -> None:
    from ..backends import all_backends
    from ..problems.envelope import DENSE, SPARSE

    every = all_backends()
    groups: list[tuple[str, dict[str, Any], Callable[[Any], str]]] = [
        ("backends", {n: b for n, b in every.items() if b.kind == DENSE}, envelope_summary),
        ("sparse (top-k) backends", {n: b for n, b in every.items() if b.kind == SPARSE}, sparse_envelope_summary)]
    width = max(len(n) for _, backends, _ in groups for n in backends)
    for device in devices:
        for title, backends, summary in groups:
            print(f"{title} on {device}:")
            for name, b in backends.items():
                reason = b.unavailable_reason(device)
                print(f"  {name:<{width}}  {'runs here' if reason is None else 'cannot run: ' + reason}")
                if with_envelope:
                    for line in ([b.description] if b.description else []) + [f"envelope: {summary(b.envelope)}"]:
                        print(f"  {'':<{width}}  {line}")


def envelope_summary(env: Any) -> str:
    """One line: what a backend claims to handle."""
    def span(values: Sequence[int] | None, anything: str) -> str:
        if values is None:
            return anything
        v = sorted(values)
        runs, start = [], v[0]
        for a, b in zip(v, [*v[1:], None]):
            if b != a + 1:
                runs.append(str(start) if start == a else f"{start}-{a}")
                if b is not None:
                    start = b
        return ",".join(runs)

    archs = "any" if env.archs is None else "/".join(f"SM{a}{b}" for a, b in env.archs)
    return (f"devices {'/'.join(env.devices)} (arch {archs}); page {span(env.page_sizes, 'any')}; "
            f"dims {', '.join(f'({r},{p})' for r, p in env.dims)}; heads {span(env.heads, f'1-{env.max_heads}')}; "
            f"{'/'.join(env.dtypes)}; q_len {env.q_len[0]}-{env.q_len[1]}"
            f"{' (also ragged, per request)' if env.ragged_q else ''}; "
            f"{'/'.join(f'{d}D' for d in env.cache_dims)} cache{', strided' if env.page_strided else ''}; "
            f"LSE {'base ' + ('2' if env.lse_base == 2 else 'e') if env.lse else 'no'}"
            + (f"; splits of {'/'.join(map(str, env.split_sizes))} tokens" if env.split_sizes else "")
            + (f"; special lengths {'/'.join(map(str, env.special_lengths))}" if env.special_lengths else ""))


def sparse_envelope_summary(env: Any) -> str:
    """One line: what a sparse backend claims to handle."""
    archs = "any" if env.archs is None else "/".join(f"SM{a}{b}" for a, b in env.archs)
    pages = "any" if env.page_sizes is None else ",".join(map(str, sorted(env.page_sizes)))
    heads = f"up to {env.max_heads}" if env.heads is None else "/".join(map(str, env.heads))
    return (f"devices {'/'.join(env.devices)} (arch {archs}); formats {'/'.join(env.formats)}; "
            f"scales {'/'.join(env.scales)}; topk a multiple of {env.topk_multiple} up to {env.max_topk}; "
            f"heads {heads}; q_len {env.q_len[0]}-{env.q_len[1]}; page {pages}; "
            f"sinks {'yes' if env.sinks else 'no'}; LSE base {'2' if env.lse_base == 2 else 'e'}")

