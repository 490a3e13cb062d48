"""The kill matrix: the premerge profile, exactly as `mla-verify check --profile premerge` runs it on CPU,
must catch every mutant. A surviving mutant fails CI. And its FAIL block must say what is wrong: a catalogued
misreading, where the output is wrong, or (a kernel that raised) the kernel's own line."""
import re

import pytest

from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.kernels.mutants import MUTANTS
from mla_verify.records.failure import failure_lines
from mla_verify.run.engine import verify
from mla_verify.run.harness import CaseResult


def shows_what_is_wrong(case: CaseResult) -> bool:
    """A diagnosis line that is not "diagnosis failed", or, with no output to diagnose, the frame it raised in."""
    said = [line for line in failure_lines(case, None) if line.startswith("  diagnosis: ")]
    if any(not line.startswith("  diagnosis: diagnosis failed") for line in said):
        return True
    return case.out is None and bool(re.search(r" at \S+\.py:\d+ in \S+$", case.reason))


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_premerge_kills_mutant(name):
    result = verify(TrtllmStyleBackend(name, MUTANTS[name].fn), "cpu", "premerge")
    assert result.verdict == "fail", f"mutant {name} survived {len(result.cases)} premerge cases"
    assert result.failure.failures
    assert shows_what_is_wrong(result.failure), "\n".join(failure_lines(result.failure, None))
