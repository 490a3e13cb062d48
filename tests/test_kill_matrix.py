"""The kill matrix: the premerge profile, exactly as `mla-verify check --profile premerge` runs it on CPU,
must catch every mutant a CPU can (the one whose fault shows only past 2^32 elements of the pool is caught on a
GPU: tests/gpu/test_large_pool.py). A surviving mutant fails CI. And its FAIL block must say what is wrong: a catalogued
misreading, where the output is wrong, or (a kernel that raised) the kernel's own line; a catalogued mutant
that left an output is named by its own misreading, and no other misreading is named unless as one of the
candidates a case cannot tell apart."""
import re

import pytest

from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.judge.diagnose import CANDIDATES
from mla_verify.kernels.mutants import MUTANTS
from mla_verify.records.failure import failure_lines
from mla_verify.run.engine import verify
from mla_verify.run.harness import CaseResult


def named(case: CaseResult) -> list[tuple[bool, set[str]]]:
    """For each diagnosis the FAIL block prints (the minimal case's, then the first failing case's): whether it
    says the case cannot tell misreadings apart, and the catalogued misreadings it names ("[name]")."""
    groups: list[tuple[bool, set[str]]] = []
    for line in failure_lines(case, None):
        if line.startswith(("  minimal case: ", "  first failing case")):
            groups.append((False, set()))
        elif line.lstrip().startswith("diagnosis: ") and groups:
            said = line.lstrip()[len("diagnosis: "):]
            tied, names = groups[-1]
            groups[-1] = (tied or said.startswith(CANDIDATES), names | set(re.findall(r" \[(\w+)\] \(", said)))
    return groups


def shows_what_is_wrong(case: CaseResult) -> bool:
    """A diagnosis line that is not "diagnosis failed", or, with no output to diagnose, the frame it raised in."""
    said = [line for line in failure_lines(case, None) if line.startswith("  diagnosis: ")]
    if any(not line.startswith("  diagnosis: diagnosis failed") for line in said):
        return True
    return case.out is None and bool(re.search(r" at \S+\.py:\d+ in \S+$", case.reason))


@pytest.mark.parametrize("name", sorted(n for n, m in MUTANTS.items() if m.device == "cpu"))
def test_premerge_kills_mutant(name):
    result = verify(TrtllmStyleBackend(name, MUTANTS[name].fn), "cpu", "premerge")
    assert result.verdict == "fail", f"mutant {name} survived {len(result.cases)} premerge cases"
    assert result.failure.failures
    assert shows_what_is_wrong(result.failure), "\n".join(failure_lines(result.failure, None))
    right = MUTANTS[name].diagnosis
    if right is None or result.failure.out is None:  # outside the catalog, or raised: no name to keep
        return
    groups = named(result.failure)
    block = "\n".join(failure_lines(result.failure, None))
    assert any(right in names for _, names in groups), f"{name} not named {right}:\n{block}"
    assert all(tied or names <= {right} for tied, names in groups), f"{name} named wrongly:\n{block}"
