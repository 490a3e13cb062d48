"""Is `pytest -n N --mla-kernel K` on CPU no slower than one process? (docs/pytest.md, "Threads per worker")

Times ``pytest --mla-kernel K --mla-device cpu`` in an empty directory (only the kernel's own tests run), once
in one process and once with ``-n N``, ``--repeat`` times each, without OMP_NUM_THREADS (the case measured:
the user set no thread count, so each worker takes its share of the cores). ``--source DIR`` runs another
checkout's code (e.g. one from before the share, to see what it fixes). Prints one JSON object.

    python benchmarks/xdist_threads.py [--workers 2] [--repeat 2] [--source .] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

KERNEL = "mla_verify.kernels.mutants:correct_kernel"


def timed_run(source: Path, kernel: str, workers: int | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join([str(source), env.get("PYTHONPATH", "")])  # before the installed copy
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--mla-kernel", kernel,
               "--mla-device", "cpu", *(["-n", str(workers)] if workers else [])]
    with tempfile.TemporaryDirectory() as empty:
        began = time.perf_counter()
        done = subprocess.run(command, cwd=empty, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - began
    tail = done.stdout.strip().splitlines()[-1:] or [done.stderr.strip()[-200:]]
    return {"workers": workers or 1, "seconds": round(seconds, 1), "rc": done.returncode, "last_line": tail[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernel", default=KERNEL)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--source", type=Path, default=Path.cwd(), help="the checkout whose code runs")
    parser.add_argument("--out", type=Path)
    ns = parser.parse_args(argv)
    runs = [timed_run(ns.source.resolve(), ns.kernel, w) for _ in range(ns.repeat) for w in (None, ns.workers)]
    best = {w: min(r["seconds"] for r in runs if r["workers"] == w) for w in (1, ns.workers)}  # type: ignore
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "kernel": ns.kernel,
              "cores": len(os.sched_getaffinity(0)), "load_average": os.getloadavg(), "source": str(ns.source),
              "python": platform.python_version(), "torch": torch.__version__, "runs": runs, "best_s": best,
              "parallel_over_one": round(best[ns.workers] / best[1], 2)}
    text = json.dumps(record, indent=1)
    print(text)
    if ns.out:
        ns.out.write_text(text + "\n")
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
