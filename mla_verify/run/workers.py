"""Which device a pytest(-xdist) worker runs on: a stable slot per live worker, round-robin over visible GPUs.

Why slots and not the worker id: xdist names the replacement of a crashed worker with a fresh id (``gw2``
after ``gw0``/``gw1``), so a rule on the id would move the replacement to another GPU and leave the crashed
worker's GPU idle. The controller gives each new worker the lowest free slot (``SlotTable``); a replacement
inherits the slot its predecessor released, hence the same GPU. Slots stay below the worker count, so
``slot % gpus`` spreads workers evenly when there are more workers than GPUs and leaves the extra GPUs idle
when there are fewer.

Device indices are always relative to the visible set: ``torch.cuda.device_count()`` already applies
``CUDA_VISIBLE_DEVICES``, and ``cuda:k`` means the k-th visible device, never the physical id.
"""
from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..core.errors import UsageError

# Test-only: pretend this many GPUs are visible on a machine without CUDA. The assignment is then reported
# as "(simulated)" and the tests run on the CPU; on a machine with CUDA setting it is an error, so it can
# never stand in for a real GPU run.
FAKE_GPU_ENV = "MLA_VERIFY_FAKE_GPU_COUNT"

_DEVICE_RE = re.compile(r"(auto|cpu|cuda)(?::(\d+))?")


@dataclass(frozen=True)
class DeviceRequest:
    """What the user asked for: ``auto`` (a GPU if any, else cpu), ``cpu``, ``cuda`` (any GPU) or ``cuda:N``."""

    kind: str
    index: int | None = None

    def __str__(self) -> str:
        return self.kind if self.index is None else f"{self.kind}:{self.index}"


@dataclass(frozen=True)
class Assignment:
    """The device one worker uses. ``worker`` is the xdist id (``gw3``) or ``main`` outside xdist."""

    worker: str
    device: str  # "cpu" or "cuda:k"
    simulated: bool = False  # a FAKE_GPU_ENV assignment: reported as given, run on the CPU

    @property
    def label(self) -> str:
        return f"{self.device} (simulated)" if self.simulated else self.device

    @property
    def run_device(self) -> str:
        """Where tensors actually go."""
        return "cpu" if self.simulated else self.device


def parse_device_request(text: str) -> DeviceRequest:
    """Parses ``--mla-device``; raises UsageError (one line) on anything else."""
    m = _DEVICE_RE.fullmatch(text.strip().lower())
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise UsageError(f"--mla-device: {text!r} is not one of cpu, cuda, cuda:N, auto")
    return DeviceRequest(m.group(1), None if m.group(2) is None else int(m.group(2)))


def assign_device(request: DeviceRequest, slot: int | None, gpu_count: int) -> str:
    """The device string for the worker in ``slot`` (None: not under xdist) with ``gpu_count`` visible GPUs."""
    if request.kind == "cpu" or (request.kind == "auto" and gpu_count == 0):
        return "cpu"
    if gpu_count == 0:
        raise UsageError(f"--mla-device {request}: no CUDA device is visible")
    if request.index is not None:
        if request.index >= gpu_count:
            raise UsageError(f"--mla-device {request}: only {gpu_count} CUDA device(s) visible "
                             "(indices count within CUDA_VISIBLE_DEVICES)")
        return str(request)
    return f"cuda:{(slot or 0) % gpu_count}"


def visible_gpu_count(environ: Mapping[str, str] = os.environ) -> tuple[int, bool]:
    """(number of visible CUDA devices, whether it is simulated through FAKE_GPU_ENV)."""
    fake = environ.get(FAKE_GPU_ENV)
    if torch.cuda.is_available():
        if fake is not None:
            raise UsageError(f"{FAKE_GPU_ENV} is for CPU-only test runs; unset it on a machine with a GPU")
        return torch.cuda.device_count(), False
    if fake is None:
        return 0, False
    if not fake.isdigit():
        raise UsageError(f"{FAKE_GPU_ENV}={fake!r} is not a non-negative integer")
    return int(fake), True


def assign_worker(request: DeviceRequest, worker: str | None, slot: int | None,
                  environ: Mapping[str, str] = os.environ) -> Assignment:
    """The full decision for one worker process: visible GPUs from torch (or the test-only simulation)."""
    count, simulated = visible_gpu_count(environ)
    device = assign_device(request, slot, count)
    return Assignment(worker or "main", device, simulated and device != "cpu")


# a thread count the user chose: left as it is
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's CPU allocator backs large tensors with huge pages when "1"


def available_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one, as a CI container sets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def worker_threads(workers: int, environ: Mapping[str, str] = os.environ, cores: int | None = None) -> int | None:
    """Torch threads for one of ``workers`` processes: its share of the cores, or None where the user set a
    count. Each process otherwise starts one thread per core: with two workers on two cores every op waits
    at its barrier for a thread the other worker holds (docs/pytest.md)."""
    if any(environ.get(name) for name in THREAD_ENV):
        return None
    return max(1, (cores or available_cores()) // workers)


class SlotTable:
    """Controller side: live worker id -> slot; a new worker takes the lowest slot no live worker holds."""

    def __init__(self) -> None:
        self._held: dict[str, int] = {}

    def claim(self, worker_id: str) -> int:
        if worker_id not in self._held:
            used = set(self._held.values())
            self._held[worker_id] = next(i for i in itertools.count() if i not in used)
        return self._held[worker_id]

    def release(self, worker_id: str) -> None:
        self._held.pop(worker_id, None)


def cpu_run_settings(threads: int = 1) -> None:
    """How `check`, `replay` and a pytest run on a CPU device (the plugin) run torch, unless the environment
    says otherwise (docs/verified.md): ``threads`` torch threads (replay: the recorded run's count) unless
    OMP_NUM_THREADS is set."""
    if "OMP_NUM_THREADS" not in os.environ:
        # the cases are small: a second thread gains little on an idle machine, and on shared cores each op
        # waits for the thread that is not scheduled
        torch.set_num_threads(threads)
    # torch's CPU allocator then backs each tensor of 2 MiB or more with huge pages. A case's large tensors are
    # mapped afresh, and with 4 KiB pages the page faults were half of a CPU premerge run. Blocks are handed
    # out and reused as before, so the poison priming of harness._invoke is unchanged. torch reads the
    # variable at its first allocation, which no case has made yet.
    os.environ.setdefault(HUGE_PAGES_ENV, "1")
