"""Bit-level equality of tensors: the repeat-call and input-snapshot checks, replay and the tests all ask it.

Bits, not values: NaN equals the same NaN payload, -0.0 differs from 0.0, and fp8 compares like any dtype.
"""
from __future__ import annotations

import torch

SAME_WIDTH_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_count(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The number of elements whose bits differ, as a 0-d int64 tensor on ``a``'s device (not read back); a
    change of shape or dtype counts as all of them."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return torch.tensor(max(a.numel(), b.numel()), device=a.device)
    ints = SAME_WIDTH_INTS[a.element_size()]
    a, b = a.view(ints), b.view(ints)  # a same-width view keeps any strides: no copy of a strided pool
    if a.device.type == "cpu" and torch.equal(a, b):  # a scan that allocates nothing, where `!=` makes a bool
        return torch.zeros((), dtype=torch.int64)    # tensor of the input's size (most inputs are unchanged)
    return (a != b).sum()


def changed_elements(a: torch.Tensor, b: torch.Tensor) -> int:
    """``changed_count`` read back to the host."""
    return int(changed_count(a, b))


def changed_elements_each(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:
    """``changed_elements`` of each pair, with one read back to the host for all of them."""
    if not pairs:
        return []
    counts = [changed_count(a, b) for a, b in pairs]
    return [int(n) for n in torch.stack([c.to(counts[0].device) for c in counts]).tolist()]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` have the same dtype, shape and bits."""
    return a.dtype == b.dtype and a.shape == b.shape and changed_elements(a, b) == 0
