"""The cheap finiteness checks that guard every gradient before it leaves a worker."""

from __future__ import annotations

import pytest
import torch

from distrain.runtime.faults import all_finite, grads_finite


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_bad_value_anywhere_is_caught(bad):
    t = torch.randn(10_001)
    assert all_finite(t)
    for i in (0, 5_000, 10_000):
        u = t.clone()
        u[i] = bad
        assert not all_finite(u)


def test_finite_values_whose_sum_overflows_are_still_finite():
    t = torch.full((8,), 3e38)
    assert not torch.isfinite(t.sum())  # a check by summing could not tell
    assert all_finite(t)
    t[3] = float("nan")
    assert not all_finite(t)


def test_grads_finite_over_parameters():
    params = [torch.nn.Parameter(torch.ones(4)) for _ in range(3)]
    params[0].grad = torch.full((4,), 3e38)
    params[1].grad = torch.ones(4)  # params[2] has no gradient
    assert grads_finite(params)
    params[1].grad[2] = float("inf")
    assert not grads_finite(params)
    assert grads_finite([torch.nn.Parameter(torch.ones(2))])


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")
def test_empty_and_sparse_gradients():
    assert all_finite(torch.zeros(0))
    grad = torch.sparse_coo_tensor(torch.tensor([[1, 7]]), torch.tensor([2.0, -1.0]), (10,))
    params = [torch.nn.Parameter(torch.ones(10)), torch.nn.Parameter(torch.ones(0))]
    params[0].grad, params[1].grad = grad, torch.zeros(0)
    assert all_finite(grad) and grads_finite(params)
    params[0].grad = torch.sparse_coo_tensor(torch.tensor([[1, 7]]), torch.tensor([2.0, float("nan")]), (10,))
    assert not all_finite(params[0].grad) and not grads_finite(params)
    params[0].grad = torch.ones(10)
    params.append(torch.nn.Parameter(torch.ones(3, dtype=torch.float64)))  # mixed dtypes
    params[2].grad = torch.tensor([1.0, 3e300, 0.0], dtype=torch.float64)
    assert grads_finite(params)
    params[2].grad[1] = float("-inf")
    assert not grads_finite(params)


def test_sums_that_overflow_only_together_or_in_half_precision_are_still_finite():
    params = [torch.nn.Parameter(torch.ones(1, dtype=torch.float64)) for _ in range(2)]
    for p in params:
        p.grad = torch.full((1,), 1e308, dtype=torch.float64)  # each sum finite, their total not
    assert grads_finite(params)
    half = torch.full((4,), 60000.0, dtype=torch.float16)  # its float16 sum overflows
    assert not torch.isfinite(half.sum()) and all_finite(half)
    params.append(torch.nn.Parameter(torch.ones(4, dtype=torch.float16)))
    params[2].grad = half.clone()
    assert grads_finite(params)
    params[2].grad[2] = float("nan")
    assert not all_finite(params[2].grad) and not grads_finite(params)
