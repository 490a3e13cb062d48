"""The timeline reader behind ``reference_ab.py --timeline`` (benchmarks/cuda_timeline.py), on synthetic traces.

Twice on the H200 it read the wrong part of a real trace (the profiler's set-up as idle time, then nothing after
the profiler's own closing sync), and a wrong reading becomes a wrong conclusion in docs/gpu_results.md, so
its selection and its arithmetic are pinned here on CPU.
"""
from __future__ import annotations

import pytest

from benchmark_tools import load_benchmark

ct = load_benchmark("cuda_timeline")


def launch(ts: float, corr: int) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2,
            "args": {"correlation": corr}}


def kernel(ts: float, dur: float, corr: int, name: str = "k") -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def sync(ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": ct.SYNC, "ts": ts, "dur": dur}


def one_call(t0: float, corr: int) -> list[dict]:
    """A small kernel, a 100 us gap the GPU spends waiting on the host, a heavy kernel with a second one queued
    behind it that overlaps nothing, then the sync."""
    return [launch(t0, corr), kernel(t0 + 5, 4, corr, "small"),
            launch(t0 + 100, corr + 1), kernel(t0 + 109, 50, corr + 1, "heavy"),
            launch(t0 + 120, corr + 2), kernel(t0 + 161, 30, corr + 2, "queued"),
            sync(t0 + 125, 70)]


def test_the_last_synced_call_is_read_and_the_profilers_own_sync_ignored() -> None:
    events = one_call(0, 1) + one_call(1000, 10) + one_call(2000, 20) + [sync(3000, 3)]
    chosen = ct.last_call(events)
    assert {e["args"]["correlation"] for e in chosen if e.get("cat") == "kernel"} == {20, 21, 22}
    assert all(e["name"] != ct.SYNC for e in chosen)


def test_one_synced_call_is_refused() -> None:
    with pytest.raises(RuntimeError, match="not at least 2"):
        ct.last_call(one_call(0, 1))


def test_gaps_busy_time_and_who_waited() -> None:
    summary = ct.timeline(ct.last_call(one_call(0, 1) + one_call(1000, 10)))
    # relative to the call's first API call at 1000: small 5-9, heavy 109-159, queued 161-191
    assert summary["first_kernel_us"] == 5 and summary["first_heavy_us"] == 109
    assert summary["busy_us"] == 4 + 50 + 30
    assert summary["gpu_end_us"] == 191 and summary["host_end_us"] == 122
    gaps = {g["next"]: g for g in summary["gaps"]}
    assert gaps["heavy"]["gap_us"] == 100 and gaps["heavy"]["waited_on_host"]  # launched at 100, GPU idle since 9
    assert gaps["queued"]["gap_us"] == 2 and not gaps["queued"]["waited_on_host"]  # launched at 120, before 159
    assert summary["idle_after_heavy_us"] == 2
    assert summary["gpu"][1] == [100, 109, 50, "heavy"]


def test_overlapping_kernels_count_once() -> None:
    events = [launch(0, 1), kernel(10, 40, 1), launch(1, 2), kernel(20, 10, 2), launch(2, 3), kernel(30, 40, 3)]
    assert ct.timeline(events)["busy_us"] == 60  # 10-70, with two overlaps
