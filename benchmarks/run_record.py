"""What a CPU benchmark records beside its numbers: when, on what, at which commit, and how loaded the machine was.

Shared by ``premerge_time.py`` and ``mutant_catch_times.py``. Timings on a small shared machine depend on what
else runs there, so every timed step carries its own CPU seconds, the load average before and after it, and
how many cores other processes kept busy meanwhile (the load average lags by a minute; that figure does not).
"""
from __future__ import annotations

import datetime
import os
import platform
import resource
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mla_verify.core.platform import platform_info

REPO = Path(__file__).resolve().parent.parent


def load() -> list[float]:
    """The 1-, 5- and 15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def cpu_seconds(children: bool = False) -> float:
    """User + system CPU seconds of this process (or of its finished children). Threads spinning at a barrier
    count as busy, so under contention this grows too, though less than wall time."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN if children else resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def busy_cpu_seconds() -> float:
    """Non-idle CPU seconds of the whole machine since boot, summed over cores (Linux /proc/stat; counted in
    10 ms ticks, so over steps shorter than ~1 s the difference is coarse)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


@contextmanager
def measured(children: bool = False) -> Iterator[dict[str, Any]]:
    """Measure the ``with`` block: wall and own CPU seconds (``children``: of the subprocesses it waited for),
    load averages before and after, and ``others_cores``: the cores other processes kept busy on average."""
    m: dict[str, Any] = {"load_before": load()}
    own0, busy0, t0 = cpu_seconds(children), busy_cpu_seconds(), time.perf_counter()
    yield m
    wall, own = time.perf_counter() - t0, cpu_seconds(children) - own0
    others = max(0.0, busy_cpu_seconds() - busy0 - own) / wall
    m.update(wall_s=round(wall, 2), cpu_s=round(own, 2), others_cores=round(others, 2), load_after=load())


def load_cells(m: dict[str, Any]) -> str:
    """Markdown cells: others' busy cores, then the load averages before and after."""
    return (f"{m['others_cores']} | {' '.join(map(str, m['load_before']))} | "
            f"{' '.join(map(str, m['load_after']))}")


LOAD_HEADER = "other processes' busy cores | load 1/5/15 min before | after"


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def machine_record() -> dict[str, Any]:
    """Date, CPU count and model, library versions, commit, and whether mla_verify/ differs from it."""
    import torch

    return {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "nproc": os.cpu_count(), "cpu": _cpu_model(), "torch_threads": torch.get_num_threads(),
            "platform": platform_info().describe(), "commit": _git("rev-parse", "HEAD"),
            "uncommitted_library_changes": _git("status", "--porcelain", "--", "mla_verify").splitlines()}


def machine_line(m: dict[str, Any]) -> str:
    """One Markdown line describing ``machine_record()``."""
    dirty = m["uncommitted_library_changes"]
    dirty_note = f" plus uncommitted changes: {', '.join(dirty)}" if dirty else ""
    return (f"{m['date']}; {m['nproc']} CPUs ({m['cpu']}), torch.get_num_threads()={m['torch_threads']} in the "
            f"benchmark process; {m['platform']}; commit {m['commit'][:12]}{dirty_note}")
