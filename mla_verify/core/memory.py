"""Device memory is the machine's, not the kernel's: what counts as out-of-memory, and how big a case may be.

A GPU is often shared -- by the xdist workers of one ``pytest -n auto`` run, or by another process already
holding memory -- so the size of the cases a run draws starts from this process's share of the memory that is
free when the run starts, and shrinks for the rest of the run after an out-of-memory error. Import rule:
torch and ``errors`` only.
"""
from __future__ import annotations

import math
import os

import torch

from .errors import UsageError

# Peak device bytes per cached token (of 576 values) of one judged case, all stages together: the fp32
# values the problem is built from (2.3 KB), the pool (1.2 KB), its snapshot and a page-strided copy
# (2.3 KB), the metamorphic copy and its snapshot (2.3 KB), and the reference's and baseline's work memory
# (at most twice the cache bytes each, reference.py: 2.3 KB) -- ~10.4 KB, rounded up for the allocator's
# fragmentation.
BYTES_PER_TOKEN = 16 << 10
# Peak device bytes per output row (one query token of one head, 512 values): the comparison's float64 copies
# of the output, reference and baseline and their differences (~10 x 4 KB), the reference's and baseline's
# float32 results and the kernel's bf16 outputs (~8 KB).
BYTES_PER_ROW = 64 << 10
FIXED_BYTES = 512 << 20  # a backend's workspace (128 MiB) and the allocator's own slack
# A case worker gives its allocator's cached blocks back after a case once they hold more than this: another
# worker's case may need them (backends judged side by side, run/side_by_side.py), and re-allocating the blocks
# of a case this large costs far less than judging it. Below it, the next cases reuse them.
RELEASE_ABOVE = 256 << 20
SHARE_OF_FREE = 0.5  # of the free memory at start, divided among the processes sharing the device
SHARERS_ENV = "MLA_VERIFY_DEVICE_SHARERS"  # override: how many processes share this device


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError, or a CUDA / allocator error that says it ran out of memory (cuBLAS's when its
    workspace cannot be allocated, as when other processes hold the device's memory)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(
        words in text for words in ("out of memory", "cudaerrormemoryallocation", "cublas_status_alloc_failed"))


def device_fault(exc: BaseException) -> str | None:
    """The text of a CUDA error that leaves the process's context unusable (an illegal memory access, a
    device-side assert, a launch failure), or None. torch raises AcceleratorError (a RuntimeError) for these
    since 2.8 and a RuntimeError starting "CUDA error" before; out of memory is not one of them."""
    if not isinstance(exc, RuntimeError) or is_out_of_memory(exc):
        return None
    text = str(exc).strip()
    accelerator = getattr(torch, "AcceleratorError", None)
    if (accelerator is not None and isinstance(exc, accelerator)) or text.startswith("CUDA error"):
        return text.splitlines()[0] if text else type(exc).__name__
    return None


def release_cached(device: torch.device, above: int = 0) -> None:
    """Give the allocator's cached blocks back (after an OOM; after a case, once they hold more than ``above``
    bytes), so other processes on the GPU can have them."""
    if device.type == "cuda" and torch.cuda.memory_reserved(device) > above:
        torch.cuda.empty_cache()


def case_bytes(tokens: int, rows: int) -> int:
    """At most the device memory one case of ``tokens`` cached tokens and ``rows`` output rows takes at its peak,
    its backend's workspace aside (FIXED_BYTES: once per worker)."""
    return tokens * BYTES_PER_TOKEN + rows * BYTES_PER_ROW


def device_sharers(environ: dict[str, str] | None = None) -> int:
    """How many processes share this process's GPU: SHARERS_ENV if set, else the xdist workers per GPU."""
    env = os.environ if environ is None else environ
    if SHARERS_ENV in env:
        if not (env[SHARERS_ENV].isdigit() and int(env[SHARERS_ENV]) > 0):
            raise UsageError(f"{SHARERS_ENV}={env[SHARERS_ENV]!r}: expected a number of processes >= 1")
        return int(env[SHARERS_ENV])
    workers = env.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not workers.isdigit() or int(workers) < 1:
        return 1
    gpus = max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1
    return math.ceil(int(workers) / gpus)


def memory_budget(device: torch.device, max_tokens: int, max_rows: int) -> tuple[int, int]:
    """(cached tokens, output rows) one case may hold on ``device``, at most the caps given. On a GPU: half of
    this process's share of the free memory for each, rounded down to a power of two (so that a run with a
    little more or less memory free draws the same cases: premerge stays the same from run to run on a
    similar machine)."""
    if device.type != "cuda":
        return max_tokens, max_rows
    half = (case_share(device) - FIXED_BYTES) / 2
    return _power_of_two(half / BYTES_PER_TOKEN, max_tokens), _power_of_two(half / BYTES_PER_ROW, max_rows)


def case_share(device: torch.device) -> float:
    """The device memory one case may take (a CUDA device): this process's share of the half of the memory free
    now. memory_budget sizes the cases a run draws from it; run/side_by_side.py lets the cases in flight beside
    each other hold no more than it together."""
    free, _ = torch.cuda.mem_get_info(device)
    return SHARE_OF_FREE * free / device_sharers()


def spare_bytes(device: torch.device) -> int:
    """This process's share of the device memory free now: what one case that needs much of a GPU (pages past
    2^32 elements, problems/metamorphic.py) may take; 0 on a CPU, where such a case is not run (a CPU run that
    wrote and compared gigabytes would take minutes; a GPU does it in milliseconds)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    free, _ = torch.cuda.mem_get_info(device)
    return int(free / device_sharers())


def _power_of_two(count: float, cap: int) -> int:
    n = int(count)
    return 1 if n < 1 else min(cap, 1 << (n.bit_length() - 1))
