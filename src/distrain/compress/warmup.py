"""Density warm-up: train dense first, then let the kept ratio fall to its target.

Early gradients change fast and error feedback has little history to lean on, so sparsifying
from the first step costs accuracy (Lin et al. 2018, Deep Gradient Compression, warm up the same
way). The schedule, in epochs of training done:

* ``epoch < warmup``: dense (``None``: the plain dense all-reduce);
* ``warmup <= epoch < warmup + decay``: ``target ** ((epoch - warmup) / decay)``, an exponential
  fall from 1 to ``target`` (e.g. 1, 0.1, 0.01 at the start, middle and end for target 0.01);
* afterwards: ``target``;
* with a ``hold`` ratio above ``target``: the ratio never falls below ``hold`` before epoch
  ``hold_until``, and then falls from ``hold`` to ``target`` over ``decay`` epochs in the same
  exponential way. At a moderate density the sparsified run keeps pace with dense training
  through the first epochs, where 1% held it back on a plateau it left epochs later.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DensityWarmup:
    """The kept ratio as a function of training progress.

    Args:
        target: the compressor's ratio (None for compressors without one: they switch from
            dense to compressed at ``warmup`` and ignore ``decay``).
        warmup: epochs of dense training.
        decay: epochs of exponential fall from ratio 1 to ``target`` after the warm-up (and from
            ``hold`` to ``target`` after ``hold_until``).
        hold: the lowest ratio before ``hold_until`` (0: none; ignored unless above ``target``).
        hold_until: the epoch until which ``hold`` applies.

    Example::

        >>> s = DensityWarmup(target=0.01, warmup=1, decay=2)
        >>> s.dense(0.5), s.ratio(2.0), s.ratio(5.0)
        (True, 0.1, 0.01)
    """

    target: float | None
    warmup: float = 0.0
    decay: float = 0.0
    hold: float = 0.0
    hold_until: float = 0.0

    def dense(self, epoch: float) -> bool:
        return epoch < self.warmup

    def ratio(self, epoch: float) -> float | None:
        """The ratio to compress with at ``epoch`` (epochs done), once past the dense warm-up."""
        if self.target is None or self.decay <= 0:
            return self.target
        progress = (epoch - self.warmup) / self.decay
        ratio = self.target if progress >= 1 else self.target ** max(0.0, progress)
        if self.hold > self.target:
            if epoch < self.hold_until:
                return max(ratio, self.hold)
            late = min(1.0, (epoch - self.hold_until) / self.decay)
            return max(ratio, self.hold * (self.target / self.hold) ** late)
        return ratio
