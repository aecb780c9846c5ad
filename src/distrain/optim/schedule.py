"""Learning rate: the linear scaling rule and a warm-up-then-decay schedule (Goyal et al. 2017)."""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass

import torch

from distrain.errors import ConfigError

__all__ = ["DECAYS", "LRSchedule", "scaled_lr"]

DECAYS: tuple[str, ...] = ("cosine", "none", "step")
"""Names of the decays that :class:`LRSchedule` knows."""


def scaled_lr(
    base_lr: float, global_batch: int, reference_batch: int, enabled: bool = True
) -> float:
    """Return ``base_lr * global_batch / reference_batch``, the linear scaling rule.

    A larger batch averages more samples per step, so the gradient is less noisy and the step can
    be proportionally longer (Goyal et al. 2017, "Accurate, Large Minibatch SGD").

    Args:
        base_lr: the learning rate tuned for ``reference_batch`` samples per step.
        global_batch: samples per optimizer step summed over all workers.
        reference_batch: the batch size at which ``base_lr`` applies unchanged.
        enabled: when ``False``, return ``base_lr`` as is.

    Example::

        >>> scaled_lr(0.1, global_batch=4 * 64, reference_batch=64)
        0.4
    """
    _check_finite("--lr", base_lr, minimum=0.0, strict=True)
    _check_count("--batch-size", global_batch)
    _check_count("--reference-batch", reference_batch)
    if not enabled:
        return float(base_lr)
    return float(base_lr) * global_batch / reference_batch


@dataclass(frozen=True)
class LRSchedule:
    """Linear warm-up from ``base_lr`` to ``peak_lr``, then a decay, indexed by optimizer step.

    After ``warmup_steps`` steps the learning rate is ``peak_lr`` and then follows ``decay``:

    * ``"none"``: stays at ``peak_lr``;
    * ``"cosine"``: half a cosine from ``peak_lr`` down to 0 at ``total_steps``;
    * ``"step"``: multiplied by 0.1 from 50% of ``total_steps`` and again from 75%.

    Steps past ``total_steps`` keep the final value.

    Args:
        peak_lr: learning rate at the end of the warm-up, usually from :func:`scaled_lr`.
        base_lr: learning rate at step 0, where the warm-up starts.
        warmup_steps: length of the warm-up in steps; 0 starts at ``peak_lr``.
        total_steps: length of the whole run in steps.
        decay: one of :data:`DECAYS`.

    Example::

        >>> schedule = LRSchedule(peak_lr=0.4, base_lr=0.1, warmup_steps=60, total_steps=900,
        ...                       decay="cosine")
        >>> schedule.lr_at(0), schedule.lr_at(60), schedule.lr_at(900)
        (0.1, 0.4, 0.0)
        >>> lr = schedule.apply(optimizer, step)  # each step, before optimizer.step()
    """

    peak_lr: float
    base_lr: float
    warmup_steps: int
    total_steps: int
    decay: str = "none"

    def __post_init__(self) -> None:
        _check_finite("--lr", self.peak_lr, minimum=0.0, strict=True)
        _check_finite("--lr", self.base_lr, minimum=0.0, strict=False)
        if isinstance(self.warmup_steps, bool) or not isinstance(
            self.warmup_steps, numbers.Integral
        ):
            raise ConfigError(
                "--warmup-epochs",
                f"warm-up must be a whole number of steps, got {self.warmup_steps!r}",
            )
        if self.warmup_steps < 0:
            raise ConfigError(
                "--warmup-epochs", f"must be >= 0, got {self.warmup_steps} warm-up steps"
            )
        _check_count("--epochs", self.total_steps)
        if self.decay not in DECAYS:
            raise ConfigError(
                "--lr-decay", f"unknown decay {self.decay!r}; choose one of: {', '.join(DECAYS)}"
            )
        if self.warmup_steps > self.total_steps:
            warnings.warn(
                f"warm-up ({self.warmup_steps} steps) is longer than the run ({self.total_steps} "
                "steps); the learning rate never reaches its peak",
                stacklevel=2,
            )

    def lr_at(self, step: int) -> float:
        """Return the learning rate for optimizer step ``step`` (0-based).

        Args:
            step: number of optimizer steps already taken; must be >= 0.

        Example::

            >>> LRSchedule(1.0, 0.0, warmup_steps=10, total_steps=100).lr_at(5)
            0.5
        """
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if step < self.warmup_steps:
            return self.base_lr + (self.peak_lr - self.base_lr) * step / self.warmup_steps
        if self.decay == "cosine":
            span = self.total_steps - self.warmup_steps
            progress = 1.0 if span <= 0 else min(1.0, (step - self.warmup_steps) / span)
            return 0.5 * self.peak_lr * (1.0 + math.cos(math.pi * progress))
        if self.decay == "step":
            return self.peak_lr * 0.1 ** sum(step >= f * self.total_steps for f in (0.5, 0.75))
        return self.peak_lr

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set the learning rate of every parameter group to ``lr_at(step)`` and return it.

        Args:
            optimizer: any optimizer whose param groups have an ``"lr"`` entry.
            step: number of optimizer steps already taken.

        Example::

            >>> lr = schedule.apply(optimizer, step)
            >>> optimizer.step()
        """
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr


def _check_finite(setting: str, value: float, *, minimum: float, strict: bool) -> None:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < minimum or (strict and value == minimum):
        relation = ">" if strict else ">="
        raise ConfigError(setting, f"must be a finite number {relation} {minimum:g}, got {value!r}")


def _check_count(setting: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ConfigError(setting, f"must be an integer >= 1, got {value!r}")
