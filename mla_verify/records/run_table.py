"""The run section of a report as tables a person reads: the run's settings, and per backend its judged cases,
its rate and where its time went (run/stage_times.py's breakdown, recorded as the run's ``throughput``).

Every value is turned into words here (``plain``): a report never shows a Python repr, whatever a later
version adds to the record. A warm-up (a ``warmup_s`` in a backend's breakdown, or a ``warmup`` stage among
its per-case means) is shown on its own row, apart from the cases' stages.
"""
from __future__ import annotations

from typing import Any

WARMUP = "warmup"  # the stage name a warm-up phase would carry among the per-case means
SETTINGS = {"command": "command", "device": "device", "profile": "profile", "seed": "seed",
            "seed_fresh": "seed drawn fresh for this run", "cases": "your cases (judged first)",
            "max_examples": "drawn cases per backend", "minutes": "minutes per backend", "seconds": "wall time",
            "interrupted": "interrupted", "warmup": "warm-up, before the first case (run/warmup.py)",
            "warmup_s": "warm-up time", "warmup_failures": "warm-up failures"}
SECONDS_KEYS = ("seconds", "_s")  # keys holding seconds get an "s" unit


def plain(value: Any) -> str:
    """A recorded value in words: yes/no, numbers as numbers, mappings as "key value; ...", lists joined."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return "; ".join(f"{str(k).replace('_', ' ')} {plain(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(plain(v) for v in value)
    return str(value)


def settings_rows(run: dict[str, Any]) -> list[list[str]]:
    """(what, value) rows of the run's settings, the throughput left to ``time_table``; unset ones left out."""
    rows = []
    for key, value in run.items():
        if key == "throughput" or value is None:
            continue
        text = plain(value) + (" s" if key.endswith(SECONDS_KEYS) and isinstance(value, (int, float))
                               and not isinstance(value, bool) else "")
        rows.append([SETTINGS.get(key, key.replace("_", " ")), text])
    return rows


def time_table(throughput: dict[str, dict[str, Any]],
               resolved: dict[str, dict[str, int]]) -> tuple[list[str], list[list[str]]]:
    """Headers and rows: one column per backend that ran; rows for judged cases, rate, wall time, warm-up and
    each stage's mean per judged case (with its share of a case's total), then the time outside cases."""
    names = list(throughput)
    headers = ["per backend"] + [n + (f" (ran as {', '.join(resolved[n])})" if resolved.get(n) else "") for n in names]
    cols = [throughput[n] for n in names]

    def row(label: str, cell: Any) -> list[str]:
        return [label] + [cell(b) for b in cols]

    def warmup(b: dict[str, Any]) -> str:
        if b.get("warmup_s") is not None:
            return f"{b['warmup_s']:.1f} s"
        ms = (b.get("mean_ms") or {}).get(WARMUP)
        return "-" if ms is None else f"{ms:.1f} ms per judged case"

    rows = [row("judged cases", lambda b: str(b.get("judged", 0))),
            row("judged per second", lambda b: f"{b.get('judged_per_s', 0):.1f}"),
            row("wall time", lambda b: f"{b.get('seconds', 0):.1f} s")]
    if any(b.get("warmup_s") is not None or WARMUP in (b.get("mean_ms") or {}) for b in cols):
        rows.append(row("warm-up (apart from the cases)", warmup))
    stages = list(dict.fromkeys(s for b in cols for s in (b.get("mean_ms") or {}) if s != WARMUP))

    def stage_cell(b: dict[str, Any], stage: str) -> str:
        ms = (b.get("mean_ms") or {}).get(stage)
        total = sum(v for s, v in (b.get("mean_ms") or {}).items() if s != WARMUP)
        return "-" if ms is None else f"{ms:.1f} ms" + (f" ({100 * ms / total:.0f}%)" if total else "")

    rows += [row(f"{stage}, mean per judged case", lambda b, s=stage: stage_cell(b, s)) for stage in stages]
    rows += [row("drawing, all cases", lambda b: f"{b.get('draw_s', 0):.1f} s"),
             row("outside cases (Hypothesis, shrinking)", lambda b: f"{b.get('outside_cases_s', 0):.1f} s")]
    return headers, rows
