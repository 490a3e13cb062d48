"""When the host reaches each point of one reference call (a benchmark tool, not a test).

A copy of reference.py that appends ``(label, time.perf_counter())`` to a module-level ``MARKS`` list at the
points it cares about (``results/h200/2026-12-02/reference-timeline/marks.patch`` is one) is called ``--calls``
times on a benchmark case, each call from an idle GPU and followed by a sync; the median time from the call to
each label, and to the end of its GPU work, is printed. No profiler is running, so these are the host's own
times, unlike a trace's.

    python benchmarks/host_marks.py --file reference_marks.py --case 0   # reference.py with marks.patch applied
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_ab import load_module  # noqa: E402
from reference_vs_fa3 import CASES  # noqa: E402

from mla_verify.cli import positive_int  # noqa: E402
from mla_verify.errors import UsageError  # noqa: E402
from mla_verify.generate import build_problem  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", required=True, type=Path, help="a copy of reference.py that fills MARKS")
    parser.add_argument("--case", type=int, action="append", choices=range(len(CASES)),
                        help="index into the issue-2 cases (default: all)")
    parser.add_argument("--calls", type=positive_int, default=40)
    ns = parser.parse_args(argv)
    try:
        module = load_module(ns.file, "--file")
        if not isinstance(getattr(module, "MARKS", None), list):
            raise UsageError(f"--file {ns.file}: has no MARKS list")
        if not torch.cuda.is_available():
            raise UsageError("needs a CUDA GPU")
    except UsageError as exc:
        print(f"host_marks: {exc}", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    for index in ns.case or range(len(CASES)):
        case = CASES[index]
        problem = build_problem(case.spec(0), device)
        times: dict[str, list[float]] = {}
        for call in range(ns.calls + 2):  # two warm-up calls
            module.MARKS.clear()
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            module.reference_decode(problem, torch.float32, matmul="bf16-split")
            torch.cuda.synchronize(device)
            end = time.perf_counter()
            if call >= 2:
                for label, at in module.MARKS + [("GPU work done", end)]:
                    times.setdefault(label, []).append((at - start) * 1e6)
        print(f"== {case.key}: median us from the call, {ns.calls} calls")
        for label, values in times.items():
            print(f"{statistics.median(values):9.1f}  {label}")
        del problem
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
