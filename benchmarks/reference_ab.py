"""A/B timing of reference versions on the issue-2 cases, interleaved in one process (a benchmark, not a test).

The lent GPU's host is noisy (results/h200/2026-12-01/reference-v2: the same code measured 9.1x and 10.3x fa3 in
two runs), so versions are compared round-robin on the same problems, each sample a fresh call, and the medians
reported side by side with fa3's. A version is this tree's ``mla_verify.reference``, optionally another file of
the same module (``--old PATH``, e.g. ``git show REV:mla_verify/reference.py``), each with module constants
overridden (``--variant NAME:CONST=VALUE,...``; ``old.NAME:...`` for the ``--old`` file), and any further
file as ``--file NAME=PATH`` (its variants ``NAME.VARIANT:...``). Each sample is host
wall time from the call to the end of its GPU work (the reference reads the lengths on the host, so CUDA graphs
do not apply); the time until the call returns (``issue ms``) says how much of it the host spent queuing.
``--timeline`` adds, per case and version, where the GPU sat idle in one traced call (``cuda_timeline.py``).

    python benchmarks/reference_ab.py --old old_reference.py --variant ratio08:GROUP_LENGTH_RATIO=0.8 --out DIR
    python benchmarks/reference_ab.py --old old_reference.py --file gather=candidate.py --out DIR
"""
from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_timeline import describe, timeline, trace_events  # noqa: E402
from reference_vs_fa3 import CASES, profile_call, time_fa3  # noqa: E402

from mla_verify import reference  # noqa: E402
from mla_verify.bench_timing import CudaTimer  # noqa: E402
from mla_verify.cli import positive_int  # noqa: E402
from mla_verify.errors import UsageError  # noqa: E402
from mla_verify.generate import build_problem  # noqa: E402
from mla_verify.problem import DecodeProblem  # noqa: E402


def load_module(path: Path, option: str) -> ModuleType:
    """Another version of reference.py, imported under its own name (relative imports made absolute); errors
    name the ``option`` that gave the path."""
    try:
        source = path.read_text().replace("from .", "from mla_verify.")
    except OSError as exc:
        raise UsageError(f"{option} {path}: {exc.strerror or exc}") from None
    module = ModuleType(f"reference_{path.stem}")
    module.__file__ = str(path)
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)  # noqa: S102 - a file the caller named
    except (SyntaxError, ImportError) as exc:
        raise UsageError(f"{option} {path}: not a version of reference.py ({type(exc).__name__}: {exc})") from None
    if not callable(getattr(module, "reference_decode", None)):
        raise UsageError(f"{option} {path}: defines no reference_decode")
    return module


def parse_variant(text: str, files: dict[str, ModuleType]) -> tuple[str, ModuleType, dict[str, Any]]:
    """[FILE.]NAME:CONST=VALUE,... -> (name, module, overrides), the module this tree's reference or the named
    file's; a value must keep its constant's type (an int where a float stands is taken as that float)."""
    name, _, settings = text.partition(":")
    prefix, dot, _ = name.partition(".")
    if dot and prefix not in files:
        raise UsageError(f"variant {name} names {prefix}. but no such file was given (files: {sorted(files)})")
    base = files[prefix] if dot else reference
    overrides = {}
    for item in filter(None, settings.split(",")):
        key, _, value = item.partition("=")
        if not hasattr(base, key):
            raise UsageError(f"{base.__name__} has no constant {key}")
        current = getattr(base, key)
        try:
            parsed = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise UsageError(f"{key}={value} is not a Python literal") from None
        if isinstance(current, float) and type(parsed) is int:
            parsed = float(parsed)
        if type(parsed) is not type(current):
            raise UsageError(f"{key} is a {type(current).__name__}, got {value}")
        overrides[key] = parsed
    return name, base, overrides


def call(module: ModuleType, overrides: dict[str, Any], problem: DecodeProblem) -> Callable[[], Any]:
    def run() -> Any:
        saved = {k: getattr(module, k) for k in overrides}
        for k, v in overrides.items():
            setattr(module, k, v)
        try:
            return module.reference_decode(problem, torch.float32, matmul="bf16-split")
        finally:
            for k, v in saved.items():
                setattr(module, k, v)
    return run


def sample(fn: Callable[[], Any], device: torch.device) -> tuple[float, float]:
    """(wall ms to the end of the GPU work, ms until the call returned)."""
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    issued = time.perf_counter()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3, (issued - start) * 1e3


def versions(ns: argparse.Namespace) -> list[tuple[str, ModuleType, dict[str, Any]]]:
    """(name, module, overrides) for ``new``, ``old`` when given, each --file and each --variant; names unique,
    and every --profile name one of them."""
    files = {"old": load_module(ns.old, "--old")} if ns.old else {}
    for text in ns.file:
        name, equals, path = text.partition("=")
        if not equals or not path or not name.isidentifier() or name in files or name in ("new", "old"):
            raise UsageError(f"--file {text}: want NAME=PATH, NAME a new identifier other than new and old")
        files[name] = load_module(Path(path), "--file")
    variants = [("new", reference, {})] + [(name, module, {}) for name, module in files.items()]
    for text in ns.variant:
        variants.append(parse_variant(text, files))
    names = [name for name, _, _ in variants]
    if len(set(names)) != len(names):
        raise UsageError(f"variant names must differ: {names}")
    unknown = sorted(set(ns.profile) - set(names))
    if unknown:
        raise UsageError(f"--profile names no variant: {unknown} (variants: {names})")
    return variants


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--old", type=Path, help="another version of mla_verify/reference.py, as 'old'")
    parser.add_argument("--file", action="append", default=[],
                        help="NAME=PATH: a further version of mla_verify/reference.py, as NAME")
    parser.add_argument("--variant", action="append", default=[],
                        help="NAME:CONST=VALUE,... of this tree's reference (or FILE.NAME:... of --old / --file)")
    parser.add_argument("--samples", type=positive_int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="append", default=[], help="variant names to profile per case")
    parser.add_argument("--timeline", action="store_true",
                        help="also trace one call of each variant per case: where the GPU waits (timeline.txt)")
    ns = parser.parse_args(argv)
    try:
        variants = versions(ns)
        if not torch.cuda.is_available():
            raise UsageError("needs a CUDA GPU (fa3 and the fast reference run there)")
        ns.out.mkdir(parents=True, exist_ok=True)
        for name in ("profile.txt", "timeline.txt"):
            (ns.out / name).unlink(missing_ok=True)
    except UsageError as exc:
        print(f"reference_ab: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"reference_ab: --out {ns.out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    timer = CudaTimer(device, samples=10)
    rows = []
    for case in CASES:
        spec = case.spec(ns.seed)
        problem = build_problem(spec, device)
        exact = reference.reference_decode(problem, torch.float64)
        row: dict[str, Any] = {"case": case.key, "variants": {}}
        row["fa3"] = time_fa3(problem, spec, timer, exact.out)
        fns = {name: call(module, overrides, problem) for name, module, overrides in variants}
        first = None
        for name, fn in fns.items():  # warm-up, and each version's error against float64
            result = fn()
            first = first or result
            row["variants"][name] = {
                "same_bits_as_first": torch.equal(result.out, first.out) and torch.equal(result.lse, first.lse),
                "rel_l2_vs_fp64": float((result.out.double() - exact.out).norm() / exact.out.norm()),
                "lse_max_abs_vs_fp64": float((result.lse.double() - exact.lse).abs().max()),
                "wall_ms": [], "issue_ms": []}
        del exact, result, first
        for _ in range(ns.samples):
            for name, fn in fns.items():
                wall, issue = sample(fn, device)
                row["variants"][name]["wall_ms"].append(wall)
                row["variants"][name]["issue_ms"].append(issue)
        fa3_ms = row["fa3"].get("median_ms")
        for name, entry in row["variants"].items():
            entry["median_wall_ms"] = statistics.median(entry["wall_ms"])
            entry["median_issue_ms"] = statistics.median(entry["issue_ms"])
            entry["ratio_vs_fa3"] = entry["median_wall_ms"] / fa3_ms if fa3_ms else None
            print(f"{case.key:30s} {name:14s} wall {entry['median_wall_ms']:7.3f} ms  issue "
                  f"{entry['median_issue_ms']:7.3f} ms  x fa3 {entry['ratio_vs_fa3'] or float('nan'):5.2f}  "
                  f"rel L2 {entry['rel_l2_vs_fp64']:.2e}  same bits {entry['same_bits_as_first']}", flush=True)
        for name in ns.profile:
            with open(ns.out / "profile.txt", "a") as f:
                f.write(f"== {case.key}: {name}\n{profile_call(fns[name], device, with_cpu=True, rows=22)}\n")
        if ns.timeline:
            with open(ns.out / "timeline.txt", "a") as f:
                for name, fn in fns.items():
                    try:
                        summary = timeline(trace_events(fn, device))
                    except RuntimeError as exc:  # a trace not read must not cost the timings
                        summary = {"error": str(exc)}
                    row["variants"][name]["timeline"] = summary
                    f.write(f"== {case.key}: {name}\n{describe(summary)}\n")
        rows.append(row)
        (ns.out / "reference_ab.json").write_text(json.dumps({"cases": rows}, indent=2) + "\n")  # case by case
        del problem, fns
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
