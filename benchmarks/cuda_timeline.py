"""Where one call's GPU sits idle: a CUDA-only profiler trace of the call, read as a timeline (benchmark tool).

The profiler records the host's CUDA API calls and the GPU's kernels and copies, with correlation ids that tie
each kernel to the call that launched it. The call is the last of three traced ones (``trace_events``). From
those, relative to the call's first API call:
- ``first_kernel_us`` / ``first_heavy_us``: when the GPU first ran anything, and anything of at least
  ``HEAVY_US`` (the first gather, for the reference: the time the host spent before real work could start);
- ``busy_us``: the union of the GPU's activity; ``idle_after_heavy_us``: the gaps from the first heavy kernel
  to the end of the last one;
- ``host_end_us``: the end of the last API call (about when the call returned); ``gpu_end_us``: its last kernel;
- ``gaps``: the longest gaps after the first kernel, each with the kernel that ended it and whether that kernel
  was launched only after the GPU had gone idle (the GPU waited on the host) or was already queued;
- ``gpu``: every GPU activity as [launched, started, lasted (us), name].
Only CUDA activity is traced, so the host's per-operation profiler overhead stays small; it is not zero.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

HEAVY_US = 20.0
SYNC = "cudaDeviceSynchronize"
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_events(fn: Callable[[], Any], device: torch.device, calls: int = 3) -> list[dict[str, Any]]:
    """The chrome-trace events of the last of ``calls`` calls of ``fn``, each followed by a sync. The first calls
    under the profiler are not used: its first API calls cost milliseconds of set-up, which would read as idle
    GPU time."""
    fn()
    torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
            torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    return last_call(events)


def last_call(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events between the last two host syncs that hold GPU work (the profiler may add syncs of its own)."""
    spans = [e for e in events if e.get("ph") == "X"]
    ends = sorted(e["ts"] + e["dur"] for e in spans if e.get("name") == SYNC)
    calls = [[e for e in spans if lo <= e["ts"] < hi and e.get("name") != SYNC]
             for lo, hi in zip([float("-inf")] + ends, ends + [float("inf")])]
    with_gpu = [call for call in calls if any(e.get("cat") in GPU_CATEGORIES for e in call)]
    if len(with_gpu) < 2:
        raise RuntimeError(f"the trace holds {len(with_gpu)} synced calls with GPU work, not at least 2")
    return with_gpu[-1]


def timeline(events: list[dict[str, Any]], gaps: int = 6) -> dict[str, Any]:
    """The summary above, from ``trace_events``'s events."""
    api = sorted((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("ph") == "X"),
                 key=lambda e: e["ts"])
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES and e.get("ph") == "X"),
                 key=lambda e: e["ts"])
    if not api or not gpu:
        return {"error": "no CUDA activity in the trace"}
    t0 = api[0]["ts"]
    launched = {e.get("args", {}).get("correlation"): e["ts"] - t0 for e in api}
    heavy = next((e for e in gpu if e["dur"] >= HEAVY_US), gpu[0])
    busy, found, end = 0.0, [], None
    for e in gpu:
        start, stop = e["ts"] - t0, e["ts"] + e["dur"] - t0
        if end is not None and start > end:
            launch = launched.get(e.get("args", {}).get("correlation"))
            found.append({"at_us": round(end, 1), "gap_us": round(start - end, 1), "next": e["name"][:60],
                          "waited_on_host": launch is not None and launch > end})
        if end is None or stop > end:
            busy += stop - max(start, end if end is not None else start)
            end = stop
    after_heavy = sum(g["gap_us"] for g in found if g["at_us"] >= heavy["ts"] - t0)
    return {"first_kernel_us": round(gpu[0]["ts"] - t0, 1), "first_heavy_us": round(heavy["ts"] - t0, 1),
            "busy_us": round(busy, 1), "idle_after_heavy_us": round(after_heavy, 1),
            "host_end_us": round(max(e["ts"] + e["dur"] for e in api) - t0, 1), "gpu_end_us": round(end, 1),
            "kernels": len(gpu), "api_calls": len(api),
            "gaps": sorted(found, key=lambda g: -g["gap_us"])[:gaps],
            "gpu": [[launched.get(e.get("args", {}).get("correlation")), round(e["ts"] - t0, 1), round(e["dur"], 1),
                     e["name"][:50]] for e in gpu]}


def describe(summary: dict[str, Any]) -> str:
    if "error" in summary:
        return summary["error"]
    head = (f"first kernel {summary['first_kernel_us']} us, first heavy {summary['first_heavy_us']} us, GPU busy "
            f"{summary['busy_us']} us, idle after it {summary['idle_after_heavy_us']} us, host end "
            f"{summary['host_end_us']} us, GPU end {summary['gpu_end_us']} us ({summary['kernels']} kernels, "
            f"{summary['api_calls']} API calls)")
    lines = [f"  gap {g['gap_us']:7.1f} us at {g['at_us']:8.1f} us before {g['next']}"
             f"{' (waited on the host)' if g['waited_on_host'] else ''}" for g in summary["gaps"]]
    return "\n".join([head] + lines)
