"""Benchmark mode: latency, achieved bandwidth and FLOP rate of every runnable backend over a grid of problems.

Per grid case (grid.py: a dense case, or a sparse one for a sparse backend) the benchmark builds several input
sets -- the same sizes, different values and page permutations -- enough that one round over them moves more
than twice the L2 cache, so no call finds its inputs cached by the previous one. Every backend of the case's
problem kind that can run it is timed over that round (``bench_timing``), its output for the first set is checked
against the reference (whose own cost is recorded beside it), and the bytes and FLOPs the case must move give
GB/s, TFLOP/s and the fraction of the device copy bandwidth measured in the same run: one loop and one row schema
for every kind (``kind`` "dense" or "sparse"). ``compare_results`` matches two runs case by case (backend + case
key): the pre-merge gate (``--compare``) and the run-to-run agreement check are the same code.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import functools
import json
import math
import platform as pyplatform
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, cast

import torch

from ..backends import Backend, requested_backends
from ..core.cli_args import (
    OneLineParser,
    non_negative_int,
    one_line,
    parse_device,
    positive_int,
    positive_number,
    run_command,
)
from ..core.errors import MLAVerifyError, UsageError
from ..problems.envelope import DENSE, SPARSE
from ..problems.generate import DTYPES
from ..records.fixtures import check_writable_dir, library_versions
from .grid import (
    CASE_COLUMNS,
    FORMULAS,
    GRIDS,
    SPARSE_AXES,
    SPARSE_GRIDS,
    Case,
    SparseBenchCase,
    check_sparse_axes,
    make_grid,
)
from .timing import CudaTimer, Timer, WallClockTimer
from .workload import Workload

SCHEMA = "mla-verify-bench/2"
READABLE_SCHEMAS = ("mla-verify-bench/1", SCHEMA)  # /1: dense rows only, before the kind column
# Default gate: 10% slower. Two runs of the same grid agree within 5% per case (3.4% on an H200,
# docs/verified.md), so 2x that spread keeps false alarms rare while a 10% kernel slowdown is still caught.
DEFAULT_THRESHOLD = 0.10
# Below ~1 us a difference is event resolution (~0.5 us) and launch jitter, not the kernel.
MIN_DELTA_S = 1e-6
ROTATE_FACTOR = 2.0  # one round over the input sets moves >= 2x the L2 cache
MAX_SETS = 32
COPY_MIN_BYTES = 1 << 30  # the copy-bandwidth probe moves at least 1 GiB, and at least 16x L2
# Tells a timed call that computed the decode from one that computed something else (rel L2 error ~1, e.g. a
# stale buffer): kernels that pass the check suite sit near 2e-3 in bf16 and near 1e-2 with an fp8 cache or
# packed fp8 sparse rows (FlashMLA fp8, 1.09e-2 on the H200: docs/backends.md). 2e-2 clears both, 50x below ~1.
SANITY_REL_L2 = 2e-2


def rotation_sets(set_bytes: int, l2_bytes: int) -> int:
    """Input sets per round: together >= ROTATE_FACTOR x L2, at least 2 (1 when there is no L2 to defeat)."""
    if l2_bytes <= 0:
        return 1
    return max(2, min(MAX_SETS, math.ceil(ROTATE_FACTOR * l2_bytes / max(set_bytes, 1))))


# ------------------------------------------------------------------------------------------------ results
@dataclass
class BenchRow:
    """One (backend, case) of a benchmark run: whether and how it was timed, and what it came to."""

    backend: str
    key: str
    case: dict[str, Any]
    status: str  # ok | wrong (timed, but the output failed the sanity check) | skipped | error
    kind: str = "dense"  # dense | sparse: the problem kind of its case (grid.py)
    reason: str = ""
    case_id: str = ""  # the case_id of input set 0's ProblemSpec (sparse: SparseSpec)
    method: str = ""
    note: str = ""
    sets: int = 0
    median_ms: float | None = None
    spread: float | None = None  # (max - min) / median over the samples
    samples_ms: list[float] = field(default_factory=list)
    bytes: int = 0
    flops: int = 0
    gbps: float | None = None
    tflops: float | None = None
    copy_fraction: float | None = None
    reference_ms: float | None = None
    rel_l2: float | None = None


@dataclass
class BenchResult:
    meta: dict[str, Any]
    cases: list[BenchRow]

    def timed(self) -> list[BenchRow]:
        return [c for c in self.cases if c.median_ms is not None]

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "meta": self.meta, "cases": [asdict(c) for c in self.cases]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> BenchResult:
        if d.get("schema") not in READABLE_SCHEMAS:
            raise UsageError(f"not a benchmark result (schema {d.get('schema')!r}, expected {SCHEMA!r})")
        return cls(d["meta"], [BenchRow(**c) for c in d["cases"]])

    @classmethod
    def load(cls, path: str | Path) -> BenchResult:
        try:
            return cls.from_json(json.loads(Path(path).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"{path}: unreadable benchmark result ({type(e).__name__}: {e})") from None

    def save(self, out_dir: Path) -> list[Path]:
        """bench.json, bench.csv and the GB/s plot (bench_gbps.svg) under ``out_dir``."""
        from .plot import write_svg

        out_dir.mkdir(parents=True, exist_ok=True)
        paths = [out_dir / "bench.json", out_dir / "bench.csv", out_dir / "bench_gbps.svg"]
        paths[0].write_text(json.dumps(self.to_json(), indent=1) + "\n")
        columns = [f.name for f in fields(BenchRow) if f.name not in ("case", "samples_ms")]
        with paths[1].open("w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(CASE_COLUMNS + columns)
            for c in self.cases:
                w.writerow([c.case.get(k, "") for k in CASE_COLUMNS] + [getattr(c, k) for k in columns])
        write_svg(self, paths[2])
        return paths

    def table(self) -> str:
        bw = max([10, *(len(c.backend) for c in self.timed())])
        kw = max([30, *(len(c.key) for c in self.timed())])
        head = f"{'backend':<{bw}} {'case':<{kw}} {'method':<14} {'ms':>9} {'GB/s':>7} {'copy%':>6} " \
               f"{'TFLOP/s':>8} {'ref ms':>8} {'rel err':>8}"
        lines = [head, "-" * len(head)]
        for c in self.timed():
            lines.append(f"{c.backend:<{bw}} {c.key:<{kw}} {c.method:<14} {c.median_ms:>9.4f} {c.gbps:>7.0f} "
                         f"{_pct(c.copy_fraction):>6} {c.tflops:>8.2f} {_num(c.reference_ms, '.1f'):>8} "
                         f"{_num(c.rel_l2, '.1e'):>8}" + ("  WRONG" if c.status == "wrong" else ""))
        untimed = Counter((c.backend, c.status, c.reason) for c in self.cases if c.median_ms is None)
        lines += [f"{b}: {n} case(s) {status}: {why}" for (b, status, why), n in untimed.items()]
        copy = self.meta.get("copy_gbps")
        lines.append(f"device copy bandwidth (read + write): {_num(copy, '.0f')} GB/s "
                     f"on {self.meta.get('device_name')}")
        return "\n".join(lines)


def _num(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


# ---------------------------------------------------------------------------------------------------- run
Resolver = Callable[[list[str] | None, list[str] | None], list[Backend]]  # (--backend names, --kernel targets)
requested: Resolver = requested_backends  # the backends ``--backend``/``--kernel`` name, every kind


def default_timer(device: torch.device, samples: int | None = None) -> Timer:
    if device.type == "cuda":
        return CudaTimer(device, **({"samples": samples} if samples else {}))
    return WallClockTimer(samples=samples) if samples else WallClockTimer()


def run_bench(backends: Sequence[Backend], grid: Sequence[Case], device: torch.device | str, *,
              timer: Timer | None = None, seed: int = 0, reference: bool = True, use_graphs: bool = True,
              log: Callable[[str], None] = lambda s: None,
              checkpoint: Callable[[BenchResult], object] | None = None) -> BenchResult:
    """Time every backend on every grid case of its problem kind it can run (grid.py: dense backends on
    ``BenchCase``s, sparse ones on ``SparseBenchCase``s); ``timer`` defaults to CUDA graphs/events on a GPU.

    ``checkpoint`` gets the partial result (``meta["complete"]`` False) after every case, so a run cut short
    by a time limit still leaves the cases it finished.
    """
    device = torch.device(device)
    timer = timer or default_timer(device)
    l2 = timer.l2_bytes()
    copy_bps = timer.copy_bandwidth(max(COPY_MIN_BYTES if device.type == "cuda" else 64 << 20, 16 * l2))
    log(f"device copy bandwidth: {_num(copy_bps and copy_bps / 1e9, '.0f')} GB/s; L2 {l2 / 2**20:.0f} MiB")
    result = BenchResult(_meta(device, grid, [b.name for b in backends], timer, seed, l2, copy_bps, reference), [])
    result.meta["complete"] = False
    for case in grid:
        work = case.workload([b for b in backends if b.kind == case.kind], device, seed)
        result.cases += _time_case(work, device, timer, reference, use_graphs, l2, copy_bps, log)
        if checkpoint is not None:
            checkpoint(result)
    result.meta["complete"] = True
    return result


def _time_case(work: Workload, device: torch.device, timer: Timer, reference: bool, use_graphs: bool, l2: int,
               copy_bps: float | None, log: Callable[[str], None]) -> list[BenchRow]:
    base: dict[str, Any] = dict(kind=work.kind, case=work.case, case_id=work.case_id, bytes=work.bytes,
                                flops=work.flops)
    rows = [BenchRow(name, work.key, status="skipped", reason=reason, **base) for name, reason in work.skipped]
    if not work.runnable:
        return rows
    n_sets = rotation_sets(work.bytes, l2)
    problems = [work.build(i) for i in range(n_sets)]
    ref, ref_s = timer.once(functools.partial(work.reference, problems[0])) if reference else (None, None)
    for name, prepare in work.runnable:
        row = BenchRow(name, work.key, status="ok", sets=n_sets, **base,
                       reference_ms=None if ref_s is None else ref_s * 1e3)
        try:
            calls = [prepare(p) for p in problems]
            armed = timer.arm(calls, use_graphs)
            timing = timer.measure(armed)
            out = calls[0].judged(armed.results[0])[0]
        except Exception as e:  # one backend failing on one case must not hide the others' numbers
            row.status, row.reason = "error", f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
            rows.append(row)
            log(f"{name} {work.key}: {row.reason}")
            continue
        seconds = timing.median_s
        row.method, row.note, row.spread = timing.method, timing.note, timing.spread
        row.median_ms, row.samples_ms = seconds * 1e3, [s * 1e3 for s in timing.samples_s]
        row.gbps, row.tflops = row.bytes / seconds / 1e9, row.flops / seconds / 1e12
        row.copy_fraction = row.bytes / seconds / copy_bps if copy_bps else None
        if ref is not None:
            r = ref.to(out.device)
            row.rel_l2 = float((out.float() - r).norm() / r.norm().clamp_min(1e-30))
            if not row.rel_l2 <= SANITY_REL_L2:  # NaN fails too
                row.status = "wrong"
                row.reason = f"output of the timed call is off: rel L2 error {row.rel_l2:.3g} > {SANITY_REL_L2}"
        rows.append(row)
        log(f"{name:<10} {work.key:<30} {row.median_ms:.4f} ms {row.gbps:.0f} GB/s ({timing.method}, {n_sets} sets)")
        del calls, armed
    del problems, ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _meta(device: torch.device, grid: Sequence[Case], backends: list[str], timer: Timer, seed: int, l2: int,
          copy_bps: float | None, reference: bool) -> dict[str, Any]:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else (pyplatform.processor() or "cpu")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": str(device), "device_name": name, **library_versions(), "backends": backends,
        "seed": seed, "l2_bytes": l2,
        "copy_gbps": None if copy_bps is None else copy_bps / 1e9,
        "timer": {"class": type(timer).__name__, "samples": getattr(timer, "samples", None),
                  "min_block_s": getattr(timer, "min_block_s", None), "rotate_factor": ROTATE_FACTOR},
        "reference": ("the harness's reference (judge_reference: fast mode on GPUs, float64 on CPUs; sparse rows: "
                      "sparse_reference, float32 on GPUs, float64 on CPUs), one wall-clock run per case")
        if reference else "skipped",
        "formulas": FORMULAS,
        "grid": [{"kind": c.kind, **asdict(c)} for c in grid],
    }


# ------------------------------------------------------------------------------------------------ compare
@dataclass(frozen=True)
class Delta:
    backend: str
    key: str
    baseline_ms: float
    current_ms: float

    @property
    def rel(self) -> float:
        """(current - baseline) / baseline: > 0 is slower."""
        return (self.current_ms - self.baseline_ms) / self.baseline_ms

    def line(self) -> str:
        return f"{self.backend} {self.key}: {self.baseline_ms:.4f} ms -> {self.current_ms:.4f} ms ({self.rel:+.1%})"


@dataclass
class Comparison:
    deltas: list[Delta]
    threshold: float
    only_baseline: list[str]  # "backend key" timed in the baseline but not in the current run
    only_current: list[str]

    @property
    def regressions(self) -> list[Delta]:
        return [d for d in self.deltas
                if d.rel > self.threshold and (d.current_ms - d.baseline_ms) * 1e-3 > MIN_DELTA_S]

    @property
    def max_abs_rel(self) -> Delta | None:
        return max(self.deltas, key=lambda d: abs(d.rel), default=None)

    def report(self) -> str:
        lines = [f"compared {len(self.deltas)} case(s) against the baseline; threshold +{self.threshold:.1%}"]
        worst = self.max_abs_rel
        if worst is not None:
            lines.append(f"max |difference| {abs(worst.rel):.2%} ({worst.line()}); "
                         f"median |difference| {statistics.median(abs(d.rel) for d in self.deltas):.2%}")
        lines += [f"not in this run: {k}" for k in self.only_baseline]
        lines += [f"not in the baseline: {k}" for k in self.only_current]
        regressions = self.regressions
        lines += [f"REGRESSION {d.line()}" for d in regressions]
        lines.append(f"{len(regressions)} regression(s) past +{self.threshold:.1%}" if regressions
                     else "no regression")
        return "\n".join(lines)


def compare_results(current: BenchResult, baseline: BenchResult, threshold: float = DEFAULT_THRESHOLD) -> Comparison:
    """Match timed cases by (backend, case key) and compare median latencies."""
    cur = {(c.backend, c.key): c for c in current.timed()}
    base = {(c.backend, c.key): c for c in baseline.timed()}
    if current.meta.get("seed") != baseline.meta.get("seed"):
        raise UsageError(f"the runs used different seeds ({baseline.meta.get('seed')} vs "
                         f"{current.meta.get('seed')}): their ragged lengths differ, so cases do not match")
    deltas = [Delta(k[0], k[1], cast(float, base[k].median_ms), cast(float, cur[k].median_ms))  # timed: not None
              for k in base if k in cur]
    if not deltas:
        raise UsageError("no timed case in common with the baseline (same backends, grid and seed?)")
    return Comparison(deltas, threshold, [" ".join(k) for k in base if k not in cur],
                      [" ".join(k) for k in cur if k not in base])


# -------------------------------------------------------------------------------------------------- CLI
def _ints(text: str) -> tuple[int, ...]:
    """Comma-separated integers >= 1 (every grid axis counts something)."""
    try:
        return tuple(positive_int(x) for x in text.split(","))
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r} ({e})") from None


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``mla-verify bench`` options."""
    parser.add_argument("--backend", action="append", dest="backends", metavar="NAME",
                        help="backend to time, dense or sparse (repeatable); default: every backend that can run "
                             "here")
    parser.add_argument("--kernel", action="append", dest="kernels", metavar="MODULE:ATTR",
                        help="time a kernel callable, or a Backend instance, instead (repeatable)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu (CPU backends, wall clock)")
    parser.add_argument("--grid", choices=sorted(GRIDS), default="default",
                        help="preset grids, dense and sparse (default: %(default)s)")
    for axis, metavar, which in (("batch", "B,...", "grids'"), ("heads", "H,...", "grids'"),
                                 ("max-seq-len", "S,...", "dense grid's"), ("page-size", "P,...", "grids'"),
                                 ("q-len", "Q,...", "grids'"), ("topk", "K,...", "sparse grid's"),
                                 ("context", "C,...", "sparse grid's")):
        parser.add_argument(f"--{axis}", type=_ints, metavar=metavar, help=f"override the {which} {axis} axis"
                            + (" (cache tokens per request)" if axis == "context" else ""))
    parser.add_argument("--dtype", type=lambda s: tuple(s.split(",")), metavar="D,...",
                        help=f"override the dense grid's dtype axis ({', '.join(DTYPES)})")
    parser.add_argument("--format", dest="fmt", type=lambda s: tuple(s.split(",")), metavar="F,...",
                        help=f"override the sparse grid's cache format axis ({', '.join(SPARSE_AXES['fmt'])})")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the ragged lengths and values")
    parser.add_argument("--samples", type=positive_int, help="timed blocks per case (median reported)")
    parser.add_argument("--no-reference", action="store_true", help="skip timing (and checking against) the reference")
    parser.add_argument("--no-graphs", action="store_true", help="time plain launches, not CUDA-graph replays")
    parser.add_argument("--out", type=Path, metavar="DIR", help="write bench.json, bench.csv, bench_gbps.svg here")
    parser.add_argument("--compare", type=Path, metavar="BASELINE.json",
                        help="exit 1 when a case's median latency is slower than the baseline's past --threshold")
    parser.add_argument("--threshold", type=lambda t: positive_number(t, "relative slowdown"),
                        default=DEFAULT_THRESHOLD,
                        help="relative slowdown that counts as a regression (default: %(default)s)")
    parser.add_argument("--result", type=Path, metavar="RESULT.json",
                        help="do not run: use this earlier result (to --compare two runs, or re-plot with --out)")


def bench_command(ns: argparse.Namespace, resolve: Resolver | None = None, timer: Timer | None = None) -> int:
    """Run ``mla-verify bench``; 0 ok, 1 regression against --compare, 2 usage / no GPU (one line on stderr)."""
    try:
        if ns.out is not None:  # fail before timing anything, not after
            ns.out.mkdir(parents=True, exist_ok=True)
            check_writable_dir(ns.out, "--out")
        baseline = BenchResult.load(ns.compare) if ns.compare else None
        result = BenchResult.load(ns.result) if ns.result else \
            _run_from_options(ns, resolve or requested, timer)
        if ns.out is not None:
            for path in result.save(ns.out):
                print(f"wrote {path}")
        if baseline is None:
            return 0
        comparison = compare_results(result, baseline, ns.threshold)
    except (MLAVerifyError, OSError) as e:
        print(f"mla-verify bench: error: {one_line(e)}", file=sys.stderr)
        return 2
    report = comparison.report()
    print(report)
    if ns.out is not None:
        (ns.out / "compare.txt").write_text(report + "\n")
    return 1 if comparison.regressions else 0


def _axes(ns: argparse.Namespace, preset: Mapping[str, Sequence[Any]]) -> dict[str, Sequence[Any]]:
    """``preset`` with the axes the command line overrides (an option's dest is its axis's name)."""
    return {axis: getattr(ns, axis, None) or values for axis, values in preset.items()}


def _run_from_options(ns: argparse.Namespace, resolve: Resolver, timer: Timer | None) -> BenchResult:
    device = _device(ns.device)
    axes, sparse_axes = _axes(ns, GRIDS[ns.grid]), _axes(ns, SPARSE_GRIDS[ns.grid])
    unknown = [d for d in axes["dtype"] if d not in DTYPES]
    if unknown:
        raise UsageError(f"--dtype: unknown {unknown} (known: {', '.join(DTYPES)})")
    check_sparse_axes(sparse_axes)
    backends: list[Backend] = []
    named = bool(ns.backends or ns.kernels)
    for b in resolve(ns.backends, ns.kernels):
        reason = b.unavailable_reason(device)
        if reason and named:
            raise UsageError(f"backend {b.name} cannot run on {device}: {reason}")
        if reason:
            print(f"skipping {b.name}: {reason}", file=sys.stderr)
        else:
            backends.append(b)
    if not backends:
        raise UsageError(f"no backend can run on {device}")
    grid = make_grid(axes) if any(b.kind == DENSE for b in backends) else []
    if any(b.kind == SPARSE for b in backends):
        grid += make_grid(sparse_axes, SparseBenchCase)
    result = run_bench(backends, grid, device, timer=timer or default_timer(device, ns.samples),
                       seed=ns.seed, reference=not ns.no_reference, use_graphs=not ns.no_graphs,
                       log=lambda line: print(line, file=sys.stderr, flush=True),  # progress: stderr
                       checkpoint=None if ns.out is None else lambda partial: partial.save(ns.out))
    result.meta["options"] = {k: v if isinstance(v, (int, float, str, bool, list, tuple, type(None))) else str(v)
                              for k, v in vars(ns).items() if not callable(v)}
    print(result.table())
    if device.type == "cpu":
        print("note: CPU timings are host wall-clock times of eager calls, not GPU kernel times")
    for c in result.cases:
        if c.status == "wrong":
            print(f"warning: {c.backend} {c.key}: {c.reason}", file=sys.stderr)
    return result


def _device(text: str) -> torch.device:
    """``cli_args.parse_device``, its one-line complaint raised as a UsageError (bench reports those itself)."""
    try:
        return parse_device(text)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"--device {e}") from None


def bench_main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="mla-verify bench", description=__doc__.split("\n\n")[0])
    add_bench_arguments(parser)
    return run_command(parser.parse_args(argv, argparse.Namespace(command="bench", func=bench_command)))

