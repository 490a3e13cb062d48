"""The kill matrix as a record, to hold two trees against each other: what premerge does on CPU to the correct
kernel, the CPU peer and every mutant -- dense and, where the tree has them, sparse -- case by case.

Per target: the verdict, every judged case's (id, verdict) in order, and the failure's minimal case (its id, its
description, the catalogued misreadings its diagnosis names, its diagnosis). A refactoring of the pipeline that
must not change the dense verdicts shows it here: run this in both trees, then compare the records (the
``nondeterministic`` mutant's diagnosis moves with its own random noise; nothing else should)::

    OMP_NUM_THREADS=1 PYTHONPATH=<tree> python benchmarks/kill_matrix_record.py --out record.json   # in <tree>

The sparse rows answer issue 39's acceptance: every sparse mutant caught, its minimal case at one request, named.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import torch
from run_record import machine_record

from mla_verify.backends import get_backend
from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.backends.user_kernel import load_kernel
from mla_verify.kernels import mutants
from mla_verify.run.engine import verify


def record(backend: Any) -> dict[str, Any]:
    r = verify(backend, "cpu", "premerge")
    f = r.failure
    return {"verdict": r.verdict, "cases": [[c.id, c.verdict] for c in r.cases],
            "failure": None if f is None else {
                "id": f.id, "case": f.describe(), "batch": f.spec.batch,
                "names": sorted(set(re.findall(r" \[(\w+)\] \(", " ".join(f.diagnosis)))), "diagnosis": f.diagnosis}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="the JSON record")
    args = ap.parse_args()
    torch.set_num_threads(1)  # as `check` runs on CPU: the same bits run to run
    targets: dict[str, Any] = {"correct_kernel": TrtllmStyleBackend("correct_kernel", mutants.correct_kernel),
                               "cpu-peer": get_backend("cpu-peer")}
    # the mutants a CPU can catch (a tree before issue 40 has no Mutant.device: all of them)
    targets.update({n: TrtllmStyleBackend(n, m.fn) for n, m in sorted(mutants.MUTANTS.items())
                    if getattr(m, "device", "cpu") == "cpu"})
    sparse = sorted(getattr(mutants, "SPARSE_MUTANTS", {}))  # a tree before issue 39 has none
    targets.update({n: load_kernel(f"mla_verify.kernels.mutants:{n}")
                    for n in (["correct_sparse_kernel"] if sparse else []) + sparse})
    out: dict[str, Any] = {"machine": machine_record(), "targets": {}}
    for name, backend in targets.items():
        out["targets"][name] = record(backend)
        print(name, out["targets"][name]["verdict"], len(out["targets"][name]["cases"]), file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
