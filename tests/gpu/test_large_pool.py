"""Pages past 2^31 and 2^32 elements of the pool, on a GPU with the memory (problems/metamorphic.py's LARGE_POOL:
a pool of 8 GiB and its copies). Marked ``gpu``; each test skips with the relation's own reason where the device
lacks the memory (its share of the free memory, under ``pytest -n`` too).

The same data at high page indices must give the same bits; a kernel that computes its element offsets in 32 bits
(the ``offset_32bit`` mutant) reads other pages there and is caught, by its trigger and by premerge, while the
correct kernel passes.
"""
from __future__ import annotations

import pytest
import torch

from mla_verify.backends.trtllm_style import TrtllmStyleBackend
from mla_verify.kernels.mutants import MUTANTS, correct_kernel
from mla_verify.kinds.dense import large_pool_reason
from mla_verify.problems.generate import build_problem
from mla_verify.problems.metamorphic import LARGE_POOL, WRAPS, transform
from mla_verify.run.engine import verify
from mla_verify.run.harness import NOT_BIT_IDENTICAL, run_case

pytestmark = pytest.mark.gpu
MUTANT = MUTANTS["offset_32bit"]


@pytest.fixture
def cuda() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU with about 20 GiB free")
    device = torch.device("cuda")
    reason = large_pool_reason(MUTANT.trigger, MUTANT.trigger_layout, device)
    if reason is not None:
        pytest.skip(reason)
    return device


def test_the_pages_sit_past_both_wraps_and_hold_the_same_bits(cuda: torch.device) -> None:
    problem = build_problem(MUTANT.trigger, cuda)
    moved, _ = transform(problem, LARGE_POOL)
    used = problem.used_entries()
    starts = moved.block_table[used].long() * moved.kv_cache.stride(0)  # each used page's first element
    assert bool(((starts >= WRAPS[0]) & (starts < WRAPS[1])).any()) and bool((starts >= WRAPS[1]).any())
    ints = torch.int16  # bf16, compared as bits
    assert torch.equal(moved.kv_cache[moved.block_table[used].long()].view(ints),
                       problem.kv_cache[problem.block_table[used].long()].view(ints))


def test_32_bit_offsets_fail_past_2_32_and_the_correct_kernel_passes(cuda: torch.device) -> None:
    correct = run_case(TrtllmStyleBackend("correct_kernel", correct_kernel), MUTANT.trigger, MUTANT.trigger_layout,
                       cuda, MUTANT.trigger_transform)
    assert correct.verdict == "pass", correct.reason
    caught = run_case(TrtllmStyleBackend(MUTANT.name, MUTANT.fn), MUTANT.trigger, MUTANT.trigger_layout, cuda,
                      MUTANT.trigger_transform)
    assert caught.verdict == "fail" and NOT_BIT_IDENTICAL in caught.reason, caught.reason


def test_premerge_catches_the_32_bit_offset_mutant(cuda: torch.device) -> None:
    result = verify(TrtllmStyleBackend(MUTANT.name, MUTANT.fn), cuda, "premerge", max_examples=10)
    assert result.verdict == "fail", f"{MUTANT.name} survived {len(result.cases)} premerge cases"
    assert result.failure is not None and result.failure.metamorphic == LARGE_POOL, result.failure.describe()
