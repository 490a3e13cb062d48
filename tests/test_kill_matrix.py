"""The kill matrix: the premerge profile, exactly as `mla-verify check --profile premerge` runs it on CPU,
must catch every mutant. A surviving mutant fails CI."""
import pytest

from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.engine import verify
from mla_verify.mutants import MUTANTS


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_premerge_kills_mutant(name):
    result = verify(TrtllmStyleBackend(name, MUTANTS[name].fn), "cpu", "premerge")
    assert result.verdict == "fail", f"mutant {name} survived {len(result.cases)} premerge cases"
    assert result.failure.failures
