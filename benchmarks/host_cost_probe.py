"""Host cost of the fast reference's per-group operations, and of ways to issue them (a benchmark, not a test).

results/h200/2026-12-01/reference-ab found the fast reference host-limited on the H200: the call returns only
0.04-0.21 ms before its GPU work ends, while the GPU is busy 55-76% of it. This probe says which of a group's
9 launches (14 before the row index, the mask and the halves' sum moved out of the loop) cost the host most,
and whether an alternative computing the same values costs less:
- the products: ``baddbmm(..., out_dtype=float32)`` as the reference calls it, under each BLAS library PyTorch
  offers (``torch.backends.cuda.preferred_blas_library``), and ``bmm(..., out_dtype=float32)``;
- the lengths' read: the GPU sort and ``tolist`` (the reference's), against reading them unsorted, ordering them
  in Python and uploading the order, from pageable or pinned memory;
- the gather: advanced indexing by a slice of the whole problem's row index (the reference's), ``embedding``
  with that slice, and ``index_select`` on flattened rows, host cost and, on CUDA, GPU throughput at a
  realistic size (a cheaper call must not be a slower copy);
- the rest of a group: the tail's masked_fill_, max(out=), softmax, gather(out=), the hi/lo conversions; and
  two operations now issued once a call, not once a group: where, the halves' sum;
- hidden waits: where one whole reference call makes the host wait for the GPU (PyTorch's sync debug mode;
  the lengths' read should be the only place);
- issuing from threads: the same small operation from 1, 2 and 4 threads, each on its own CUDA stream.
  PyTorch releases the GIL inside an operation, but on the 2-core CPU machine two threads issuing tiny CPU
  operations took 2.3-6.4x as long as one in the four runs recorded (GIL hand-offs;
  results/cpu/host_cost_probe.txt), so this is measured before anything relies on it.

Shapes are small (2 sequences, 16 rows, 64 positions) so the GPU never holds the host back; each line is the
mean host time of ``--calls`` calls after a warm-up, with the GPU idle before each batch. An alternative's
line ends in ``same`` when its result is bit-identical to the reference's operation (for ``bmm``: to
``baddbmm`` with alpha 1, since it leaves the scale to another pass).

    python benchmarks/host_cost_probe.py --device cuda > host_cost.txt
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from mla_verify.bench import BenchCase
from mla_verify.cli import parse_device, positive_int
from mla_verify.generate import build_problem
from mla_verify.reference import reference_decode


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_us(fn: Callable[[], Any], device: torch.device, calls: int) -> float:
    fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    sync(device)
    return elapsed / calls * 1e6


def threads_ms(device: torch.device, threads: int, total: int) -> float:
    """Wall ms for ``total`` small adds split over ``threads`` threads, each on its own stream on CUDA."""
    x = torch.ones(64, device=device)

    def work(n: int) -> None:
        ctx = torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else contextlib.nullcontext()
        with ctx:
            y = x
            for _ in range(n):
                y = torch.add(y, x)
    work(10)
    workers = [threading.Thread(target=work, args=(total // threads,)) for _ in range(threads)]
    sync(device)
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    sync(device)
    return (time.perf_counter() - start) * 1e3


def gather_gbps(device: torch.device, index_select: bool) -> float:
    """GPU throughput of the reference's row gather at a realistic size: 4096 pages of 64 rows of 576 bf16
    (~300 MB read, as B=128, seq <= 4096), each page's rows consecutive, the pages in random order from a pool
    twice that size; median of 10 after a warm-up."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    page = 64
    pool = torch.randn(8192 * page, 576, generator=gen).to(device, torch.bfloat16)
    pages = torch.randperm(8192, generator=gen)[:4096]
    rows = (pages[:, None] * page + torch.arange(page)).view(-1).to(device)
    fn = (lambda: pool.index_select(0, rows)) if index_select else (lambda: pool[rows])
    fn()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize(device)
        times.append(a.elapsed_time(b) / 1e3)
    moved = 2 * rows.numel() * pool.shape[1] * pool.element_size()
    return moved / sorted(times)[len(times) // 2] / 1e9


def warm_fast_reference(device: torch.device) -> Callable[[], Any]:
    """One fast reference call on the B=128, H=128 benchmark problem, as a callable, after two warm-up calls
    and a sync."""
    problem = build_problem(BenchCase(128, 128, 4096, 64).spec(0), device)

    def call() -> Any:
        return reference_decode(problem, torch.float32, matmul="bf16-split")
    for _ in range(2):
        call()
    sync(device)
    return call


def reference_syncs(device: torch.device) -> list[str]:
    """Where one fast reference call on the B=128, H=128 benchmark problem makes the host wait for the GPU
    (PyTorch's sync debug mode): the lengths' read should be the only one. Any other would put GPU time on
    the host's path and make the call's wall time look like host cost."""
    call = warm_fast_reference(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}" for w in caught]


def reference_host_time(device: torch.device, calls: int = 20, top: int = 28) -> str:
    """Where one fast reference call on the B=128, H=128 benchmark problem spends its host time: cProfile over
    ``calls`` calls (each followed by a sync outside the profile), the functions and torch operations with the
    most time of their own, in microseconds per reference call. cProfile adds ~1 us a Python call."""
    call = warm_fast_reference(device)
    profiler = cProfile.Profile()
    for _ in range(calls):
        profiler.enable()
        call()
        profiler.disable()
        sync(device)
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])  # (file, line, name) -> (cc, nc, tt, ct, ..)
    total = sum(entry[2] for _, entry in rows) / calls * 1e6
    lines = [f"host time of one fast reference call (B=128, H=128), cProfile over {calls} calls: {total:.0f} us",
             f"{'own us':>8} {'calls':>6}  function"]
    for (path, line, name), (_, ncalls, own, _cum, _callers) in rows[:top]:
        where = name if path == "~" else f"{Path(path).name}:{line} {name}"
        lines.append(f"{own / calls * 1e6:8.1f} {ncalls / calls:6.1f}  {where}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=parse_device, default="cuda", help="cuda, cuda:N, or cpu for a dry run")
    parser.add_argument("--calls", type=positive_int, default=300)
    ns = parser.parse_args(argv)
    device = ns.device
    gen = torch.Generator(device="cpu").manual_seed(0)
    b, rows, T, D, L, page = 2, 16, 64, 576, 512, 16
    f32 = torch.float32
    q = torch.randn(b, rows, D, generator=gen).to(device, torch.bfloat16)
    pool = torch.randn(64 * page, D, generator=gen).to(device, torch.bfloat16)
    rows_wide = torch.randint(0, pool.shape[0], (b, 2 * T), generator=gen).to(device)  # the whole problem's
    rows_idx = rows_wide[:, :T]  # a group's rows: a strided slice, as the reference takes them
    flat_idx = rows_idx.reshape(-1)  # index_select needs one dimension: a copy of the slice, made here once
    kv = pool[rows_idx]
    scores = torch.empty(b, rows, T, dtype=f32, device=device)
    probs = torch.softmax(torch.randn(b, rows, T, generator=gen).to(device), -1)
    both = torch.empty(b, 2, rows, T, dtype=torch.bfloat16, device=device)
    halves = torch.randn(b, 2, rows, L, generator=gen).to(device)
    out = torch.empty(b, rows, L, dtype=f32, device=device)
    top, top_share = (torch.empty(b, rows, 1, dtype=f32, device=device) for _ in range(2))
    top_at = torch.empty(b, rows, 1, dtype=torch.long, device=device)
    positions = torch.arange(T, device=device)
    lens = torch.tensor([[T], [T - 5]], device=device)
    hidden = positions[T - 8:] >= lens[:, None, None]
    seq_lens = torch.randint(1, 4097, (128,), generator=gen, dtype=torch.int32).to(device)  # B=128's
    pin = device.type == "cuda"

    def read_order(pinned: bool) -> torch.Tensor:  # the lengths read, ordered on the host, the order uploaded
        given = seq_lens.tolist()
        order = sorted(range(len(given)), key=given.__getitem__, reverse=True)
        return torch.tensor(order + [given[i] for i in order], pin_memory=pinned).to(device, non_blocking=pinned)

    def cpu_order(pinned: bool) -> torch.Tensor:  # the same with the lengths copied, and sorted by torch on the host
        ordered, order = torch.sort(seq_lens.cpu(), descending=True, stable=True)
        ordered.tolist()
        staged = torch.cat((order, ordered.long()))
        return (staged.pin_memory() if pinned else staged).to(device, non_blocking=pinned)
    kw = {"out_dtype": f32} if device.type == "cuda" else {}
    split = (lambda: torch.baddbmm(scores, q, kv.mT, beta=0, alpha=0.1, out=scores, **kw)) if kw else \
        (lambda: torch.baddbmm(scores, q.float(), kv.float().mT, beta=0, alpha=0.1, out=scores))
    unscaled = (lambda: torch.baddbmm(scores, q, kv.mT, beta=0, out=scores, **kw)) if kw else \
        (lambda: torch.baddbmm(scores, q.float(), kv.float().mT, beta=0, out=scores))
    # name, operation, and for an alternative the reference's operation whose result it must match bit for bit
    ops: list[tuple[str, Callable[[], Any], Callable[[], Any] | None]] = [
        ("sort + tolist of 128 lengths (reference)",
         lambda: torch.sort(seq_lens, descending=True, stable=True)[0].tolist(), None),
        ("tolist, sorted, pageable upload", lambda: read_order(False), None),
        ("tolist, sorted, pinned upload", lambda: read_order(pin), None),
        ("to cpu, cpu sort, tolist, pinned upload", lambda: cpu_order(pin), None),
        ("baddbmm out_dtype fp32 (reference)", split, None),
        ("bmm out_dtype fp32", (lambda: torch.bmm(q, kv.mT, **kw)) if kw else
                               (lambda: torch.bmm(q.float(), kv.float().mT)), unscaled),
        ("index: pool[rows[:, :T]] (reference)", lambda: pool[rows_idx], None),
        ("embedding(rows[:, :T], pool)", lambda: torch.nn.functional.embedding(rows_idx, pool), lambda: pool[rows_idx]),
        ("index_select: pool.index_select(0, rows)",
         lambda: pool.index_select(0, flat_idx).view(b, T, D), lambda: pool[rows_idx]),
        ("where (rows past the end; once a call)", lambda: torch.where(positions < lens, rows_idx, rows_idx[:, :1]),
         None),
        ("masked_fill_ on the tail view",
         lambda: scores.view(b, 1, rows, T)[..., T - 8:].masked_fill_(hidden, float("-inf")), None),
        ("max(out=)", lambda: torch.max(scores, -1, keepdim=True, out=(top, top_at)), None),
        ("softmax", lambda: torch.softmax(scores, -1), None),
        ("gather(out=)", lambda: torch.gather(probs, -1, top_at, out=top_share), None),
        ("hi.copy_(probs)", lambda: both[:, 0].copy_(probs), None),
        ("sub(probs, hi, out=lo)", lambda: torch.sub(probs, both[:, 0], out=both[:, 1]), None),
        ("add of halves (out=) (once a call)", lambda: torch.add(halves[:, 0], halves[:, 1], out=out), None),
        ("sum of halves (out=)", lambda: torch.sum(halves, 1, out=out), lambda: halves[:, 0] + halves[:, 1]),
        ("slice", lambda: rows_idx[1:2], None),
        ("empty", lambda: torch.empty(b, rows, T, dtype=f32, device=device), None),
    ]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"# {name}; torch {torch.__version__}; "
          f"{ns.calls} calls each, host microseconds per call")
    for label, fn, reference_op in ops:
        tag = "" if reference_op is None else "  same" if torch.equal(fn(), reference_op()) else "  DIFFERENT"
        print(f"{label:45s} {host_us(fn, device, ns.calls):8.1f}{tag}", flush=True)
    if device.type == "cuda":
        blas = torch.backends.cuda.preferred_blas_library()
        for library in ("cublas", "cublaslt"):
            label = f"baddbmm out_dtype fp32 with {library}"
            try:
                torch.backends.cuda.preferred_blas_library(library)
                print(f"{label:45s} {host_us(split, device, ns.calls):8.1f}", flush=True)
            except RuntimeError as exc:
                print(f"{label:45s} failed: {str(exc).splitlines()[0]}")
        torch.backends.cuda.preferred_blas_library(blas)
        print(reference_host_time(device), flush=True)
        syncs = reference_syncs(device)
        print(f"synchronizing operations in one fast reference call (B=128, H=128): {len(syncs)}")
        for line in syncs:
            print(f"  {line}")
        print(f"{'gather GB/s (read + write), index':45s} {gather_gbps(device, False):8.0f}", flush=True)
        print(f"{'gather GB/s (read + write), index_select':45s} {gather_gbps(device, True):8.0f}", flush=True)
    total = 40 * ns.calls
    for n in (1, 2, 4):
        print(f"{f'{total} adds from {n} thread(s), ms':45s} {threads_ms(device, n, total):8.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
