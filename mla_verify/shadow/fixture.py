"""A reproducer of one mismatching live call, kept as an ordinary fixture (fixtures.py) so that
``mla-verify replay`` re-runs it.

A live call has no spec that regenerates it, so its tensors are stored -- capped in size: the pool is cut to the
pages its sequences read (shadow_problem.compact), and when that is still over the cap only the sequence with
the worst error is kept; past that, nothing is written and the report says why. The JSON records the call site,
the entry point, the findings and the diagnosis beside the describing spec and layout replay needs.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from ..problems.layouts import LayoutSpec
from ..problems.problem import DecodeProblem
from ..records.fixtures import DEFAULT_MAX_REPRODUCER_MIB, save_fixture, tensor_sha256
from .problem import compact, describing_spec

DEFAULT_CAP_MIB = DEFAULT_MAX_REPRODUCER_MIB  # one cap for every reproducer
KIND = "shadow"


def _bytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _problem_bytes(p: DecodeProblem) -> int:
    return _bytes(p.query, p.kv_cache, p.block_table, p.seq_lens)


def keep_reproducer(directory: Path, problem: DecodeProblem, out: torch.Tensor, lse: torch.Tensor | None,
                    layout: LayoutSpec, worst_row: int, record: dict[str, Any],
                    cap_bytes: int = DEFAULT_CAP_MIB << 20) -> tuple[Path | None, str]:
    """(the fixture's JSON path, or None; a line saying what was kept). ``record`` goes into the JSON."""
    rows = None
    small = compact(problem)
    if _problem_bytes(small) + _bytes(out, lse) > cap_bytes:
        rows = [worst_row]
        small = compact(problem, rows)
        out, lse = out[rows], None if lse is None else lse[rows]
        size = _problem_bytes(small) + _bytes(out, lse)
        if size > cap_bytes:
            return None, (f"reproducer not kept: even its worst sequence alone is {size / 2**20:.1f} MiB, over the "
                          f"cap of {cap_bytes / 2**20:g} MiB")
    spec = describing_spec(small)
    blob = json.dumps([record.get("entry"), record.get("call_site"), spec.to_json()], sort_keys=True)
    fixture_id = "shadow-" + hashlib.sha256((blob + tensor_sha256(small.query)).encode()).hexdigest()[:16]
    meta = {**record, "kind": KIND, "spec": spec.to_json(), "layout": layout.to_json(), "metamorphic": "none",
            "verdict": "fail", "rows_kept": rows, "description": spec.describe()}
    extra = {"kernel_out": out} if lse is None else {"kernel_out": out, "kernel_lse": lse}
    try:
        path = save_fixture(directory, fixture_id, small, meta, extra)
    except OSError as e:
        return None, f"reproducer not kept: cannot write in {directory}: {e.strerror}"
    kept = "" if rows is None else f" (only sequence {worst_row}: the whole call is over the size cap)"
    return path, f"reproducer: {path}{kept}"
