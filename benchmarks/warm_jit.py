"""Build every JIT module a GPU run will need before it is timed: one small case per (backend, dtype, dims).

FlashInfer compiles each fa2/fa3/swa variant on its first call (about 25 s each): inside a timed run that
compile is counted as judging time, and inside a `--case-timeout` it can read as a hung kernel. The cases run
in parallel processes, one per module, so the compiles overlap. Prints one line per case with its verdict.

    python benchmarks/warm_jit.py --backend fa2 --backend fa3 --backend flashinfer-swa [--device cuda]

Exit code 0 when every case passed; 1 when one failed, raised or was skipped (a skipped case built no module:
that variant is not warm).
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context

from mla_verify.backends import get_backend
from mla_verify.draw.strategies import budget_for, corner_cases
from mla_verify.run.harness import run_case


def _variants(name: str) -> list[tuple[str, str, int, int]]:
    env = get_backend(name).envelope
    return [(name, dtype, rank, rope) for dtype in env.dtypes for rank, rope in env.dims_for(dtype)]


def _warm(name: str, dtype: str, rank: int, rope: int, device: str) -> tuple[str, str]:
    """(verdict, one line) for one small case of ``name`` with this dtype and these dims."""
    backend = get_backend(name)
    first = corner_cases(backend.envelope, budget_for(device))[0]
    spec = replace(first.spec, dtype=dtype, kv_lora_rank=rank, qk_rope_head_dim=rope)
    started = time.perf_counter()
    result = run_case(backend, spec, first.layout, device)
    note = f" ({result.reason})" if result.reason else ""
    return result.verdict, (f"{name} {dtype} ({rank}, {rope}): {result.verdict} in "
                            f"{time.perf_counter() - started:.1f} s{note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", action="append", required=True, help="a backend to warm (repeatable)")
    parser.add_argument("--device", default="cuda")
    ns = parser.parse_args(argv)
    variants = [v for name in ns.backend for v in _variants(name)]
    failed = 0
    # spawn: a forked child would inherit the parent's CUDA state
    with ProcessPoolExecutor(max_workers=len(variants), mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(_warm, *v, ns.device) for v in variants]
        for variant, future in zip(variants, futures):
            try:
                verdict, line = future.result()
            except Exception as exc:  # noqa: BLE001 - report every variant, then the exit code says it
                verdict, line = "fail", f"{' '.join(map(str, variant))}: raised {type(exc).__name__}: {exc}"
            failed += verdict != "pass"
            print(line, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
