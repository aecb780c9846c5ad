"""Optimizers by name: SGD with momentum, Adam, and LARS (layer-wise adaptive rate scaling)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch

from distrain.errors import ConfigError

__all__ = ["LARS", "OPTIMIZERS", "build_optimizer"]

OPTIMIZERS: tuple[str, ...] = ("adam", "lars", "sgd")
"""Names that :func:`build_optimizer` accepts."""


def build_optimizer(
    name: str,
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    lr: float,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    *,
    trust_coefficient: float = 0.001,
) -> torch.optim.Optimizer:
    """Build the optimizer called ``name``.

    ``sgd`` is ``torch.optim.SGD`` with heavy-ball momentum (no Nesterov); ``adam`` is
    ``torch.optim.Adam`` with ``momentum`` as its ``beta1``; ``lars`` is :class:`LARS`.

    Args:
        name: one of :data:`OPTIMIZERS`.
        params: parameters or parameter groups, as for any torch optimizer.
        lr: learning rate; a schedule usually overwrites it every step.
        momentum: momentum (sgd, lars) or ``beta1`` (adam), in ``[0, 1)``.
        weight_decay: L2 penalty coefficient, >= 0.
        trust_coefficient: LARS's ``eta``, the step size relative to the weight norm.

    Example::

        >>> optimizer = build_optimizer("sgd", model.parameters(), lr=0.4, momentum=0.9)
    """
    if name not in OPTIMIZERS:
        raise ConfigError(
            "--optimizer", f"unknown optimizer {name!r}; choose one of: {', '.join(OPTIMIZERS)}"
        )
    _check_number("--lr", lr, low=0.0, low_ok=False)
    _check_number("--momentum", momentum, low=0.0, low_ok=True, high=1.0)
    _check_number("--weight-decay", weight_decay, low=0.0, low_ok=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(momentum, 0.999), weight_decay=weight_decay)
    return LARS(
        params,
        lr=lr,
        momentum=momentum,
        weight_decay=weight_decay,
        trust_coefficient=trust_coefficient,
    )


class LARS(torch.optim.Optimizer):
    """SGD with momentum whose step for each tensor is scaled by its weight-to-gradient norm ratio.

    For a tensor ``p`` with gradient ``g`` (You et al. 2017, "Large Batch Training of
    Convolutional Networks")::

        local_lr = trust_coefficient * ||p|| / (||g|| + weight_decay * ||p|| + eps)
        v = momentum * v + lr * local_lr * (g + weight_decay * p)
        p = p - v

    with ``local_lr = 1`` when ``||p||`` or ``||g||`` is 0. Every layer then moves by about
    ``lr * trust_coefficient`` of its own norm per step, whatever its gradient scale, which is
    what lets very large batches use a large ``lr``. Biases and normalisation weights (tensors
    with at most one dimension) get plain SGD with momentum and no weight decay when
    ``exclude_1d`` is set, as is usual.

    Args:
        params: parameters or parameter groups.
        lr: global learning rate.
        momentum: momentum coefficient in ``[0, 1)``.
        weight_decay: L2 penalty coefficient, >= 0.
        trust_coefficient: ``eta``, > 0.
        eps: added to the denominator of the trust ratio.
        exclude_1d: skip adaptation and weight decay for tensors with ``ndim <= 1``.

    Example::

        >>> optimizer = LARS(model.parameters(), lr=2.0, momentum=0.9, weight_decay=5e-4)
        >>> loss.backward()
        >>> optimizer.step()
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        exclude_1d: bool = True,
    ) -> None:
        _check_number("--lr", lr, low=0.0, low_ok=False)
        _check_number("--momentum", momentum, low=0.0, low_ok=True, high=1.0)
        _check_number("--weight-decay", weight_decay, low=0.0, low_ok=True)
        _check_number("--trust-coefficient", trust_coefficient, low=0.0, low_ok=False)
        _check_number("eps", eps, low=0.0, low_ok=True)
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            trust_coefficient=trust_coefficient,
            eps=eps,
            exclude_1d=exclude_1d,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Take one step; ``closure`` re-evaluates the loss, as for any torch optimizer."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum = group["lr"], group["momentum"]
            weight_decay, eta, eps = group["weight_decay"], group["trust_coefficient"], group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if group["exclude_1d"] and p.ndim <= 1:
                    update = grad.mul(lr)
                else:
                    p_norm = torch.linalg.vector_norm(p)
                    g_norm = torch.linalg.vector_norm(grad)
                    trust = eta * p_norm / (g_norm + weight_decay * p_norm + eps)
                    local_lr = torch.where(
                        (p_norm > 0) & (g_norm > 0), trust, torch.ones_like(trust)
                    )
                    update = grad.add(p, alpha=weight_decay).mul_(local_lr * lr)
                if momentum != 0:
                    state = self.state[p]
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        state["momentum_buffer"] = buf = update.clone()
                    else:
                        buf.mul_(momentum).add_(update)
                    update = buf
                p.sub_(update)
        return loss


def _check_number(
    setting: str, value: float, *, low: float, low_ok: bool, high: float | None = None
) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value >= low if low_ok else value > low) and (high is None or value < high)
    if not ok:
        allowed = f"{'>=' if low_ok else '>'} {low:g}" + (
            "" if high is None else f" and < {high:g}"
        )
        raise ConfigError(setting, f"must be a finite number {allowed}, got {value!r}")
