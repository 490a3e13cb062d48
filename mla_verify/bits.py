"""Bit-level equality of tensors: the repeat-call and input-snapshot checks, replay and the tests all ask it.

Bits, not values: NaN equals the same NaN payload, -0.0 differs from 0.0, and fp8 compares like any dtype.
"""
from __future__ import annotations

import torch

_SAME_WIDTH_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_elements(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of elements whose bits differ; a change of shape or dtype counts as all of them."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return max(a.numel(), b.numel())
    ints = _SAME_WIDTH_INTS[a.element_size()]
    return int((a.contiguous().view(ints) != b.contiguous().view(ints)).sum())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same dtype, shape and bits."""
    return a.dtype == b.dtype and a.shape == b.shape and changed_elements(a, b) == 0
