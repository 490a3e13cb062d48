"""mla_verify.core.bits: equality of bits, not of values."""
from __future__ import annotations

import pytest
import torch

from mla_verify.core.bits import changed_elements, changed_elements_each, same_bits


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int32])
def test_a_copy_is_the_same_and_one_changed_element_is_counted(dtype: torch.dtype) -> None:
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(dtype)
    assert same_bits(a, a.clone()) and changed_elements(a, a.clone()) == 0
    b = a.clone()
    b[1, 2] = 0
    assert not same_bits(a, b) and changed_elements(a, b) == 1


def test_bits_not_values() -> None:
    nan = torch.tensor([1.0, float("nan")])
    assert same_bits(nan, nan.clone())  # NaN != NaN as a value, but its bits are the same
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))  # equal values, different bits
    assert not same_bits(nan, torch.tensor([1.0, 2.0]))


def test_shape_or_dtype_changes_count_as_every_element() -> None:
    a = torch.zeros(2, 3)
    assert not same_bits(a, a.double()) and changed_elements(a, a.double()) == 6
    assert not same_bits(a, a.reshape(3, 2)) and changed_elements(a, a.reshape(3, 2)) == 6
    assert not same_bits(torch.zeros(0), torch.zeros(0, 3))  # both empty, still not the same tensor


def test_non_contiguous_views_compare_by_their_elements() -> None:
    a = torch.arange(12.0).reshape(3, 4)
    assert same_bits(a.t(), a.t().contiguous())
    b = a.clone()
    b[0, 1] = -1
    assert changed_elements(a.t(), b.t()) == 1 and changed_elements(a[:, ::2], b[:, ::2]) == 0


def test_changed_elements_each_counts_every_pair() -> None:
    a = torch.zeros(4)
    b = a.clone()
    b[:3] = 1
    pairs = [(a, a.clone()), (a, b), (a, a.double())]
    assert changed_elements_each(pairs) == [changed_elements(x, y) for x, y in pairs] == [0, 3, 4]
    assert changed_elements_each([]) == []
