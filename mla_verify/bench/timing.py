"""How the benchmark times kernel calls: CUDA graphs + events on a GPU, a wall clock on the CPU.

A timer first ``arm``s a round of calls (one per rotating input set: warm-up, then capture of the whole
round in one CUDA graph, or plain launches when capture fails), then ``measure``s it: each sample is a
block of round replays between two events, divided by the number of calls, so a sample is a mean over
>= ``min_block_s`` of GPU time and the reported latency is the median of the samples. The clock is
injectable so the timing loop itself can be tested on a CPU with a fake clock.
"""
from __future__ import annotations

import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..backends.base import PreparedCall
from ..core.tracebacks import exception_line

GRAPH = "cuda-graph"  # the round is one CUDA graph, replayed; timed with CUDA events
EAGER = "cuda-events"  # capture failed: plain launches of invoke(), timed with CUDA events
WALL = "cpu-wall-clock"  # CPU device: invoke() timed with a host clock
FALLBACK_L2_BYTES = 128 << 20  # if the driver does not say: larger than any current GPU's L2 (H200 60 MB)
SLEEP_CYCLES = 2_000_000  # ~1 ms GPU spin before each sample so the host queues the block ahead of the GPU


@dataclass
class ArmedRound:
    """A round of calls ready to replay, plus the raw result each call returned (graph outputs alias)."""

    launch: Callable[[], None]  # runs every call of the round once
    results: list[Any]
    calls: int
    method: str
    note: str = ""  # why capture was not used, when it was not
    keep: list[Any] = field(default_factory=list)  # graph objects that must outlive the replays


@dataclass
class Timing:
    method: str
    samples_s: list[float]  # seconds per call, one entry per timed block
    note: str = ""

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def spread(self) -> float:
        """(max - min) / median of the samples: within-run noise, for judging a regression threshold."""
        return (max(self.samples_s) - min(self.samples_s)) / self.median_s if self.median_s > 0 else 0.0


class Timer(Protocol):
    """What ``bench.run_bench`` needs from a timer."""

    def l2_bytes(self) -> int: ...
    def arm(self, calls: Sequence[PreparedCall], use_graph: bool = True) -> ArmedRound: ...
    def measure(self, armed: ArmedRound) -> Timing: ...
    def once(self, fn: Callable[[], Any]) -> tuple[Any, float]: ...
    def copy_bandwidth(self, nbytes: int) -> float | None: ...


class CudaTimer:
    """Graph replays (or plain launches) of a rotating round, timed with CUDA events."""

    def __init__(self, device: torch.device, samples: int = 15, min_block_s: float = 1e-3, warmup: int = 2):
        self.device = device
        self.samples = samples
        self.min_block_s = min_block_s
        self.warmup = warmup

    def l2_bytes(self) -> int:
        return int(getattr(torch.cuda.get_device_properties(self.device), "L2_cache_size", 0) or FALLBACK_L2_BYTES)

    def arm(self, calls: Sequence[PreparedCall], use_graph: bool = True) -> ArmedRound:
        with torch.cuda.device(self.device):
            results = [c.invoke() for c in calls]  # first use: JIT compile, lazy init, plan caches
            torch.cuda.synchronize()
            if use_graph:
                try:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        results = [c.invoke() for c in calls]
                    torch.cuda.synchronize()
                    return ArmedRound(graph.replay, results, len(calls), GRAPH, keep=[graph])
                except Exception as e:  # a backend whose call cannot be captured: time plain launches
                    torch.cuda.synchronize()
                    note = f"graph capture failed ({exception_line(e, located=False)[:160]})"
            else:
                note = "graph capture disabled"
            return ArmedRound(lambda: _invoke_all(calls), results, len(calls), EAGER, note)

    def measure(self, armed: ArmedRound) -> Timing:
        with torch.cuda.device(self.device):
            for _ in range(self.warmup):
                armed.launch()
            round_s = self._block(armed.launch, 1)
            reps = max(1, math.ceil(self.min_block_s / max(round_s, 1e-9)))
            samples = [self._block(armed.launch, reps) / (reps * armed.calls) for _ in range(self.samples)]
        return Timing(armed.method, samples, armed.note)

    def _block(self, launch: Callable[[], object], reps: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        for _ in range(reps):
            launch()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def once(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        """Wall-clock seconds of one host-driven call (the reference), GPU work included."""
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        value = fn()
        torch.cuda.synchronize(self.device)
        return value, time.perf_counter() - t0

    def copy_bandwidth(self, nbytes: int) -> float | None:
        """Bytes/s of a device-to-device copy of ``nbytes``, counting its read and its write."""
        with torch.cuda.device(self.device):
            src = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            dst = torch.empty_like(src)
            src.fill_(1)
            dst.copy_(src)
            seconds = statistics.median(self._block(functools.partial(dst.copy_, src), 1) for _ in range(self.samples))
            del src, dst
            torch.cuda.empty_cache()
        return 2 * nbytes / seconds


class WallClockTimer:
    """CPU backends timed with a host clock (``clock`` is injectable: tests pass a fake one)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, samples: int = 5):
        self.clock = clock
        self.samples = samples

    def l2_bytes(self) -> int:
        return 0  # no rotation needed to defeat a cache we cannot size: one input set

    def arm(self, calls: Sequence[PreparedCall], use_graph: bool = True) -> ArmedRound:
        """Warm-up call of each; no graphs on a CPU (``use_graph`` is accepted for a common signature)."""
        results = [c.invoke() for c in calls]
        return ArmedRound(lambda: _invoke_all(calls), results, len(calls), WALL)

    def measure(self, armed: ArmedRound) -> Timing:
        samples = []
        for _ in range(self.samples):
            t0 = self.clock()
            armed.launch()
            samples.append((self.clock() - t0) / armed.calls)
        return Timing(WALL, samples, armed.note)

    def once(self, fn: Callable[[], Any]) -> tuple[Any, float]:
        t0 = self.clock()
        value = fn()
        return value, self.clock() - t0

    def copy_bandwidth(self, nbytes: int) -> float | None:
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        t0 = self.clock()
        dst.copy_(src)
        seconds = self.clock() - t0
        return 2 * nbytes / seconds if seconds > 0 else None  # a coarse or fake clock may not see it


def _invoke_all(calls: Sequence[PreparedCall]) -> None:
    for c in calls:
        c.invoke()
