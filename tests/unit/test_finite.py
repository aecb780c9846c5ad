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
    assert not torch.isfinite(t.sum())  # the fast path cannot tell; the exact check decides
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
