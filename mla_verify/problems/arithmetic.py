"""What a kernel's arithmetic rounds, as its backend declares it: the tolerance model's baseline emulates exactly
that (judge/emulation.py), so a kernel is held to the error its own precision makes, not to a hand-widened bound.

A problem-side notion, like the envelope: backends declare it (``Backend.arithmetic_for``) and the judge reads it.
No declaration is the suite's plain same-precision baseline (``DEFAULT``): ``q * bmm1`` rounded to bf16 before
the product, fp32 scores, the probabilities exp(s - row max) rounded to the operand precision of the problem's
dtype (bf16, or e4m3 for fp8), their fp32 sum as the denominator, a bf16 output.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# how bmm1 reaches the scores: folded into q and rounded to bf16 before the product (the plain baseline), or
# multiplied into the fp32 scores (a kernel that keeps the scale out of its operands: FlashInfer's FA paths,
# FlashMLA)
SCALE_IN_Q, SCALE_ON_SCORES = "q-bf16", "fp32-scores"
# the denominator: the fp32 probabilities' sum, or the sum of the rounded ones the second product used
SUM_FP32, SUM_ROUNDED = "fp32", "rounded"
# the order a kernel visits its key blocks in: the running max (and so each probability's rounding) depends on it
FORWARD, REVERSE = "forward", "reverse"
# (split start, split end) in keys, per request: a split-KV schedule (each split has its own running max and
# accumulators, merged by their LSE), from the batch's lengths, the query rows per KV head and the device's SM count
SplitSchedule = Callable[[Sequence[int], int, int], "list[list[tuple[int, int]]]"]


@dataclass(frozen=True)
class Accumulator:
    """A tensor core's limited-precision accumulation, as Hopper's fp8 WGMMA does it (a model, measured on the
    hardware: benchmarks/flashmla_fp8_analysis.py): each instruction adds ``k_step`` exact products to the
    accumulator; all ``k_step + 1`` terms are aligned to the largest one's leading bit and truncated toward zero
    below ``bits`` fraction bits of it, then summed exactly. So a long sum loses up to ``k_step + 1`` units of
    its own 2^-bits per step, and a constant one loses them all the same way (a bias, not noise)."""

    k_step: int = 32
    bits: int = 13


@dataclass(frozen=True)
class Arithmetic:
    """A kernel's declared arithmetic. Every field names one rounding the kernel makes; the defaults are the plain
    same-precision baseline's (module docstring)."""

    name: str  # what reports call the emulation that judged a case
    scale: str = SCALE_IN_Q
    qk: Accumulator | None = None  # None: exact products summed in fp32
    p_dtype: str | None = None  # "bf16" or "e4m3"; None: the problem dtype's (bf16, e4m3 for fp8)
    # probabilities relative to a running max over blocks of this many keys, visited in ``order`` (0: the row's max)
    p_block: int = 0
    order: str = REVERSE
    row_sum: str = SUM_FP32
    pv: Accumulator | None = None  # None: the second product summed in fp32
    splits: SplitSchedule | None = None  # None: one split per request

    @property
    def emulation(self) -> str:
        """What a verdict calls the baseline that judged it: this name, "" for the plain baseline (DEFAULT)."""
        return "" if self == DEFAULT else self.name

    @property
    def sequential(self) -> bool:
        """Whether the emulation must walk the key blocks in order (an accumulator model or splits)."""
        return self.pv is not None or self.splits is not None


DEFAULT = Arithmetic("the plain same-precision baseline (q * bmm1 in bf16, fp32 scores, P in the operand dtype "
                     "relative to the row max, fp32 row sum, bf16 out)")
