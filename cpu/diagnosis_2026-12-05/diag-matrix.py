"""Kill matrix dump: each mutant's premerge verdict, case ids and FAIL block (run with PYTHONPATH=<tree>)."""
import json, sys, time
from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.kernels.mutants import MUTANTS
from mla_verify.records.failure import failure_lines
from mla_verify.run.engine import verify

rows = {}
for name in sorted(MUTANTS):
    t = time.monotonic()
    r = verify(TrtllmStyleBackend(name, MUTANTS[name].fn), "cpu", "premerge")
    rows[name] = {"verdict": r.verdict, "cases": [(c.id, c.verdict) for c in r.cases],
                  "fail_block": failure_lines(r.failure, None) if r.failure else None,
                  "expected": MUTANTS[name].diagnosis, "first_failing": getattr(r.failure, "first_failing", None), "seconds": round(time.monotonic() - t, 2)}
    print(name, r.verdict, len(r.cases), rows[name]["seconds"], flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
