"""The kill matrix through the flashmla backend: each mutant a CPU can catch (the 32-bit offset's shows only past
2^32 elements of the pool: tests/gpu/test_large_pool.py), behind the sgl-flash-mla wheel's
calling convention (mla_verify.kernels.flashmla_cpu; the one the H200 runs), must fail ``verify(...,
"premerge")`` on CPU -- so the backend's layout code (the cache view, table, scale, causal flag, LSE
transposition and base, bmm2 bridge) carries every fault to the harness instead of hiding it. The correct
kernel behind the same convention -- and behind upstream's -- must pass the same premerge run, or the kills
would mean nothing.

Three changes to the envelope, all on CPU only, none touching the layout code under test:
- pages of 16, 32 and 64 tokens (FlashMLA itself takes 64 only): with 64 alone a kernel that assumes 64-token
  pages is right on every problem FlashMLA accepts, and its mutant could not be killed;
- sequences up to 4096 tokens: every mutant still fails on the first premerge corner case or within a few drawn
  ones, but with FlashMLA's default 131072 Hypothesis drew a 100000-token failure for pages_sorted and took two
  minutes on CPU to shrink it (12 s at 4096); the faults shown past the mutants' 128-token split need no more;
- batches of at most 16 sequences: the faults between sequences (a shifted table row, pages read in id order)
  show with two, and every mutant still fails and the correct kernel still passes; with FlashMLA's 1024
  Hypothesis drew a 94-sequence, 115-head failure for causal_ignored and spent a minute comparing its shrinks.
"""
import pytest

from mla_verify.kernels.flashmla_cpu import CPU_ENVELOPE, stand_in_backend
from mla_verify.kernels.mutants import MUTANTS, correct_kernel
from mla_verify.run.engine import verify

ENVELOPE = CPU_ENVELOPE.narrowed(page_sizes=(16, 32, 64), max_seq_len=4096, max_batch=16)


@pytest.mark.parametrize("interface", ["wheel", "upstream"])
def test_the_correct_kernel_passes_premerge_through_the_flashmla_backend(interface: str):
    # upstream's SM90 kernel takes head dim 576 only: its no-rope cases would be skips, not judged cases
    envelope = ENVELOPE if interface == "wheel" else ENVELOPE.narrowed(dims=((512, 64),))
    result = verify(stand_in_backend(correct_kernel, envelope, interface), "cpu", "premerge")
    assert result.verdict == "pass", result.failure and result.failure.failures
    # premerge judges ~65 cases in this envelope (60 drawn and the corner cases); 40 still shows that the backend
    # ran most of them rather than skipping them as outside its envelope
    assert sum(c.verdict == "pass" for c in result.cases) >= 40


@pytest.mark.parametrize("name", sorted(n for n, m in MUTANTS.items() if m.device == "cpu"))
def test_premerge_through_the_flashmla_backend_kills_mutant(name):
    result = verify(stand_in_backend(MUTANTS[name].fn, ENVELOPE, "wheel"), "cpu", "premerge")
    assert result.verdict == "fail", f"mutant {name} survived {len(result.cases)} premerge cases"
    assert result.failure.failures
