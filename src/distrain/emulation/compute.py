"""Compute slowdown: a worker at factor f takes f times as long for each step's computation."""

from __future__ import annotations

import time


class ComputeSlowdown:
    """Stretch measured compute time by a factor, by sleeping the difference.

    Example::

        slow = ComputeSlowdown(4.0)
        t0 = time.perf_counter(); loss.backward()
        slow.after_compute(time.perf_counter() - t0)  # sleeps 3x the backward time
    """

    def __init__(self, factor: float = 1.0) -> None:
        if not factor >= 1:
            raise ValueError(f"a slowdown factor must be >= 1, got {factor!r}")
        self.factor = factor
        self.total_extra_s = 0.0

    def after_compute(self, seconds: float) -> float:
        """Sleep ``(factor - 1) * seconds``; return the time added."""
        extra = (self.factor - 1.0) * max(seconds, 0.0)
        if extra > 0:
            end = time.perf_counter() + extra
            time.sleep(extra)
            while time.perf_counter() < end:  # sleep can wake a little early on some systems
                pass
            self.total_extra_s += extra
        return extra
